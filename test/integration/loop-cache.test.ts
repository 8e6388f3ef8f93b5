/**
 * The kernel's behaviour a stage relies on when it probes a device it has just attached without dropping
 * the host's cache first (src/node/format.ts): a loop device keeps no cached page of the file it was
 * attached to before. On the real kernel, with losetup.
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
});
