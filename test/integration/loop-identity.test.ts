/**
 * A loop device's backing identity is asked of losetup once per attachment, not once per look
 * (src/host/loop.ts): the attach or one losetup teaches it, under the device's disk sequence number,
 * and every later look at the same attachment takes it from there. A device detached and attached
 * again (to another file, even one at the same path) has a new number: it is asked about again, and a
 * device read before that is never detached for it. Real loop devices, real losetup.
 */
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { bindExec, type Exec, ExecRunner, type RunOptions, type RunScope } from '../../src/exec/runner.js';
import { attachLoop, detachLoop, type LoopDevice, listLoops, readLoop } from '../../src/host/loop.js';
import { fileId } from '../../src/host/paths.js';
import { TestEnv } from '../helpers/env.js';
import { isRoot, MiB } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const sh = (cmd: string, args: string[]): string => execFileSync(cmd, args, { encoding: 'utf8' }).trim();

/** An Exec on the real runner that also notes every command it runs, as "command args…". */
function countingExec(): { x: Exec; ran: string[] } {
  const ran: string[] = [];
  const real = new ExecRunner();
  const runner = {
    run: (scope: RunScope, command: string, args: readonly string[], options?: RunOptions) => {
      ran.push([command, ...args].join(' '));
      return real.run(scope, command, args, options);
    },
  };
  return { x: bindExec(runner, { log: pino({ level: 'silent' }), deadline: Infinity }), ran };
}
const listings = (ran: string[]): string[] => ran.filter((c) => c.startsWith('losetup --list'));

async function image(dir: string, name: string, fill: string): Promise<string> {
  const p = path.join(dir, name);
  await fs.writeFile(p, Buffer.alloc(MiB, fill));
  return p;
}

async function idOf(p: string) {
  const id = await fileId(p);
  if (!id) throw new Error(`no file at ${p}`);
  return id;
}

/**
 * Detaches `device` and attaches `file` to the same device (another test may take the freed device
 * first: then false, and the caller tries again with a new device).
 */
function reattach(device: string, file: string): boolean {
  sh('losetup', ['--detach', device]);
  try {
    sh('losetup', [device, file]);
    return true;
  } catch {
    return false;
  }
}

/** Detaches `device` if it is still attached to a file under `dir` (what this test attached). */
async function release(device: string, dir: string): Promise<void> {
  const now = await readLoop(path.basename(device));
  if (now?.backingFile.startsWith(`${dir}/`)) sh('losetup', ['--detach', device]);
}

const hasDiskseq = (l: LoopDevice): boolean => existsSync(`/sys/block/${l.name}/diskseq`);

describe.runIf(isRoot())("a loop device's backing identity", () => {
  it('is learnt at the attach: later looks and the detach run no losetup --list', async () => {
    const dir = await env.dir('loop-identity-attach');
    const a = await image(dir, 'a.img', 'A');
    const { x, ran } = countingExec();
    const loop = await attachLoop(x, a, await idOf(a), { readOnly: false, directIo: false });
    try {
      if (!hasDiskseq(loop)) return; // a kernel before 5.15: every look asks losetup, as before
      expect(loop.seq).toMatch(/^\d+$/);
      const seen = await listLoops(x, (l) => l.name === loop.name);
      expect(seen.find((l) => l.name === loop.name)?.backing).toEqual(await idOf(a));
      expect(listings(ran)).toEqual([]);
      expect(await detachLoop(x, loop)).toBe(true);
      expect(listings(ran)).toEqual([]);
      expect(ran.filter((c) => c.startsWith('losetup --detach'))).toEqual([`losetup --detach ${loop.path}`]);
      expect(await readLoop(loop.name)).toBeUndefined();
    } finally {
      await release(loop.path, dir);
    }
  });

  it('is learnt from one losetup for a device attached by someone else, then kept', async () => {
    const dir = await env.dir('loop-identity-listed');
    const a = await image(dir, 'a.img', 'A');
    const device = sh('losetup', ['--find', '--show', a]);
    try {
      const { x, ran } = countingExec();
      const name = path.basename(device);
      for (let i = 0; i < 2; i++) {
        const seen = await listLoops(x, (l) => l.name === name);
        expect(seen.find((l) => l.name === name)?.backing).toEqual(await idOf(a));
      }
      const first = await readLoop(name);
      expect(listings(ran)).toHaveLength(first && hasDiskseq(first) ? 1 : 2);
    } finally {
      await release(device, dir);
    }
  });

  it('is asked again once the device was attached anew, to another file at the same path', async () => {
    const dir = await env.dir('loop-identity-again');
    const a = await image(dir, 'disk.img', 'A');
    for (let attempt = 0; attempt < 5; attempt++) {
      const { x, ran } = countingExec();
      const loop = await attachLoop(x, a, await idOf(a), { readOnly: false, directIo: false });
      let device = loop.path;
      try {
        // Another file takes the image's path (renamed over it), and the device is attached to it: the
        // path sysfs shows is the same, the attachment is not.
        await fs.rename(await image(dir, 'b.img', 'B'), a);
        const other = await idOf(a);
        if (!reattach(loop.path, a)) {
          device = '';
          continue;
        }
        const seen = await listLoops(x, (l) => l.name === loop.name);
        expect(seen.find((l) => l.name === loop.name)?.backing).toEqual(other);
        expect(listings(ran).length).toBeGreaterThan(0);
        // A device read before the change is not detached for it: what it was attached to is gone.
        expect(await detachLoop(x, loop)).toBe(true);
        expect((await readLoop(loop.name))?.backingFile).toBe(a);
        return;
      } finally {
        if (device) await release(device, dir);
      }
    }
    throw new Error('no loop device could be attached twice in a row');
  });
});
