/**
 * Domain errors. Code anywhere in the driver throws these with a one-sentence message meant for the
 * caller; src/server/status.ts is the only place that turns them (and anything else) into gRPC codes.
 */

export type ErrorKind =
  | 'invalid_argument'
  | 'not_found'
  | 'already_exists'
  | 'failed_precondition'
  | 'out_of_range'
  | 'resource_exhausted'
  | 'aborted'
  | 'unimplemented'
  | 'deadline_exceeded'
  | 'cancelled'
  | 'unavailable'
  | 'internal';

export class CsiError extends Error {
  override readonly name = 'CsiError';
  constructor(
    readonly kind: ErrorKind,
    message: string,
    options?: ErrorOptions,
  ) {
    super(message, options);
  }
}

export const invalidArgument = (message: string, cause?: unknown): CsiError =>
  new CsiError('invalid_argument', message, { cause });
export const notFound = (message: string): CsiError => new CsiError('not_found', message);
export const alreadyExists = (message: string): CsiError => new CsiError('already_exists', message);
export const failedPrecondition = (message: string, cause?: unknown): CsiError =>
  new CsiError('failed_precondition', message, { cause });
export const outOfRange = (message: string): CsiError => new CsiError('out_of_range', message);
export const resourceExhausted = (message: string, cause?: unknown): CsiError =>
  new CsiError('resource_exhausted', message, { cause });
export const aborted = (message: string): CsiError => new CsiError('aborted', message);
export const unimplemented = (message: string): CsiError => new CsiError('unimplemented', message);
/** An internal error whose message is safe to show the caller; the cause stays in the log. */
export const internal = (message: string, cause?: unknown): CsiError =>
  new CsiError('internal', message, { cause });

/** The errno code of a Node.js system error, if it is one. */
export function errnoCode(err: unknown): string | undefined {
  if (err instanceof Error && 'code' in err && typeof err.code === 'string') return err.code;
  return undefined;
}

export const isNotFoundErrno = (err: unknown): boolean => errnoCode(err) === 'ENOENT';

export function isNoSpace(err: unknown): boolean {
  const code = errnoCode(err);
  return code === 'ENOSPC' || code === 'EDQUOT' || code === 'EFBIG';
}
