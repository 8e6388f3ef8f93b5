/**
 * What the operator commands share: their flags, opening the pool to look at it (nothing created,
 * nothing swept), exit codes, and plain-text tables.
 */
import { parseArgs, type ParseArgsConfig } from 'node:util';
import { pino, type Logger } from 'pino';
import { FLAGS } from '../config.js';
import { bindExec, type Exec, ExecRunner } from '../exec/runner.js';
import { binaryScale } from '../pool/capacity.js';
import { Pool, PoolError } from '../pool/pool.js';

/** Exit codes of the operator commands (README, and each command's --help). */
export const EXIT = {
  ok: 0,
  /** check: problems found; gc: something could not be removed. */
  problems: 1,
  usage: 2,
  /** The pool (or the host) could not be looked at. */
  cannotLook: 3,
  /** check --probe-frozen: stopped by a signal once the probe under way had thawed what it froze. */
  interrupted: 130,
  /** check --probe-frozen: stopped at once by a third signal; a filesystem it was probing may be frozen. */
  leftFrozen: 4,
} as const;

export const EXIT_HELP =
  'Exit status: 0 done, 2 bad flags, 3 the pool could not be read (not mounted? no pool.json?).\n';

export class UsageError extends Error {
  override readonly name = 'UsageError';
}

const defaultOf = (name: string): string => FLAGS.find((f) => f.name === name)?.default ?? '';

export const COMMON_OPTIONS = {
  'pool-dir': { type: 'string', default: defaultOf('pool-dir') },
  json: { type: 'boolean', default: false },
} as const satisfies ParseArgsConfig['options'];

export const COMMON_HELP =
  `  --pool-dir DIR        the pool (default ${defaultOf('pool-dir')}, as the server's)\n` +
  '  --json                JSON on stdout instead of tables, for scripts\n';

/** Parses `argv` strictly; a bad flag is a UsageError (exit 2). */
export function parse<O extends NonNullable<ParseArgsConfig['options']>>(argv: string[], options: O) {
  try {
    return parseArgs({ args: argv, options, strict: true, allowPositionals: false });
  } catch (err) {
    throw new UsageError(err instanceof Error ? (err.message.split('\n')[0] ?? err.message) : String(err));
  }
}

/** A logger that keeps stdout for the command's output: warnings and worse on stderr. */
export function cliLogger(level: 'warn' | 'silent' = 'warn'): Logger {
  return pino({ level }, pino.destination({ fd: 2, sync: true }));
}

export function cliExec(log: Logger): Exec {
  return bindExec(new ExecRunner(), { log, deadline: Number.POSITIVE_INFINITY });
}

/** Opens the pool at `dir` to look at it: nothing is created and the trash is left as it is. */
export async function openPool(dir: string, log: Logger): Promise<Pool> {
  if (!dir.startsWith('/')) throw new UsageError(`--pool-dir ${dir}: must be an absolute path`);
  return Pool.open(dir, 'default', log, { inspect: true });
}

export function positiveNumber(name: string, text: string | undefined, fallback: number): number {
  if (text === undefined) return fallback;
  const n = Number(text);
  if (!/^\d+(\.\d+)?$/.test(text) || !Number.isFinite(n)) {
    throw new UsageError(`--${name} ${text}: must be a number of seconds (or a ratio) of 0 or more`);
  }
  return n;
}

/**
 * Runs a command body and turns what it throws into an exit status with a one-line reason on stderr:
 * bad flags 2, a pool that cannot be read 3.
 */
export async function runCommand(name: string, body: () => Promise<number>): Promise<number> {
  try {
    return await body();
  } catch (err) {
    const message = err instanceof Error ? err.message : String(err);
    if (err instanceof UsageError) {
      process.stderr.write(`loopvol ${name}: ${message} (see loopvol ${name} --help)\n`);
      return EXIT.usage;
    }
    const why = err instanceof PoolError ? message : `could not look at the pool or the host: ${message}`;
    process.stderr.write(`loopvol ${name}: ${why}\n`);
    return EXIT.cannotLook;
  }
}

export function printJson(value: unknown): void {
  process.stdout.write(`${JSON.stringify(value, null, 2)}\n`);
}

/** A plain-text table: a header row, then the rows, columns padded to their widest cell. */
export function table(headers: readonly string[], rows: readonly (readonly string[])[]): string {
  const widths = headers.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? '').length)));
  const line = (cells: readonly string[]): string =>
    cells
      .map((c, i) => (i === cells.length - 1 ? c : c.padEnd(widths[i] ?? 0)))
      .join('  ')
      .trimEnd();
  return [line(headers), ...rows.map(line)].join('\n') + '\n';
}

/** "1.5 GiB" */
export function bytes(n: number | undefined): string {
  if (n === undefined) return '-';
  const { value, unit } = binaryScale(n);
  return `${unit === 'B' || value >= 100 ? Math.round(value) : value.toFixed(1)} ${unit}`;
}

/** "2 s ago", "5 min ago", "3 h ago" */
export function ago(seconds: number | undefined): string {
  if (seconds === undefined) return 'never';
  if (seconds < 120) return `${Math.round(seconds)} s ago`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min ago`;
  return `${Math.round(seconds / 3600)} h ago`;
}
