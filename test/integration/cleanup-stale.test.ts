/**
 * The test helpers' cleanup (test/helpers/host.ts cleanupUnder) detaches a leaked loop device by the
 * number it listed it under. Files run side by side, so by the time of its `losetup -d` that number
 * may serve another file's image: it detaches only a device still showing what it listed. Here the
 * number is switched to another image (LOOP_CHANGE_FD on a read-only device, so the number is never
 * free and nobody else's device is at risk) between the listing and the detach. Root only; devices of
 * its own only.
 */
import { execFileSync } from 'node:child_process';
import fsp from 'node:fs/promises';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { afterAll, expect, it, vi } from 'vitest';
import { cleanupUnder, isRoot } from '../helpers/host.js';

const sh = (c: string, a: string[]): string => execFileSync(c, a, { encoding: 'utf8' }).trim();
const backing = (dev: string): string => {
  try {
    return readFileSync(`/sys/block/${path.basename(dev)}/loop/backing_file`, 'utf8').trim();
  } catch {
    return '';
  }
};
const mine: { dev: string; file: string }[] = [];
let top = '';
afterAll(async () => {
  for (const { dev, file } of mine) if (backing(dev) === file) sh('losetup', ['-d', dev]);
  if (top) await fsp.rm(top, { recursive: true, force: true });
});

it.runIf(isRoot())(
  'never detaches a device that serves another image by the time of its detach',
  async () => {
    top = await fsp.mkdtemp('/tmp/loopvol-test-stale-');
    const root = path.join(top, 'root');
    await fsp.mkdir(root);
    const a = path.join(root, 'a.img'); // the test file's leak
    const b = path.join(top, 'other.img'); // another file's image, outside the root
    const by = path.join(top, 'bystander.img'); // makes `others` non-empty, so the walk runs
    for (const f of [a, b, by]) sh('truncate', ['-s', '8M', f]);
    const dev = sh('losetup', ['-r', '--find', '--show', a]);
    mine.push({ dev, file: a });
    const bdev = sh('losetup', ['--find', '--show', by]);
    mine.push({ dev: bdev, file: by });
    let swapped = false;
    const real = fsp.readdir.bind(fsp);
    let rootReads = 0;
    vi.spyOn(fsp, 'readdir').mockImplementation(((p: string, o: unknown) => {
      // 2nd walk of root = inside `now = await leaksUnder(root)`, after its sysfs listing named `dev`.
      if (p === root && ++rootReads === 2 && !swapped) {
        sh('python3', [
          '-c',
          `import fcntl,os
d=os.open("${dev}",os.O_RDONLY); f=os.open("${b}",os.O_RDONLY)
fcntl.ioctl(d,0x4C06,f)`,
        ]);
        swapped = backing(dev) === b;
        if (swapped) mine.push({ dev, file: b });
      }
      return real(p, o as never);
    }) as never);
    await cleanupUnder(root);
    vi.restoreAllMocks();
    expect({ swapped, after: backing(dev) }).toEqual({ swapped: true, after: b });
  },
);
