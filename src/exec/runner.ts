/**
 * The only place that runs external commands. Every command runs with an argument array (never a
 * shell), LC_ALL=C, a timeout that never outlives the RPC that asked for it, and is killed when the
 * RPC is cancelled. A failure becomes a CommandError carrying the exit code and stderr, which the
 * per-call wrapper logs; callers decide what it means for the caller.
 */
import { execa } from 'execa';
import path from 'node:path';
import type { Logger } from 'pino';
import { onExit } from 'signal-exit';
import { searchPath } from './which.js';

export interface RunOptions {
  /** Upper bound for this command; the RPC deadline lowers it further. Default 60 s. */
  timeoutMs?: number;
  /** Exit codes that count as success (default [0]); the result carries the actual code. */
  okCodes?: readonly number[];
  /** Run to completion even if the RPC that started it is cancelled (copies that a retry would redo). */
  detached?: boolean;
  input?: string;
  /** A failure here is expected and handled by the caller: log it at debug, not warn. */
  quiet?: boolean;
  /** Another reason to stop the command, which holds even for a detached one (a pool lock that was lost). */
  signal?: AbortSignal;
  /**
   * Killed when this process dies, by kill -9 too (through `setpriv --pdeathsig`): a detached copy into
   * a file only this process would ever rename. Left running, it fills the pool for nothing while the
   * retry copies again.
   */
  diesWithProcess?: boolean;
  /**
   * A query that changes nothing: when its process outlives its kill (stuck in the kernel on a
   * filesystem that does not answer, where SIGKILL waits), it is left behind and the run fails as timed
   * out, instead of waiting for as long as that filesystem hangs. Never for a command that changes
   * anything: what it does after the caller gave up would race the caller's undo. One that timed out
   * is not run again for a while (a minute, doubling to four while it keeps timing out): a filesystem
   * that hangs but lets its waits be killed would cost every caller the whole timeout.
   */
  abandonable?: boolean;
}

export interface RunResult {
  exitCode: number;
  stdout: string;
  stderr: string;
}

/** What a command needs from the call that runs it. */
export interface RunScope {
  log: Logger;
  signal?: AbortSignal;
  /** Epoch milliseconds; Infinity when the caller set no deadline. */
  deadline?: number;
  /** Undo and shared readings (detached): their deadline is their own, not a caller's. */
  own?: true;
}

export class CommandError extends Error {
  override readonly name = 'CommandError';
  constructor(
    readonly command: string,
    readonly args: readonly string[],
    readonly exitCode: number | undefined,
    readonly stderr: string,
    readonly reason: 'exit' | 'timeout' | 'cancelled' | 'spawn',
    message: string,
    /** Why a command was not started, or ended without an exit status: an errno (ENOENT) or a signal. */
    readonly why?: string,
  ) {
    super(message);
  }

  /** The last non-empty line of stderr, which is where these tools put the reason. */
  get lastStderrLine(): string {
    const lines = this.stderr
      .split('\n')
      .map((l) => l.trim())
      .filter(Boolean);
    return lines.at(-1) ?? '';
  }
}

export interface Runner {
  run(scope: RunScope, command: string, args: readonly string[], options?: RunOptions): Promise<RunResult>;
}

/**
 * What the layers below the services need to run commands: a scope (log, cancellation, deadline) bound
 * to a runner. A CSI call's context is one; so is the driver's own startup work.
 */
export interface Exec extends RunScope {
  readonly runner: Runner;
  run(command: string, args: readonly string[], options?: RunOptions): Promise<RunResult>;
}

export function bindExec(runner: Runner, scope: RunScope): Exec {
  const x: Exec = {
    ...scope,
    runner,
    run: (command, args, options) => runner.run(x, command, args, options),
  };
  return x;
}

/** How long cleanup and rollback may take once they no longer obey the caller's deadline. */
export const CLEANUP_MS = 30_000;

/**
 * A scope for cleanup and rollback: the caller's log and runner, but free of its cancellation and
 * deadline (a call cancelled half-way must still undo what it did), with a short deadline of its own.
 */
export function detached(x: Exec, ms = CLEANUP_MS): Exec {
  return bindExec(x.runner, { log: x.log, deadline: Date.now() + ms, own: true });
}

/** Thrown at a step boundary once the caller cancelled the call or its deadline passed. */
export class CallStopped extends Error {
  override readonly name = 'CallStopped';
  constructor(readonly reason: 'cancelled' | 'deadline') {
    super(reason === 'cancelled' ? 'the caller cancelled the call' : 'the call ran past its deadline');
  }
}

/**
 * A step boundary: stops the work (so the caller's rollback runs) when the caller is gone. Work that
 * the caller can no longer see succeed is undone rather than left half-made.
 */
export function checkpoint(scope: RunScope): void {
  if (scope.signal?.aborted) throw new CallStopped('cancelled');
  if (scope.deadline !== undefined && Date.now() > scope.deadline) throw new CallStopped('deadline');
}

/** The environment every command runs in: C locale (output parsed by text), the tools' search path. */
export const commandEnv = (): Record<string, string> => ({
  LC_ALL: 'C',
  LANG: 'C',
  PATH: searchPath().join(path.delimiter),
});

let exitHandlersKept = false;

/**
 * execa kills a command that is still running when this process exits (its `cleanup`, through
 * signal-exit). signal-exit adds its listeners for about fifteen signals when its first exit handler
 * comes and removes them when its last goes, so a command run while no other runs started and closed
 * that many signal handles around its spawn: 1–1.5 ms of this process's CPU per command (bench/README.md).
 * One handler that never goes keeps them in place from the first command on: every command is killed
 * at exit as before, without the churn. What this changes, now that the listeners stay while nothing
 * runs too:
 *  - SIGTERM and SIGINT: nothing (main.ts listens to them, and signal-exit acts on a signal only when
 *    no one else listens: a drain lets its commands finish);
 *  - a signal nothing else listens to (SIGHUP, SIGQUIT…): signal-exit kills the running commands and
 *    sends it again, which ends this process as before; as PID 1 (a container) the kernel ignores it,
 *    as before, but signal-exit has then run its exit handlers, which it does once per process, so
 *    later commands are not killed at exit: the kernel kills them when PID 1 ends;
 *  - SIGXFSZ, which Node ignores (a write past `ulimit -f` fails with EFBIG instead): this process
 *    listens to it itself, doing nothing, so signal-exit never sends it again (which would kill it).
 */
export function keepExitHandlers(): void {
  if (exitHandlersKept) return;
  exitHandlersKept = true;
  process.on('SIGXFSZ', () => undefined);
  onExit(() => undefined);
}

/** What execa says of a command that failed, as far as a CommandError needs it. */
interface Failed {
  timedOut: boolean;
  isCanceled: boolean;
  exitCode?: number;
  code?: string;
  signal?: string;
}

/** The CommandError for a command that failed: why (exit, timeout, cancelled, not started), in one sentence. */
export function commandFailure(
  command: string,
  args: readonly string[],
  result: Failed,
  stderr: string,
  timeoutMs: number,
): CommandError {
  const reason = result.timedOut
    ? 'timeout'
    : result.isCanceled
      ? 'cancelled'
      : result.exitCode === undefined
        ? 'spawn'
        : 'exit';
  return new CommandError(
    command,
    args,
    result.exitCode,
    stderr,
    reason,
    reason === 'exit'
      ? `${command} exited with status ${result.exitCode}`
      : reason === 'timeout'
        ? `${command} timed out after ${timeoutMs} ms`
        : reason === 'cancelled'
          ? `${command} was cancelled`
          : result.signal !== undefined && result.code === undefined
            ? `${command} was killed by ${result.signal}`
            : `${command} could not be started (${result.code ?? 'unknown error'})`,
    result.code ?? result.signal,
  );
}

const DEFAULT_TIMEOUT_MS = 60_000;
/** How long past its timeout an abandonable query is waited for: its kill (forceKillAfterDelay 2 s), and a margin. */
const ABANDON_AFTER_MS = 5_000;

/** Abandonable commands (command and arguments) left behind and not ended yet: how many of each. */
const stuck = new Map<string, number>();

/** Abandonable commands that timed out: not run again before `until` (Date.now()); `ms`, the last wait. */
const cooling = new Map<string, { until: number; ms: number }>();
const COOL_MS = 60_000;
const COOL_MAX_MS = 240_000;

/** `child`'s result, or 'abandoned' when it has not ended `ms` from now. */
async function abandonedAfter<T>(child: Promise<T>, ms: number): Promise<T | 'abandoned'> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<'abandoned'>((resolve) => {
    timer = setTimeout(() => {
      resolve('abandoned');
    }, ms);
  });
  try {
    return await Promise.race([child, late]);
  } finally {
    clearTimeout(timer);
  }
}

/** Leave the RPC this much time to roll back after a command it ran timed out. */
const DEADLINE_MARGIN_MS = 500;

export class ExecRunner implements Runner {
  async run(
    scope: RunScope,
    command: string,
    args: readonly string[],
    options: RunOptions = {},
  ): Promise<RunResult> {
    const limit = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    let timeout = limit;
    const callers = scope.own !== true;
    if (!options.detached && scope.deadline !== undefined && Number.isFinite(scope.deadline)) {
      // A command is not started when the caller's deadline leaves no time for it and the undo: killed
      // at once, it may still have done its work (a bind mount that took effect), and a caller that
      // gives less than the margin gets its deadline's answer, not a failed command's. An undo's or a
      // shared reading's own deadline stays a limit on its commands, which fail as commands.
      const left = scope.deadline - Date.now() - DEADLINE_MARGIN_MS;
      if (left < 1 && callers) throw new CallStopped('deadline');
      timeout = Math.min(timeout, Math.max(1, left));
    }
    const signals = [options.detached ? undefined : scope.signal, options.signal].filter(
      (x): x is AbortSignal => x !== undefined,
    );
    // One left behind and still stuck: another would only join it (and each holds a process slot).
    const key = options.abandonable ? `${command}\0${args.join('\0')}` : '';
    const stuckError = (why: string) => new CommandError(command, args, undefined, '', 'timeout', why);
    if (options.abandonable && stuck.has(key))
      throw stuckError(`${command} is still stuck from an earlier run`);
    const cool = options.abandonable ? cooling.get(key) : undefined;
    if (cool && cool.until > Date.now())
      throw stuckError(
        `${command} timed out lately; not run again for ${Math.ceil((cool.until - Date.now()) / 1000)} s`,
      );
    // Timed out, and not because a caller's deadline cut it short (a shared reading's own scope is no
    // caller): not run again for a while, twice as long when it times out again soon after the last.
    const cooled = (): void => {
      if (!options.abandonable || (timeout < limit && callers)) return;
      const last = cooling.get(key);
      const ms = last && Date.now() - last.until < last.ms ? Math.min(last.ms * 2, COOL_MAX_MS) : COOL_MS;
      cooling.set(key, { until: Date.now() + ms, ms });
    };
    keepExitHandlers();
    const started = performance.now();
    const [file, argv] = options.diesWithProcess
      ? ['setpriv', ['--pdeathsig', 'KILL', '--', command, ...args]]
      : [command, args];
    const child = execa(file, argv, {
      reject: false,
      timeout,
      cancelSignal: signals.length > 1 ? AbortSignal.any(signals) : signals[0],
      forceKillAfterDelay: 2_000,
      // A detached command (mkfs, fsck, resize) outlives this process if it must: killing it midway is
      // what detaching it avoids.
      cleanup: !options.detached || options.diesWithProcess === true,
      env: commandEnv(),
      extendEnv: true,
      stripFinalNewline: true,
      input: options.input,
      stdin: options.input === undefined ? 'ignore' : 'pipe',
    });
    const result = options.abandonable
      ? await abandonedAfter(child, timeout + ABANDON_AFTER_MS)
      : await child;
    if (result === 'abandoned') {
      stuck.set(key, (stuck.get(key) ?? 0) + 1);
      const ended = (): void => {
        const left = (stuck.get(key) ?? 1) - 1;
        if (left > 0) stuck.set(key, left);
        else stuck.delete(key);
      };
      child.then(ended, ended);
      cooled();
      scope.log.warn(
        { command, args, pid: child.pid },
        'a command outlived its kill (stuck in the kernel); left behind',
      );
      if (timeout < limit && callers) throw new CallStopped('deadline');
      throw stuckError(`${command} timed out after ${timeout} ms and could not be killed`);
    }
    const ms = Math.round(performance.now() - started);
    const okCodes = options.okCodes ?? [0];
    if (result.timedOut) cooled();
    else if (options.abandonable) cooling.delete(key);
    if (!result.failed || (result.exitCode !== undefined && okCodes.includes(result.exitCode))) {
      scope.log.debug({ command, args, exitCode: result.exitCode, ms }, 'command finished');
      return { exitCode: result.exitCode ?? 0, stdout: result.stdout, stderr: result.stderr };
    }
    const stderr = result.stderr.trim();
    const err = commandFailure(command, args, result, stderr, timeout);
    const line = { command, args, exitCode: result.exitCode, reason: err.reason, stderr, ms };
    if (options.quiet) scope.log.debug(line, 'command failed');
    else scope.log.warn(line, 'command failed');
    // Cut short by the caller's deadline (its own limit was longer): the call ran out of time.
    if (err.reason === 'timeout' && timeout < limit && callers) throw new CallStopped('deadline');
    throw err;
  }
}
