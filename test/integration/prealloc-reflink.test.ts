/**
 * A preallocated clone or restore owns its blocks on a pool that can reflink (XFS), so that a write to
 * it never fails for lack of pool space (README, allocation: preallocate): made by reflink, it would
 * otherwise share its source's extents, and its next overwrite would need new blocks, which a full
 * pool refuses.
 * Root only: a real XFS on a loop device this file makes and removes.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  blockCapability,
  type ControllerWorld,
  controllerWorld,
  fromSnapshot,
  fromVolume,
  removeControllerWorlds,
  volumeIdOf,
} from '../helpers/controller-world.js';
import { isRoot, MiB, type ScratchFs, scratchFilesystem, writeRandom } from '../helpers/host.js';

let scratch: ScratchFs | undefined;
let base: string | undefined;
afterAll(async () => {
  await removeControllerWorlds();
  await scratch?.remove();
  if (base) await fs.rm(base, { recursive: true, force: true });
});

const freeBytes = async (p: string): Promise<number> => {
  const s = await fs.statfs(p);
  return s.bavail * s.bsize;
};

/** Extents of `file` that XFS marks shared (fiemap flag 0x2000). */
const sharedExtents = (file: string): number =>
  execFileSync('xfs_io', ['-r', '-c', 'fiemap -v', file], { encoding: 'utf8' })
    .split('\n')
    .filter((l) => /0x2[0-9a-f]{3}\s*$/.test(l.trim())).length;

/**
 * Fills the pool, overwrites 8 MiB of `image` in place as a pod would, frees the pool: the write's
 * error, or 'none'. Returns once the pool's free space is back: XFS frees a removed file's blocks in
 * the background (deferred inode inactivation), later under load, and the next test must not find the
 * pool still full.
 */
async function overwriteWhenFull(image: string): Promise<string> {
  const mountPoint = scratch?.mountPoint ?? '';
  const filler = path.join(mountPoint, 'filler');
  const free = await freeBytes(mountPoint);
  try {
    execFileSync('dd', ['if=/dev/zero', `of=${filler}`, 'bs=1M', 'oflag=direct'], { stdio: 'ignore' });
  } catch {
    // ENOSPC: the pool is full
  }
  let writeError = 'none';
  const h = await fs.open(image, 'r+');
  try {
    await h.write(Buffer.alloc(8 * MiB, 0x42), 0, 8 * MiB, 16 * MiB);
    await h.sync();
  } catch (err) {
    writeError = (err as NodeJS.ErrnoException).code ?? String(err);
  } finally {
    await h.close().catch(() => undefined);
    await fs.rm(filler, { force: true });
  }
  // The overwrite may take a few blocks of its own: what stays missing is less than what it wrote.
  for (let i = 0; i < 100 && (await freeBytes(mountPoint)) < free - 8 * MiB; i++) {
    await new Promise((r) => setTimeout(r, 100));
  }
  return writeError;
}

describe.skipIf(!isRoot())('preallocated volumes on a reflink pool', () => {
  let w: ControllerWorld;
  beforeAll(async () => {
    base = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-test-prealloc-reflink-'));
    scratch = await scratchFilesystem(base, 'xfs', 1024);
    w = await controllerWorld({ under: scratch.mountPoint }); // the controller world's pool lives on the XFS
    expect(w.dir.startsWith(scratch.mountPoint)).toBe(true);
  });

  it.each(['a volume', 'a snapshot'] as const)(
    'a preallocated copy of %s takes its blocks when it is made',
    async (from) => {
      const src = volumeIdOf(
        await w.CreateVolume(`src-${from}`, { bytes: 64 * MiB, caps: [blockCapability] }),
      );
      await writeRandom(w.volumes.imagePath(src), 64, 7); // a pod filled it
      const source =
        from === 'a volume'
          ? fromVolume(src)
          : fromSnapshot((await w.CreateSnapshot(`snap-of-${src}`, src)).snapshot?.snapshot_id ?? '');
      const before = await freeBytes(w.dir);
      const copy = volumeIdOf(
        await w.CreateVolume(`copy-${from}`, {
          bytes: 64 * MiB,
          caps: [blockCapability],
          parameters: { allocation: 'preallocate' },
          source,
        }),
      );
      const image = w.volumes.imagePath(copy);
      expect(before - (await freeBytes(w.dir))).toBeGreaterThanOrEqual(60 * MiB);
      expect(sharedExtents(image)).toBe(0);
      expect(await overwriteWhenFull(image)).toBe('none');
    },
    60_000,
  );
});
