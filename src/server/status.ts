/**
 * The one place that maps errors to gRPC status codes. Domain errors (CsiError) carry their code and a
 * message written for the caller. Out-of-space errors from the filesystem become RESOURCE_EXHAUSTED.
 * Everything else is INTERNAL with a generic message; its details go to the log only.
 */
import { status as Code } from '@grpc/grpc-js';
import { CallStopped, CommandError } from '../exec/runner.js';
import { CsiError, type DomainKind, DomainError, errnoCode, type ErrorKind, isNoSpace } from '../errors.js';

const KIND_TO_CODE: Record<ErrorKind, Code> = {
  invalid_argument: Code.INVALID_ARGUMENT,
  not_found: Code.NOT_FOUND,
  already_exists: Code.ALREADY_EXISTS,
  failed_precondition: Code.FAILED_PRECONDITION,
  out_of_range: Code.OUT_OF_RANGE,
  resource_exhausted: Code.RESOURCE_EXHAUSTED,
  aborted: Code.ABORTED,
  unimplemented: Code.UNIMPLEMENTED,
  deadline_exceeded: Code.DEADLINE_EXCEEDED,
  cancelled: Code.CANCELLED,
  unavailable: Code.UNAVAILABLE,
  internal: Code.INTERNAL,
};

/** The pool's and host's own words → the code the CSI spec uses for them. */
const DOMAIN_TO_CODE: Record<DomainKind, Code> = {
  invalid: Code.INVALID_ARGUMENT,
  not_found: Code.NOT_FOUND,
  mismatch: Code.ALREADY_EXISTS,
  conflict: Code.FAILED_PRECONDITION,
  unsafe: Code.FAILED_PRECONDITION,
  busy: Code.ABORTED,
  no_space: Code.RESOURCE_EXHAUSTED,
  out_of_range: Code.OUT_OF_RANGE,
  unavailable: Code.UNAVAILABLE,
  internal: Code.INTERNAL,
};

export interface MappedStatus {
  code: Code;
  message: string;
  /** True when the caller got a generic message and the log must carry the details. */
  unexpected: boolean;
}

const errPath = (err: unknown): string => {
  const p = (err as { path?: unknown }).path;
  return typeof p === 'string' ? ` at ${p}` : '';
};

/** What a file operation answers when a network filesystem (the pool's, or a FUSE one) cannot be reached. */
const UNREACHABLE = new Set(['ENOTCONN', 'ESTALE', 'EHOSTDOWN', 'EHOSTUNREACH', 'ENETUNREACH', 'ETIMEDOUT']);

export function toStatus(err: unknown): MappedStatus {
  if (err instanceof CsiError) {
    return { code: KIND_TO_CODE[err.kind], message: err.message, unexpected: err.kind === 'internal' };
  }
  if (err instanceof DomainError) {
    return { code: DOMAIN_TO_CODE[err.kind], message: err.message, unexpected: err.kind === 'internal' };
  }
  if (err instanceof CallStopped) {
    return err.reason === 'cancelled'
      ? {
          code: Code.CANCELLED,
          message: 'The call was cancelled; what it had done was undone.',
          unexpected: false,
        }
      : {
          code: Code.DEADLINE_EXCEEDED,
          message: 'The call ran past its deadline; what it had done was undone.',
          unexpected: false,
        };
  }
  if (errnoCode(err) === 'EFBIG' || (err instanceof CommandError && /File too large/i.test(err.stderr))) {
    return {
      code: Code.OUT_OF_RANGE,
      message: "A file that large does not fit the pool's filesystem (EFBIG: its largest file is smaller).",
      unexpected: false,
    };
  }
  if (
    isNoSpace(err) ||
    (err instanceof CommandError && /No space left on device|Disk quota exceeded/i.test(err.stderr))
  ) {
    return {
      code: Code.RESOURCE_EXHAUSTED,
      message: 'The pool filesystem is out of space.',
      unexpected: false,
    };
  }
  const errno = errnoCode(err);
  if (errno !== undefined && UNREACHABLE.has(errno)) {
    return {
      code: Code.UNAVAILABLE,
      message: `A filesystem the driver uses (the pool's, or one at a path it was given) does not answer (${errno}${errPath(err)}); retry once it is back.`,
      unexpected: true,
    };
  }
  if (err instanceof CommandError && err.reason === 'timeout') {
    return {
      code: Code.DEADLINE_EXCEEDED,
      message: `The command ${err.command} did not finish in time.`,
      unexpected: true,
    };
  }
  if (err instanceof CommandError && err.reason === 'cancelled') {
    return { code: Code.CANCELLED, message: 'The call was cancelled.', unexpected: false };
  }
  return {
    code: Code.INTERNAL,
    message: 'The driver hit an unexpected error; its log has the details.',
    unexpected: true,
  };
}

export const codeName = (code: Code): string => Code[code];
