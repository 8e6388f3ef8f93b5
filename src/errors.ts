/**
 * Errors with a one-sentence message meant for the caller. src/server/status.ts is the only place that
 * turns them (and anything else) into gRPC codes.
 *
 * Two vocabularies:
 *  - DomainError: what the pool, the host and the node algorithms say about the world (not found, in
 *    conflict, unsafe, busy, out of space...). They know nothing of gRPC.
 *  - CsiError: a gRPC code chosen by the CSI layer itself, where the spec asks for a particular one.
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

/** What went wrong, in the pool's and the host's own terms. */
export type DomainKind =
  /** The request names something impossible (a pool path as a mount target...). */
  | 'invalid'
  /** The thing does not exist. */
  | 'not_found'
  /** It exists, with other attributes than asked for. */
  | 'mismatch'
  /** The state of the world forbids it now (in use elsewhere, not staged yet...). */
  | 'conflict'
  /** Going on could destroy or hide data (an unreadable record, a foreign filesystem...). */
  | 'unsafe'
  /** Someone else is changing it right now; retry. */
  | 'busy'
  /** The pool or a node has no room (space, attach limit). */
  | 'no_space'
  /** A size outside what can be made. */
  | 'out_of_range'
  /** Something this driver relies on does not answer (a hung pool filesystem). */
  | 'unavailable'
  /** A failure whose message is safe to show; the cause stays in the log. */
  | 'internal';

export class DomainError extends Error {
  override readonly name = 'DomainError';
  constructor(
    readonly kind: DomainKind,
    message: string,
    options?: ErrorOptions,
  ) {
    super(message, options);
  }
}

const domain =
  (kind: DomainKind) =>
  (message: string, cause?: unknown): DomainError =>
    new DomainError(kind, message, cause === undefined ? undefined : { cause });

export const invalid = domain('invalid');
export const missing = domain('not_found');
export const mismatch = domain('mismatch');
export const conflict = domain('conflict');
export const unsafe = domain('unsafe');
export const busy = domain('busy');
export const noSpace = domain('no_space');
export const outsideRange = domain('out_of_range');
export const unavailable = domain('unavailable');
export const broken = domain('internal');

/** The errno code of a Node.js system error, if it is one. */
export function errnoCode(err: unknown): string | undefined {
  if (err instanceof Error && 'code' in err && typeof err.code === 'string') return err.code;
  return undefined;
}

export const isNotFoundErrno = (err: unknown): boolean => errnoCode(err) === 'ENOENT';

export function isNoSpace(err: unknown): boolean {
  const code = errnoCode(err);
  return code === 'ENOSPC' || code === 'EDQUOT';
}
