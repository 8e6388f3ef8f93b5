/**
 * The per-call wrapper for server-streaming RPCs, with the rules of the unary one (call.ts): request
 * checks before any side effect, in-flight keys, a context whose commands obey the call's deadline and
 * cancellation, one log line per call (duration, final code, messages sent, what the work measured,
 * secrets redacted) and the one error → status map (status.ts).
 *
 * A method's `run` returns an async iterable of response messages. The wrapper writes them as the
 * client reads them (it waits for the stream to drain, so a slow reader pauses the work instead of
 * filling memory), ends the stream after the last, or ends it with the error's status: a client tells
 * "all metadata sent" (OK) from "cut short" (any other code). When the client cancels or the deadline
 * passes, the call's signal fires (commands are killed) and the iterable is closed (its `finally`
 * blocks run), so the work stops with the call.
 */
import type * as grpc from '@grpc/grpc-js';
import { aborted, unimplemented } from '../errors.js';
import { CallStopped } from '../exec/runner.js';
import {
  answerCountingOut,
  type CallContext,
  type CallDeps,
  deadlineOf,
  type KnownKeys,
  reportFailure,
  requestId,
  subjectOf,
} from './call.js';
import { requestRedactor } from './proto.js';

/** A streaming call's context: a CallContext that can add what the work measured to the call's log line. */
export interface StreamContext extends CallContext {
  note(fields: Record<string, unknown>): void;
}

export interface StreamPrepared<Res> {
  readonly locks: readonly string[];
  run(ctx: StreamContext): AsyncIterable<Res>;
}

export interface StreamMethod<Req, Res> {
  readonly quiet: boolean;
  prepare(request: Req): StreamPrepared<Res>;
}

export interface StreamMethodDef<Req, Res, V> {
  /** Pure request checks; throws CsiError. */
  validate: (request: Req) => V;
  locks?: (v: V) => readonly string[];
  /** The response messages, produced as they are read. Checks that need the pool come before the first. */
  run: (v: V, ctx: StreamContext) => AsyncIterable<Res>;
  quiet?: boolean;
}

export function streamMethod<Req, Res, V>(def: StreamMethodDef<Req, Res, V>): StreamMethod<Req, Res> {
  return {
    quiet: def.quiet ?? false,
    prepare(request) {
      const v = def.validate(request);
      return { locks: def.locks?.(v) ?? [], run: (ctx) => def.run(v, ctx) };
    },
  };
}

/** Resolves when `call` can take more messages; rejects when the call is cancelled first. */
function drained(call: grpc.ServerWritableStream<unknown, unknown>, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    const done = (): void => {
      call.off('drain', onDrain);
      signal.removeEventListener('abort', onAbort);
    };
    const onDrain = (): void => {
      done();
      resolve();
    };
    const onAbort = (): void => {
      done();
      reject(new CallStopped('cancelled'));
    };
    if (signal.aborted) {
      reject(new CallStopped('cancelled'));
      return;
    }
    call.on('drain', onDrain);
    signal.addEventListener('abort', onAbort);
  });
}

export function streamingHandler<Req, Res>(
  service: string,
  name: string,
  resolve: () => StreamMethod<Req, Res> | undefined,
  deps: CallDeps,
): grpc.handleServerStreamingCall<Req, Res> {
  const redact = requestRedactor(service, name);
  const fullName = `${service}.${name}`;
  return (call) => {
    const impl = resolve();
    const started = performance.now();
    const reqId = requestId();
    const log = deps.log.child({ reqId, method: name, ...subjectOf(call.request) });
    const controller = new AbortController();
    const deadline = deadlineOf(call);
    // The deadline stops the work too: grpc-js cancels the call when it passes.
    const stopped = (): CallStopped => new CallStopped(Date.now() > deadline ? 'deadline' : 'cancelled');
    call.on('cancelled', () => {
      controller.abort();
    });
    const notes: Record<string, unknown> = {};
    const ctx: StreamContext = {
      reqId,
      method: name,
      log,
      signal: controller.signal,
      deadline,
      runner: deps.runner,
      run: (command, args, options) => deps.runner.run(ctx, command, args, options),
      note: (fields) => Object.assign(notes, fields),
    };
    deps.tracker?.begin();
    let messages = 0;
    const answer = (err: unknown): void => {
      const seconds = (performance.now() - started) / 1000;
      const ms = Math.round(seconds * 1000);
      const late = controller.signal.aborted || Date.now() > deadline ? { late: true } : {};
      if (err === undefined) {
        const level = impl?.quiet ? 'debug' : 'info';
        if (log.isLevelEnabled(level))
          log[level]({ ms, code: 'OK', messages, ...notes, request: redact(call.request) }, 'call');
        deps.observer?.observe(service, name, 'OK', seconds);
        call.end();
      } else {
        const status = reportFailure(
          err,
          log,
          { ms, ...late, messages, ...notes, request: redact(call.request) },
          (code) => deps.observer?.observe(service, name, code, seconds),
        );
        // After the last message sent, a non-OK status tells the client the stream was cut short.
        if (!call.cancelled) call.emit('error', { code: status.code, details: status.details });
      }
    };
    const finish = (err: unknown): void => {
      answerCountingOut(
        () => {
          answer(err);
        },
        () => log,
        deps.tracker,
      );
    };
    const serve = async (): Promise<void> => {
      if (!impl) throw unimplemented(`${fullName} is not implemented by this driver.`);
      const prepared = impl.prepare(call.request);
      const got = deps.inflight.tryAcquire(prepared.locks, name);
      if (typeof got !== 'function') {
        throw aborted(`Another operation (${got.heldBy}) is in progress for ${got.key}; retry later.`);
      }
      const it = prepared.run(ctx)[Symbol.asyncIterator]();
      let finished = false;
      try {
        for (;;) {
          if (controller.signal.aborted) throw stopped();
          const next = await it.next();
          if (next.done) {
            finished = true;
            break;
          }
          messages++;
          if (!call.write(next.value)) await drained(call, controller.signal);
        }
      } catch (err) {
        throw controller.signal.aborted && !(err instanceof CallStopped) ? stopped() : err;
      } finally {
        // Stopped early (cancelled, or failed here): close the work, which kills its commands.
        if (!finished) await it.return?.().catch(() => undefined);
        got();
      }
    };
    serve().then(
      () => {
        finish(undefined);
      },
      (err: unknown) => {
        finish(err);
      },
    );
  };
}

type ReqOf<H> = H extends grpc.handleServerStreamingCall<infer Req, infer _Res> ? Req : never;
type ResOf<H> = H extends grpc.handleServerStreamingCall<infer _Req, infer Res> ? Res : never;

/** The streaming methods of a service we implement; the rest answer UNIMPLEMENTED. */
export type StreamMethods<H> = { [K in KnownKeys<H>]?: StreamMethod<ReqOf<H[K]>, ResOf<H[K]>> };

/** buildService (call.ts) for a service whose methods are all server-streaming. */
export function buildStreamingService<H>(
  service: string,
  definition: grpc.ServiceDefinition,
  methods: StreamMethods<H> | (() => StreamMethods<H>),
  deps: CallDeps,
): grpc.UntypedServiceImplementation {
  const impl: grpc.UntypedServiceImplementation = {};
  const table = (): Record<string, StreamMethod<unknown, unknown> | undefined> =>
    typeof methods === 'function' ? methods() : methods;
  for (const [name, def] of Object.entries(definition)) {
    if (!def.responseStream || def.requestStream) {
      throw new Error(`${service}.${name} is not a server-streaming method`);
    }
    impl[name] = streamingHandler(service, name, () => table()[name], deps) as grpc.UntypedHandleCall;
  }
  return impl;
}
