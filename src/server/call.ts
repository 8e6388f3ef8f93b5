/**
 * The per-call wrapper every RPC goes through: request id, validation before any side effect,
 * in-flight keys (ABORTED for the loser), a context whose commands obey the RPC's deadline, one log
 * line per call with duration and final code (secrets redacted), and the error → status mapping.
 */
import { randomBytes } from 'node:crypto';
import type * as grpc from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { CsiError, aborted, unimplemented } from '../errors.js';
import { CommandError, type Exec, type Runner } from '../exec/runner.js';
import { requestRedactor } from './proto.js';
import type { InFlight } from './inflight.js';
import { codeName, toStatus } from './status.js';

/** One call's context: its id and method, and an Exec whose commands obey its deadline and cancellation. */
export interface CallContext extends Exec {
  readonly reqId: string;
  readonly method: string;
  readonly log: Logger;
  readonly signal: AbortSignal;
  readonly deadline: number;
}

export interface Prepared<Res> {
  readonly locks: readonly string[];
  run(ctx: CallContext): Promise<Res>;
}

/** An RPC: `prepare` validates synchronously (no side effects) and names the keys to hold. */
export interface Method<Req, Res> {
  readonly quiet: boolean;
  prepare(request: Req): Prepared<Res>;
}

export interface MethodDef<Req, Res, V> {
  /** Pure request checks; throws CsiError('invalid_argument', …). */
  validate: (request: Req) => V;
  /** In-flight keys for the validated request. */
  locks?: (v: V) => readonly string[];
  run: (v: V, ctx: CallContext) => Promise<Res>;
  /** Log at debug instead of info (polling calls such as Probe). */
  quiet?: boolean;
}

export function method<Req, Res, V>(def: MethodDef<Req, Res, V>): Method<Req, Res> {
  return {
    quiet: def.quiet ?? false,
    prepare(request) {
      const v = def.validate(request);
      return { locks: def.locks?.(v) ?? [], run: (ctx) => def.run(v, ctx) };
    },
  };
}

export interface CallObserver {
  /** A call began (every call that begins ends in exactly one observe). */
  begin?(service: string, method: string): void;
  observe(service: string, method: string, code: string, seconds: number): void;
}

export interface CallDeps {
  log: Logger;
  runner: Runner;
  inflight: InFlight;
  observer?: CallObserver;
  /** Tracks calls in flight so shutdown can wait for them. */
  tracker?: { begin(): void; end(): void };
}

/**
 * Answers a call (unary or streaming) and counts it out, whatever happens while answering. A failure to
 * answer (the metrics, the transport) is logged: thrown from here it would be an unhandled rejection,
 * which ends the process.
 */
export function answerCountingOut(answer: () => void, log: () => Logger, tracker: CallDeps['tracker']): void {
  try {
    answer();
  } catch (failure) {
    log().error({ err: failure }, 'could not answer the call');
  } finally {
    tracker?.end();
  }
}

type UnaryHandler<Req, Res> = grpc.handleUnaryCall<Req, Res>;

const REQUEST_ID_PREFIX = randomBytes(4).toString('hex');
let requestSeq = 0;

/** The next call's number: a call takes it when it arrives, and shows it as its id only when asked. */
export function nextRequestSeq(): number {
  return ++requestSeq;
}

/**
 * A call's id for its log lines: unique in this process (a counter), and told apart from other
 * processes' and restarts' by a random prefix drawn once (cheaper than random bytes per call).
 */
export function requestId(seq = nextRequestSeq()): string {
  return `${REQUEST_ID_PREFIX}${seq.toString(16).padStart(4, '0')}`;
}

export function subjectOf(request: unknown): Record<string, string> {
  if (typeof request !== 'object' || request === null) return {};
  const r = request as Record<string, unknown>;
  const out: Record<string, string> = {};
  for (const key of [
    'volume_id',
    'snapshot_id',
    'source_volume_id',
    'group_snapshot_id',
    'base_snapshot_id',
    'target_snapshot_id',
    'node_id',
    'name',
  ]) {
    const v = r[key];
    if (typeof v === 'string' && v !== '') out[key] = v.length > 256 ? `${v.slice(0, 256)}…` : v;
  }
  return out;
}

export function causeChain(err: unknown): unknown[] {
  const out: unknown[] = [];
  let cur: unknown = err;
  for (let i = 0; i < 5 && cur !== undefined; i++) {
    if (cur instanceof CommandError) {
      out.push({
        command: cur.command,
        args: cur.args,
        exitCode: cur.exitCode,
        reason: cur.reason,
        stderr: cur.stderr,
      });
    } else if (cur instanceof Error) {
      out.push({ type: cur.name, message: cur.message, stack: cur.stack });
    } else {
      out.push(cur);
    }
    cur = cur instanceof Error ? cur.cause : undefined;
  }
  return out;
}

/** When the caller gives up, in epoch ms (Infinity: never), from the call's deadline. */
export function deadlineOf(call: { getDeadline(): grpc.Deadline }): number {
  const raw = call.getDeadline();
  return raw instanceof Date ? raw.getTime() : Number.isFinite(raw) ? raw : Infinity;
}

/**
 * The one log line and metric of a call that failed, with the gRPC status it answers: a mapped
 * failure at warn, an unexpected one at error with its cause chain. `fields` adds what the call knows.
 */
export function reportFailure(
  err: unknown,
  log: Logger,
  fields: Record<string, unknown>,
  observe: (code: string) => void,
): { code: grpc.status; details: string; name: string } {
  const mapped = toStatus(err);
  const code = codeName(mapped.code);
  const line = {
    ...fields,
    code,
    error: mapped.message,
    ...(mapped.unexpected || !(err instanceof CsiError) ? { cause: causeChain(err) } : {}),
  };
  if (mapped.unexpected) log.error(line, 'call failed');
  else log.warn(line, 'call failed');
  observe(code);
  return { code: mapped.code, details: mapped.message, name: code };
}

export function unaryHandler<Req, Res>(
  service: string,
  name: string,
  resolve: () => Method<Req, Res> | undefined,
  deps: CallDeps,
): UnaryHandler<Req, Res> {
  const redact = requestRedactor(service, name);
  const fullName = `${service}.${name}`;
  return (call, callback) => {
    const impl = resolve();
    const started = performance.now();
    const seq = nextRequestSeq();
    let reqId: string | undefined;
    const id = (): string => (reqId ??= requestId(seq));
    // What most calls never touch is made only when touched: the id's text, the child logger (a call that logs
    // nothing at this level, such as a polled Probe, makes none) and the cancellation signal with its
    // listener (a call that runs no command and waits on nothing never reads it). grpc-js sets
    // `call.cancelled` before it emits "cancelled", so a signal made late starts aborted.
    let log: Logger | undefined;
    const callLog = (): Logger =>
      (log ??= deps.log.child({ reqId: id(), method: name, ...subjectOf(call.request) }));
    let controller: AbortController | undefined;
    let done = false;
    const signal = (): AbortSignal => {
      if (!controller) {
        const c = (controller = new AbortController());
        if (call.cancelled) c.abort();
        // grpc-js also says "cancelled" when the stream closes after the answer: that one does not count.
        else
          call.once('cancelled', () => {
            if (!done) c.abort();
          });
      }
      return controller.signal;
    };
    const deadline = deadlineOf(call);
    const ctx: CallContext = {
      get reqId() {
        return id();
      },
      method: name,
      get log() {
        return callLog();
      },
      get signal() {
        return signal();
      },
      deadline,
      runner: deps.runner,
      run: (command, args, options) => deps.runner.run(ctx, command, args, options),
    };
    deps.tracker?.begin();
    deps.observer?.begin?.(service, name);
    let release: (() => void) | undefined;
    const answer = (err: unknown, response?: Res): void => {
      done = true;
      release?.();
      const seconds = (performance.now() - started) / 1000;
      const ms = Math.round(seconds * 1000);
      // The caller gave up before the answer: it saw CANCELLED or DEADLINE_EXCEEDED, whatever we say.
      const late = call.cancelled || Date.now() > deadline ? { late: true } : {};
      if (err === undefined) {
        // Polling calls log at debug: skip copying and redacting their request when that is off.
        const level = impl?.quiet ? 'debug' : 'info';
        if (deps.log.isLevelEnabled(level))
          callLog()[level]({ ms, code: 'OK', ...late, request: redact(call.request) }, 'call');
        deps.observer?.observe(service, name, 'OK', seconds);
        callback(null, response);
      } else {
        const status = reportFailure(err, callLog(), { ms, ...late, request: redact(call.request) }, (code) =>
          deps.observer?.observe(service, name, code, seconds),
        );
        callback({ ...status, message: status.details });
      }
    };
    const finish = (err: unknown, response?: Res): void => {
      answerCountingOut(
        () => {
          answer(err, response);
        },
        callLog,
        deps.tracker,
      );
    };
    try {
      if (!impl) throw unimplemented(`${fullName} is not implemented by this driver.`);
      const prepared = impl.prepare(call.request);
      const got = deps.inflight.tryAcquire(prepared.locks, name);
      if (typeof got !== 'function') {
        throw aborted(`Another operation (${got.heldBy}) is in progress for ${got.key}; retry later.`);
      }
      release = got;
      prepared.run(ctx).then(
        (response) => {
          finish(undefined, response);
        },
        (err: unknown) => {
          finish(err);
        },
      );
    } catch (err) {
      finish(err);
    }
  };
}

export type KnownKeys<T> = keyof {
  [K in keyof T as string extends K ? never : number extends K ? never : K]: T[K];
};
type ReqOf<H> = H extends grpc.handleUnaryCall<infer Req, infer _Res> ? Req : never;
type ResOf<H> = H extends grpc.handleUnaryCall<infer _Req, infer Res> ? Res : never;

/** The methods of a service we implement; the rest answer UNIMPLEMENTED. */
export type Methods<H> = { [K in KnownKeys<H>]?: Method<ReqOf<H[K]>, ResOf<H[K]>> };

/**
 * Builds the grpc-js implementation object for a service: every method wrapped, none left to chance.
 * `methods` may be a function, asked at each call: a service whose methods change while the server
 * runs (a pool that appears after the start).
 */
export function buildService<H>(
  service: string,
  definition: grpc.ServiceDefinition,
  methods: Methods<H> | (() => Methods<H>),
  deps: CallDeps,
): grpc.UntypedServiceImplementation {
  const impl: grpc.UntypedServiceImplementation = {};
  const table = (): Record<string, Method<unknown, unknown> | undefined> =>
    typeof methods === 'function' ? methods() : methods;
  for (const name of Object.keys(definition)) {
    impl[name] = unaryHandler(service, name, () => table()[name], deps) as grpc.UntypedHandleCall;
  }
  return impl;
}
