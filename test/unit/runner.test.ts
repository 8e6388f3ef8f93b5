/**
 * The one place commands run, and the caller's deadline: a command is cut short so the call keeps
 * time to undo what it did, and a command the deadline leaves no time for is never started (killed at
 * once, it may still have done its work). Either way the answer is the deadline's, not a failed
 * command's. A command's own, shorter limit is its own failure.
 */
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
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
  const alive = (pid: number): boolean => {
    try {
      process.kill(pid, 0);
      return true;
    } catch {
      return false;
    }
  };

  it.each([
    ['exits', 'process.exit(0)', { code: 0, signal: null }],
    [
      'gets a signal it has no handler for',
      'process.kill(process.pid, "SIGHUP")',
      { code: null, signal: 'SIGHUP' },
    ],
  ])('kills a command still running when the process %s', async (_what, end, expected) => {
    dir ||= await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-runner-'));
    const pidFile = path.join(dir, `sleep-${expected.signal ?? 'exit'}.pid`);
    const script = `
      import { pino } from 'pino';
      import { bindExec, ExecRunner } from ${JSON.stringify(RUNNER)};
      import { existsSync } from 'node:fs';
      const x = bindExec(new ExecRunner(), { log: pino({ level: 'silent' }) });
      await x.run('true', []);
      void x.run('sh', ['-c', 'echo $$ > ${pidFile}; exec sleep 30']).catch(() => {});
      while (!existsSync(${JSON.stringify(pidFile)})) await new Promise((r) => setTimeout(r, 10));
      await new Promise((r) => setTimeout(r, 50));
      ${end};`;
    const child = spawn(process.execPath, ['--input-type=module', '-e', script], { stdio: 'inherit' });
    const ended = await new Promise<{ code: number | null; signal: string | null }>((resolve) =>
      child.once('exit', (code, signal) => {
        resolve({ code, signal });
      }),
    );
    expect(ended).toEqual(expected);
    const pid = Number((await fs.readFile(pidFile, 'utf8')).trim());
    for (let i = 0; i < 100 && alive(pid); i++) await new Promise((r) => setTimeout(r, 20));
    const left = alive(pid);
    if (left) process.kill(pid, 'SIGKILL');
    expect(left).toBe(false);
  });
});
