/**
 * The kernel's behaviour the format decision relies on (src/node/format.ts), on the real kernel with
 * losetup: a loop device attached anew shows the file it is attached to now, never pages it cached of
 * another (a detach completes only once nothing has the device open, and its pages go then); a device
 * that stays open keeps showing what it cached, after the file behind it changed, until its cache is
 * dropped (`blockdev --flushbufs`): why a device attached before the call is flushed before it is probed.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { tempDir } from '../helpers/driver.js';
import { cleanupUnder, isRoot, MiB } from '../helpers/host.js';

const sh = (cmd: string, args: string[]): string => execFileSync(cmd, args, { encoding: 'utf8' }).trim();

/** The first 4 KiB of `device`, read through the host's page cache. */
async function firstBlock(device: string): Promise<string> {
  const h = await fs.open(device, 'r');
  try {
    const buf = Buffer.alloc(4096);
    await h.read(buf, 0, buf.length, 0);
    return buf.toString('latin1', 0, 8);
  } finally {
    await h.close();
  }
}

const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) {
    await cleanupUnder(d);
    await fs.rm(d, { recursive: true, force: true });
  }
});

describe.runIf(isRoot())('a loop device attached again', () => {
  it('shows the file it is attached to now, not pages it cached of the one before', async () => {
    const dir = await tempDir('loop-cache');
    dirs.push(dir);
    const [a, b] = [path.join(dir, 'a.img'), path.join(dir, 'b.img')];
    await fs.writeFile(a, Buffer.alloc(MiB, 'A'));
    await fs.writeFile(b, Buffer.alloc(MiB, 'B'));
    // Another test may take the freed device between the detach and the second attach: try another.
    for (let attempt = 0; attempt < 5; attempt++) {
      const device = sh('losetup', ['--find', '--show', a]);
      expect(await firstBlock(device)).toBe('AAAAAAAA'); // now in the page cache
      sh('losetup', ['--detach', device]);
      try {
        sh('losetup', [device, b]);
      } catch {
        continue;
      }
      try {
        expect(await firstBlock(device)).toBe('BBBBBBBB');
      } finally {
        sh('losetup', ['--detach', device]);
      }
      return;
    }
    throw new Error('no loop device could be attached twice in a row');
  });

  it('held open, shows what it cached after the file behind it changed, until its cache is dropped', async () => {
    const dir = await tempDir('loop-cache-held');
    dirs.push(dir);
    const image = path.join(dir, 'disk.img');
    await fs.writeFile(image, Buffer.alloc(MiB, 'A'));
    const device = sh('losetup', ['--find', '--show', image]);
    const held = await fs.open(device, 'r'); // as udev's probe, or a pod, may hold it
    try {
      expect(await firstBlock(device)).toBe('AAAAAAAA');
      // Another host writes the image (here: this one, through the file, not the device).
      const h = await fs.open(image, 'r+');
      await h.write(Buffer.alloc(4096, 'B'), 0, 4096, 0);
      await h.sync();
      await h.close();
      expect(await firstBlock(device)).toBe('AAAAAAAA');
      sh('blockdev', ['--flushbufs', device]);
      expect(await firstBlock(device)).toBe('BBBBBBBB');
    } finally {
      await held.close();
      sh('losetup', ['--detach', device]);
    }
  });
});
