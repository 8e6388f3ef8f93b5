/**
 * The one place commands run, and the caller's deadline: a command is cut short so the call keeps
 * time to undo what it did, and a command the deadline leaves no time for is never started (killed at
 * once, it may still have done its work). Either way the answer is the deadline's, not a failed
 * command's. A command's own, shorter limit is its own failure.
 */
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { bindExec, CallStopped, CommandError, detached, ExecRunner } from '../../src/exec/runner.js';

const log = pino({ level: 'silent' });
const runner = new ExecRunner();
let dir = '';
afterAll(async () => {
  if (dir) await fs.rm(dir, { recursive: true, force: true });
});

async function failure(p: Promise<unknown>): Promise<unknown> {
  try {
    await p;
  } catch (err) {
    return err;
  }
  throw new Error('expected the command to fail');
}

describe('commands and the caller deadline', () => {
  it('starts no command when the deadline leaves less than the time to undo', async () => {
    dir = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-runner-'));
    const file = path.join(dir, 'made');
    const x = bindExec(runner, { log, deadline: Date.now() + 300 });
    const err = await failure(x.run('touch', [file]));
    expect(err).toBeInstanceOf(CallStopped);
    expect((err as CallStopped).reason).toBe('deadline');
    await expect(fs.access(file)).rejects.toMatchObject({ code: 'ENOENT' });
  });

  it('cuts a command short before the deadline, and answers with the deadline', async () => {
    const x = bindExec(runner, { log, deadline: Date.now() + 800 });
    const started = Date.now();
    const err = await failure(x.run('sleep', ['5']));
    expect(err).toBeInstanceOf(CallStopped);
    expect((err as CallStopped).reason).toBe('deadline');
    expect(Date.now() - started).toBeLessThan(2500);
  });

  it("reports a command's own, shorter limit as the command timing out", async () => {
    const x = bindExec(runner, { log, deadline: Date.now() + 60_000 });
    const err = await failure(x.run('sleep', ['5'], { timeoutMs: 200 }));
    expect(err).toBeInstanceOf(CommandError);
    expect((err as CommandError).reason).toBe('timeout');
  });

  it("keeps an undo's own deadline a limit on its commands, which fail as commands", async () => {
    const caller = bindExec(runner, { log, deadline: Date.now() + 100 });
    const err = await failure(detached(caller, 700).run('sleep', ['5']));
    expect(err).toBeInstanceOf(CommandError);
    expect((err as CommandError).reason).toBe('timeout');
  });

  it('runs a command to its end within the deadline', async () => {
    const x = bindExec(runner, { log, deadline: Date.now() + 60_000 });
    expect((await x.run('echo', ['ok'])).stdout).toBe('ok');
  });
});

describe('a query that outlives its kill', () => {
  // A process stuck in the kernel (on a hung NFS or FUSE file) is not ended by SIGKILL. Here the
  // command's child keeps its output open past the kill, so the run cannot end either.
  const outliving = (tag: string): [string, string[]] => [
    'sh',
    ['-c', `sleep 20.${tag} & exec sleep 20.${tag}`],
  ];
  const stop = (tag: string) => spawn('pkill', ['-f', `sleep 20.${tag}`]);

  it('is left behind when it may be (abandonable), the run failing as timed out, and not started again while stuck', async () => {
    const x = bindExec(runner, { log });
    const started = Date.now();
    try {
      const err = await failure(x.run(...outliving('51'), { timeoutMs: 200, abandonable: true }));
      expect(err).toBeInstanceOf(CommandError);
      expect((err as CommandError).reason).toBe('timeout');
      expect(Date.now() - started).toBeLessThan(15_000);
      const again = await failure(x.run(...outliving('51'), { timeoutMs: 200, abandonable: true }));
      expect((again as CommandError).message).toMatch(/still stuck from an earlier run/);
      expect(execFileSync('pgrep', ['-fc', 'sleep 20.51'], { encoding: 'utf8' }).trim()).toBe('1'); // the first one's child only
    } finally {
      stop('51');
    }
  });

  it('is waited for otherwise: a command that changes things is never raced by its caller', async () => {
    const x = bindExec(runner, { log });
    const run = x.run(...outliving('52'), { timeoutMs: 200 });
    const settled = await Promise.race([
      run.then(
        () => 'ended',
        () => 'ended',
      ),
      new Promise((r) => setTimeout(r, 8_000)).then(() => 'waiting'),
    ]);
    stop('52');
    await run.catch(() => undefined);
    expect(settled).toBe('waiting');
  });
});

describe('an abandonable query that timed out', () => {
  it('is not run again for a minute, then for twice as long while it keeps timing out, and at once after it answered', async () => {
    const tmp = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-runner-cool-'));
    const runs = path.join(tmp, 'runs');
    const answers = path.join(tmp, 'answers');
    // Hangs (killably) until `answers` exists; counts its starts.
    const query = (): Promise<unknown> =>
      bindExec(runner, { log }).run(
        'sh',
        ['-c', 'echo >> "$1"; [ -e "$2" ] || exec sleep 5', 'sh', runs, answers],
        { timeoutMs: 200, abandonable: true },
      );
    const started = () => readFileSync(runs, 'utf8').split('\n').length - 1;
    const now = Date.now();
    const at = (ms: number) => vi.spyOn(Date, 'now').mockReturnValue(now + ms);
    try {
      expect((await failure(query())) as CommandError).toMatchObject({ reason: 'timeout' });
      expect(started()).toBe(1);
      at(59_000);
      const cooling = (await failure(query())) as CommandError;
      expect({ reason: cooling.reason, message: cooling.message }).toMatchObject({
        reason: 'timeout',
        message: expect.stringMatching(/timed out lately; not run again for [12] s/) as unknown,
      });
      expect(started()).toBe(1); // not started
      at(61_000);
      await failure(query()); // runs, times out again: two minutes now
      expect(started()).toBe(2);
      at(61_000 + 119_000);
      await failure(query());
      expect(started()).toBe(2);
      at(61_000 + 121_000);
      await fs.writeFile(answers, '');
      expect((await query()) as { exitCode: number }).toMatchObject({ exitCode: 0 });
      expect((await query()) as { exitCode: number }).toMatchObject({ exitCode: 0 });
      expect(started()).toBe(4);
    } finally {
      vi.restoreAllMocks();
      await fs.rm(tmp, { recursive: true, force: true });
    }
  });

  it("cools down too when the limit was its own scope's, as a shared reading's is (detached), but not a caller's deadline", async () => {
    const tmp = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-runner-cool-'));
    const runs = path.join(tmp, 'runs');
    const args = ['-c', 'echo >> "$1"; exec sleep 5', 'sh', runs];
    const opts = { timeoutMs: 1500, abandonable: true };
    const started = () => readFileSync(runs, 'utf8').split('\n').length - 1;
    try {
      // A caller whose deadline comes before the query's limit: its answer, and no cool-down.
      const caller = (): Promise<unknown> =>
        bindExec(runner, { log, deadline: Date.now() + 1000 }).run('sh', [...args, 'caller'], opts);
      expect(await failure(caller())).toBeInstanceOf(CallStopped);
      expect(await failure(caller())).toBeInstanceOf(CallStopped);
      expect(started()).toBe(2);
      // A shared reading's own scope (its limit shorter than the query's): a cool-down.
      const shared = (): Promise<unknown> => detached(bindExec(runner, { log }), 1000).run('sh', args, opts);
      expect(await failure(shared())).toMatchObject({ reason: 'timeout' });
      expect(await failure(shared())).toMatchObject({
        message: expect.stringMatching(/timed out lately/) as unknown,
      });
      expect(started()).toBe(3);
    } finally {
      await fs.rm(tmp, { recursive: true, force: true });
    }
  });
});

describe('why a command ended without an exit status', () => {
  const x = bindExec(runner, { log });
  it.each([
    ['not installed', 'loopvol-no-such-tool', [], 'ENOENT'],
    ['killed by a signal', 'sh', ['-c', 'kill -9 $$'], 'SIGKILL'],
  ])('says so when it was %s', async (_what, command, args, why) => {
    const err = await failure(x.run(command, args));
    expect(err).toBeInstanceOf(CommandError);
    expect({ reason: (err as CommandError).reason, why: (err as CommandError).why }).toEqual({
      reason: 'spawn',
      why,
    });
  });
});

describe('commands when this process ends', () => {
  const x = bindExec(runner, { log });
  const signalListeners = () => process.listenerCount('SIGVTALRM');

  it('keeps the exit handlers installed between commands instead of adding and removing them around each', async () => {
    await x.run('true', []);
    const kept = signalListeners();
    expect(kept).toBeGreaterThan(0);
    await x.run('true', []);
    expect(signalListeners()).toBe(kept);
    await Promise.all([x.run('true', []), x.run('sleep', ['0.05'])]);
    expect(signalListeners()).toBe(kept);
  });

  const RUNNER = path.resolve('dist/exec/runner.js');
  /** A process that is gone or a zombie (killed, not yet reaped by whoever adopted it). */
  const gone = (pid: number): boolean => {
    try {
      const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
      return stat.slice(stat.lastIndexOf(')') + 2).startsWith('Z');
    } catch {
      return true;
    }
  };
  const sleepMs = (ms: number) => new Promise((r) => setTimeout(r, ms));

  /**
   * Runs `body` in a Node process of its own, with `x` a runner that has run one command, and `file`
   * a path of this test's. `during(child)` runs once `file` exists. Resolves with how it ended.
   */
  async function inProcess(
    name: string,
    body: (file: string) => string,
    during: (child: ChildProcess) => void = () => undefined,
  ): Promise<{ ended: { code: number | null; signal: string | null }; file: string }> {
    dir ||= await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-runner-'));
    const file = path.join(dir, name);
    const script = `
      import { pino } from 'pino';
      import { bindExec, ExecRunner } from ${JSON.stringify(RUNNER)};
      import { existsSync } from 'node:fs';
      const file = ${JSON.stringify(file)};
      const x = bindExec(new ExecRunner(), { log: pino({ level: 'silent' }) });
      const waitFor = async (f) => { while (!existsSync(f)) await new Promise((r) => setTimeout(r, 10)); };
      await x.run('true', []);
      ${body(file)}`;
    const child = spawn(process.execPath, ['--input-type=module', '-e', script], { stdio: 'inherit' });
    const ended = new Promise<{ code: number | null; signal: string | null }>((resolve) =>
      child.once('exit', (code, signal) => {
        resolve({ code, signal });
      }),
    );
    for (let i = 0; i < 500 && !existsSync(file) && child.exitCode === null; i++) await sleepMs(10);
    during(child);
    return { ended: await ended, file };
  }

  /**
   * Runs `check` with the pid the command wrote (atomically) to `file`, and kills that command after
   * it if it is still there, whatever `check` found.
   */
  async function withCommand(file: string, check: (pid: number) => Promise<void>): Promise<void> {
    const pid = Number((await fs.readFile(file, 'utf8')).trim());
    expect(Number.isInteger(pid) && pid > 1, `pid ${pid}`).toBe(true);
    try {
      await check(pid);
    } finally {
      if (!gone(pid)) process.kill(pid, 'SIGKILL');
    }
  }
  const writesPid = (file: string) => `echo $$ > ${file}.tmp && mv ${file}.tmp ${file}`;

  it.each([
    ['exits', 'process.exit(0)', { code: 0, signal: null }],
    [
      'gets a signal it has no handler for',
      'process.kill(process.pid, "SIGHUP")',
      { code: null, signal: 'SIGHUP' },
    ],
  ])('kills a command still running when the process %s', async (_what, end, expected) => {
    const name = `sleep-${expected.signal ?? 'exit'}.pid`;
    const { ended, file } = await inProcess(
      name,
      (f) => `void x.run('sh', ['-c', ${JSON.stringify(`${writesPid(f)}; exec sleep 30`)}]).catch(() => {});
      await waitFor(file);
      await new Promise((r) => setTimeout(r, 50));
      ${end};`,
    );
    await withCommand(file, async (pid) => {
      expect(ended).toEqual(expected);
      for (let i = 0; i < 150 && !gone(pid); i++) await sleepMs(20);
      expect(gone(pid)).toBe(true);
    });
  });

  it('lets a command finish when the process drains on a SIGTERM it handles itself', async () => {
    const { ended, file } = await inProcess(
      'drain.pid',
      (
        f,
      ) => `const running = x.run('sh', ['-c', ${JSON.stringify(`${writesPid(f)}; sleep 0.3; echo done > ${f}.done`)}]);
      process.on('SIGTERM', () => { void running.then(() => process.exit(0), () => process.exit(3)); });
      await waitFor(file);
      await new Promise((r) => setTimeout(r, 5000));
      process.exit(4);`,
      (child) => child.kill('SIGTERM'),
    );
    await withCommand(file, async () => {
      expect(ended).toEqual({ code: 0, signal: null });
      expect((await fs.readFile(`${file}.done`, 'utf8')).trim()).toBe('done');
    });
  });

  it('survives a SIGXFSZ while no command runs, as Node does (a write past the limit fails instead)', async () => {
    const { ended } = await inProcess(
      'xfsz.ready',
      () => `process.kill(process.pid, 'SIGXFSZ');
      await new Promise((r) => setTimeout(r, 200));
      process.exit(0);`,
    );
    expect(ended).toEqual({ code: 0, signal: null });
  });
});
