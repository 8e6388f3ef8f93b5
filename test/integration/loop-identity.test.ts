/**
 * A loop device's backing identity is asked of losetup once per attachment, not once per look
 * (src/host/loop.ts): one losetup teaches it, under the device's disk sequence number (kernels from
 * 6.5), and every later look at the same attachment takes it from there. A device detached and
 * attached again (to another file, even one at the same path) has a new number: it is asked about
 * again, and a device read before that, or re-read since, is never detached for it. Real loop
 * devices, real losetup.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { bindExec, type Exec, ExecRunner, type RunOptions, type RunScope } from '../../src/exec/runner.js';
import {
  attachLoop,
  detachLoop,
  type LoopDevice,
  listLoops,
  readLoop,
  refreshLoopSize,
  trustsDiskseq,
} from '../../src/host/loop.js';
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

/**
 * Attaches `image` through the driver, runs `before` (which may replace `image`), then detaches the
 * device and attaches `next` (by default `image`, as it is now) to the same device, and runs what
 * `before` returned. Another test may take the freed device first: then all of it is tried again.
 */
async function attachedAnew(
  dir: string,
  image: string,
  before: (c: ReturnType<typeof countingExec> & { loop: LoopDevice }) => Promise<() => Promise<void>>,
  next = image,
): Promise<void> {
  for (let attempt = 0; attempt < 5; attempt++) {
    const c = countingExec();
    const loop = await attachLoop(c.x, image, await idOf(image), { readOnly: false, directIo: false });
    let device = loop.path;
    try {
      const after = await before({ ...c, loop });
      if (!reattach(loop.path, next)) {
        device = '';
        continue;
      }
      await after();
      return;
    } finally {
      if (device) await release(device, dir);
    }
  }
  throw new Error('no loop device could be attached twice in a row');
}

/** What the kernel holds behind `device`, as losetup reads it (LOOP_GET_STATUS64): "major:minor:inode". */
function kernelHolds(device: string): string {
  const out = JSON.parse(
    sh('losetup', ['--list', '--json', '--output', 'BACK-MAJ:MIN,BACK-INO', device]),
  ) as {
    loopdevices: { 'back-maj:min': string; 'back-ino': number | string }[];
  };
  const d = out.loopdevices[0];
  return `${d?.['back-maj:min']?.trim()}:${d?.['back-ino']}`;
}

/** Kernels from 6.5 change a loop device's diskseq at every attach and detach; before, every look asks. */
const trusted = trustsDiskseq(os.release());

describe('which kernels change diskseq at every attach and detach', () => {
  it('from 6.5 on, judged by the release alone', () => {
    const cases = [
      '4.19.0',
      '5.15.120',
      '6.1.55-generic',
      '6.4.16',
      '6.5.0',
      '6.18.44-fc-v669',
      '7.0.1',
      'x',
    ];
    expect(cases.map(trustsDiskseq)).toEqual([false, false, false, false, true, true, true, false]);
  });
});

describe.runIf(isRoot())("a loop device's backing identity", () => {
  it('is asked of losetup once per attachment, at the first look: the attach, later looks and the detach ask none', async () => {
    const dir = await env.dir('loop-identity-once');
    const a = await image(dir, 'a.img', 'A');
    const { x, ran } = countingExec();
    const loop = await attachLoop(x, a, await idOf(a), { readOnly: false, directIo: false });
    try {
      expect(listings(ran)).toEqual([]);
      const judged = [];
      for (let i = 0; i < 3; i++) {
        const seen = (await listLoops(x, (l) => l.name === loop.name)).find((l) => l.name === loop.name);
        judged.push(seen?.backing ? `${seen.backing.dev}:${seen.backing.ino}` : 'none');
      }
      expect(judged).toEqual([1, 2, 3].map(() => kernelHolds(loop.path)));
      expect(listings(ran)).toHaveLength(trusted ? 1 : 3);
      expect(await detachLoop(x, loop)).toBe(true);
      expect(listings(ran)).toHaveLength(trusted ? 1 : 4);
      expect(ran.filter((c) => c.startsWith('losetup --detach'))).toEqual([`losetup --detach ${loop.path}`]);
      // Gone from this image (its number may already serve another file's image: files run side by side).
      expect((await readLoop(loop.name))?.backingFile).not.toBe(loop.backingFile);
    } finally {
      await release(loop.path, dir);
    }
  });

  it('is asked again once the device was attached anew, to another file at the same path', async () => {
    const dir = await env.dir('loop-identity-again');
    const a = await image(dir, 'disk.img', 'A');
    await attachedAnew(dir, a, async ({ x, ran, loop }) => {
      await listLoops(x, (l) => l.name === loop.name); // learnt (on kernels that allow it)
      const asked = listings(ran).length;
      // Another file takes the image's path (renamed over it), and the device is attached to it: the
      // path sysfs shows is the same, the attachment is not.
      await fs.rename(await image(dir, 'b.img', 'B'), a);
      const other = await idOf(a);
      return async () => {
        const seen = await listLoops(x, (l) => l.name === loop.name);
        expect(seen.find((l) => l.name === loop.name)?.backing).toEqual(other);
        expect(listings(ran).length).toBe(asked + 1);
        // A device read before the change is not detached for it: what it was attached to is gone.
        expect(await detachLoop(x, loop)).toBe(true);
        expect((await readLoop(loop.name))?.backingFile).toBe(a);
      };
    });
  });

  it('is not taken from a device re-read after it was attached anew to another file (a resize of a reused device)', async () => {
    const dir = await env.dir('loop-identity-reread');
    const a = await image(dir, 'a.img', 'A');
    const b = await image(dir, 'b.img', 'B');
    await attachedAnew(
      dir,
      a,
      async ({ x, loop }) => {
        const seen = (await listLoops(x, (l) => l.name === loop.name)).find((l) => l.name === loop.name);
        if (!seen) throw new Error(`${loop.path} is not attached`);
        return async () => {
          // The reused device is made to see its image's size: the re-read shows b.img's attachment,
          // which is not taken for the one read before (ABORTED), nor detached.
          await expect(refreshLoopSize(x, seen)).rejects.toThrow(/detached meanwhile/);
          expect((await readLoop(loop.name))?.backingFile).toBe(b);
        };
      },
      b,
    );
  });

  it('is not taken for a device attached anew to the same file (another process staging it again)', async () => {
    const dir = await env.dir('loop-identity-same');
    const a = await image(dir, 'a.img', 'A');
    await attachedAnew(dir, a, ({ x, loop }) =>
      Promise.resolve(async () => {
        // Read before the other process detached it and attached the same image again: not this one.
        if (trusted) expect(await detachLoop(x, loop)).toBe(true);
        expect((await readLoop(loop.name))?.backingFile).toBe(a);
      }),
    );
  });
});
