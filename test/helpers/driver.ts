/** Starts the real built driver (dist/main.js) as a child process on a temporary socket. */
import { type ChildProcess, spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { csiClients, type CsiClients } from './grpc.js';
import { SLOW } from './host.js';

export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
export const MAIN = path.join(REPO, 'dist', 'main.js');

/** A temporary directory under /tmp, named for the test, removed by the caller's cleanup. */
export async function tempDir(tag: string): Promise<string> {
  return fs.mkdtemp(path.join(os.tmpdir(), `loopvol-test-${tag}-`));
}

export interface DriverProcess {
  readonly proc: ChildProcess;
  readonly endpoint: string;
  readonly socket: string;
  readonly poolDir: string;
  readonly clients: CsiClients;
  /** Log lines (JSON) printed so far. */
  logs(): string[];
  /**
   * Waits (up to 30 s, times LOOPVOL_TEST_SLOW) for a log line that satisfies `match`; the log is written
   * asynchronously, and what it reports (an attach, a freeze, a start-up check) takes seconds under load.
   */
  waitForLog(match: (line: string) => boolean): Promise<boolean>;
  stderr(): string;
  /** Sends a signal and waits for the exit code. */
  stop(signal?: NodeJS.Signals): Promise<number | null>;
  exited: Promise<number | null>;
}

export interface DriverArgs {
  dir: string;
  nodeId?: string;
  mode?: 'all' | 'controller' | 'node';
  poolDir?: string;
  socket?: string;
  extra?: string[];
  logLevel?: string;
  env?: Record<string, string>;
  /** Runs the driver through this command line (e.g. unshare into its own mount namespace); the driver's own argv follows it. */
  wrap?: string[];
}

export function driverArgs(a: DriverArgs): { args: string[]; socket: string; poolDir: string } {
  const socket = a.socket ?? path.join(a.dir, 'csi.sock');
  const poolDir = a.poolDir ?? path.join(a.dir, 'pool');
  const args = [
    `--endpoint=unix://${socket}`,
    `--pool-dir=${poolDir}`,
    `--log-level=${a.logLevel ?? 'debug'}`,
  ];
  if (a.mode) args.push(`--mode=${a.mode}`);
  if (a.mode !== 'controller') args.push(`--nodeid=${a.nodeId ?? 'node-1'}`);
  args.push(...(a.extra ?? []));
  return { args, socket, poolDir };
}

/** Runs dist/main.js with `args` to completion (for flag errors, --help), through `wrap` if given. */
export function runMain(
  args: string[],
  wrap: string[] = [],
): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const argv = [...wrap, process.execPath, MAIN, ...args];
    const proc = spawn(argv[0] ?? process.execPath, argv.slice(1), { stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    proc.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
    proc.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
    proc.on('exit', (code) => {
      resolve({ code, stdout, stderr });
    });
  });
}

/**
 * Every driver this test file started, with its log so far: a failed test prints what each wrote
 * while it ran (test/helpers/failure-logs.ts).
 */
export const started: { endpoint: string; logs: () => string[]; stderr: () => string }[] = [];

/** Prints to stderr, under `title`, the last `last` of `lines` a driver logged, and its stderr if any. */
export function printLog(title: string, lines: readonly string[], stderr = '', last = 200): void {
  const shown = lines.slice(-last);
  const cut = lines.length > shown.length ? ` (its last ${last} of ${lines.length} lines)` : '';
  const err = stderr.trim() ? `--- its stderr ---\n${stderr.trim()}\n` : '';
  process.stderr.write(`\n--- ${title}${cut} ---\n${shown.join('\n')}\n${err}`);
}

export async function startDriverProcess(a: DriverArgs): Promise<DriverProcess> {
  const { args, socket, poolDir } = driverArgs(a);
  const argv = [...(a.wrap ?? []), process.execPath, MAIN, ...args];
  const proc = spawn(argv[0] ?? process.execPath, argv.slice(1), {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...a.env },
  });
  let out = '';
  let err = '';
  proc.stdout.on('data', (d: Buffer) => (out += d.toString()));
  proc.stderr.on('data', (d: Buffer) => (err += d.toString()));
  const exited = new Promise<number | null>((resolve) =>
    proc.on('exit', (code) => {
      resolve(code);
    }),
  );
  const endpoint = `unix://${socket}`;
  const clients = csiClients(endpoint);
  // Three plugins starting at once on a loaded CI machine took about 8 s or more to listen (what a start
  // that failed there implies): a start gets 30 s.
  const deadline = Date.now() + 30_000 * SLOW;
  let ready = false;
  let exitCode: number | null | undefined;
  void exited.then((c) => (exitCode = c));
  while (Date.now() < deadline && exitCode === undefined) {
    try {
      await clients.identity.GetPluginInfo({}, { timeoutMs: 1000 * SLOW });
      ready = true;
      break;
    } catch {
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  if (!ready) {
    clients.close();
    proc.kill('SIGKILL');
    throw new Error(`driver did not start (exit ${String(exitCode)}): ${err}\n${out}`);
  }
  const logs = (): string[] => out.split('\n').filter(Boolean);
  started.push({ endpoint, logs, stderr: () => err });
  return {
    proc,
    endpoint,
    socket,
    poolDir,
    clients,
    logs,
    async waitForLog(match) {
      for (let i = 0; i < 600 * SLOW; i++) {
        if (out.split('\n').some((l) => l !== '' && match(l))) return true;
        await new Promise((r) => setTimeout(r, 50));
      }
      return false;
    },
    stderr: () => err,
    exited,
    async stop(signal: NodeJS.Signals = 'SIGTERM') {
      clients.close();
      if (proc.exitCode === null && proc.signalCode === null) proc.kill(signal);
      return exited;
    },
  };
}
