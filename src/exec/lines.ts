/**
 * Commands whose output is read line by line while they run: tools that list a file's extents can
 * print hundreds of thousands of lines, which are parsed as they come instead of held in memory.
 * Same rules as runner.ts: an argument array (never a shell), LC_ALL=C, a timeout that never outlives
 * the caller's deadline, killed when the caller cancels. A consumer that stops reading early (a
 * cancelled stream, an error further down) kills the command: nothing runs on after its reader.
 */
import { execa } from 'execa';
import { commandEnv, commandFailure, keepExitHandlers, type RunScope } from './runner.js';

export interface LinesOptions {
  /** Upper bound for the command; the caller's deadline lowers it further. Default 10 minutes. */
  timeoutMs?: number;
}

const DEFAULT_TIMEOUT_MS = 10 * 60 * 1000;
/** stderr kept for the error (the tools print their reason there, in a line or two). */
const MAX_STDERR = 64 * 1024;

/**
 * Runs `command` and yields its stdout line by line (without the newline). Throws a CommandError
 * (with stderr) when it fails, after the lines it printed. Breaking out of the loop kills it.
 */
export async function* commandLines(
  scope: RunScope,
  command: string,
  args: readonly string[],
  options: LinesOptions = {},
): AsyncGenerator<string, void, undefined> {
  let timeout = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
  if (scope.deadline !== undefined && Number.isFinite(scope.deadline)) {
    timeout = Math.min(timeout, Math.max(1, scope.deadline - Date.now()));
  }
  keepExitHandlers();
  const started = performance.now();
  const child = execa(command, args, {
    reject: false,
    timeout,
    cancelSignal: scope.signal,
    forceKillAfterDelay: 2_000,
    env: commandEnv(),
    extendEnv: true,
    stdin: 'ignore',
    // stdout is read here, as it comes; only stderr is kept, for the error.
    buffer: { stdout: false, stderr: true },
    maxBuffer: { stderr: MAX_STDERR },
  });
  let finished = false;
  try {
    for await (const line of child.iterable()) yield line;
    finished = true;
  } finally {
    if (!finished) {
      // The reader stopped early: the command goes too, and is gone when this generator returns.
      child.kill('SIGKILL');
      await child;
    }
  }
  const result = await child;
  const ms = Math.round(performance.now() - started);
  if (!result.failed) {
    scope.log.debug({ command, args, ms }, 'command finished');
    return;
  }
  const stderr = typeof result.stderr === 'string' ? result.stderr.trim() : '';
  const err = commandFailure(command, args, result, stderr, timeout);
  scope.log.warn(
    { command, args, exitCode: result.exitCode, reason: err.reason, stderr, ms },
    'command failed',
  );
  throw err;
}
