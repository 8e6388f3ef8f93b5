/**
 * Copies never take space the pool promised to a volume (GetCapacity: "never more than the pool can
 * honour"). A byte copy takes its blocks when it is made, so it is admitted against the free space. A
 * reflink takes none then, but every block a volume shares with another image needs a new one when the
 * volume rewrites it, so each volume also promises its shared blocks (pool/capacity.ts). Before this,
 * snapshots were made regardless: a sparse volume then hit ENOSPC writing space it had been promised
 * (its filesystem aborted), and a preallocated one, overwritten, failed the same way; so did restores.
 * Root only: real ext4 and XFS pools on loop devices this file makes and removes.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { Capacity, SCAN_TTL_MS } from '../../src/pool/capacity.js';
import { recordSharing } from '../../src/pool/shared-records.js';
import {
  blockCapability,
  controllerWorld,
  type ControllerWorld,
  fromSnapshot,
  fromVolume,
  removeControllerWorlds,
  volumeIdOf,
} from '../helpers/controller-world.js';
import { isRoot, MiB, type ScratchFs, scratchFilesystem, writeRandom } from '../helpers/host.js';
import { codeOf } from '../helpers/node-world.js';

const scratches: ScratchFs[] = [];
const bases: string[] = [];
afterAll(async () => {
  await removeControllerWorlds();
  for (const s of scratches) await s.remove();
  for (const b of bases) await fs.rm(b, { recursive: true, force: true });
});

/** A controller (overcommit ratio 1) on a new pool filesystem of its own. */
async function worldOn(fsType: 'ext4' | 'xfs', sizeMiB: number): Promise<ControllerWorld> {
  const base = await fs.mkdtemp(path.join(os.tmpdir(), `loopvol-test-snapshot-space-${fsType}-`));
  bases.push(base);
  const scratch = await scratchFilesystem(base, fsType, sizeMiB);
  scratches.push(scratch);
  return controllerWorld({ under: scratch.mountPoint, overcommitRatio: 1 });
}

/** A block volume of `mib` MiB that a pod filled; its id. */
async function filled(w: ControllerWorld, name: string, mib: number, parameters = {}): Promise<string> {
  const id = volumeIdOf(
    await w.CreateVolume(name, { bytes: mib * MiB, caps: [blockCapability], parameters }),
  );
  await writeRandom(w.volumes.imagePath(id), mib, mib);
  return id;
}

/** What a controller starting now would report: read from the pool, not from this process's memory. */
const fresh = (w: ControllerWorld) => Capacity.of(w.pool, 1).report();

/** Until the controller reads the pool again: what pods wrote since is in its numbers then. */
const rescanned = () => new Promise((r) => setTimeout(r, SCAN_TTL_MS + 100));

/** A sparse volume that takes what the pool can still promise, less `leaveMiB`. */
async function promiseAllBut(w: ControllerWorld, leaveMiB: number): Promise<string> {
  await rescanned();
  const { availableBytes } = await w.d.capacity.report();
  const bytes = Math.floor((availableBytes - leaveMiB * MiB) / MiB) * MiB;
  expect(bytes).toBeGreaterThan(0);
  return volumeIdOf(await w.CreateVolume('promised', { bytes, caps: [blockCapability] }));
}

/** Overwrites the whole of `image` in place, as a pod would: the write's error, or 'none'. */
async function overwrite(image: string): Promise<string> {
  const h = await fs.open(image, 'r+');
  try {
    const size = (await h.stat()).size;
    for (let off = 0; off < size; off += 4 * MiB) await h.write(Buffer.alloc(4 * MiB, 0x5a), 0, 4 * MiB, off);
    await h.sync();
    return 'none';
  } catch (err) {
    return (err as NodeJS.ErrnoException).code ?? String(err);
  } finally {
    await h.close().catch(() => undefined);
  }
}

describe.skipIf(!isRoot())('snapshots and the pool space promised to volumes', () => {
  it('a byte copy (ext4 pool) is refused when its blocks are promised to a volume', async () => {
    const w = await worldOn('ext4', 320);
    const src = await filled(w, 'src', 64);
    const promised = await promiseAllBut(w, 32); // 32 MiB left: the 64 MiB copy does not fit
    expect(await codeOf(w.CreateSnapshot('too-big', src))).toBe('RESOURCE_EXHAUSTED');
    expect(await fs.readdir(w.pool.layout.snapshotsDir)).toEqual([]); // nothing copied, nothing left
    // The promised volume gets all of its space.
    await writeRandom(
      w.volumes.imagePath(promised),
      (await fs.stat(w.volumes.imagePath(promised))).size / MiB,
      3,
    );

    await w.volumes.delete(promised);
    expect((await w.CreateSnapshot('fits', src)).snapshot?.ready_to_use).toBe(true);
  }, 120_000);

  it('reflinks (XFS pool): what a rewrite of shared blocks needs is promised, so every volume can still rewrite all of itself', async () => {
    const w = await worldOn('xfs', 512);
    const p = await filled(w, 'prealloc', 64, { allocation: 'preallocate' });
    const q = await filled(w, 'sparse', 32);
    await rescanned();
    const start = await w.d.capacity.report();

    const s1 = (await w.CreateSnapshot('first', p)).snapshot?.snapshot_id ?? '';
    const afterFirst = await w.d.capacity.report();
    expect(start.freeBytes - afterFirst.freeBytes).toBeLessThan(8 * MiB); // a reflink takes no blocks
    // ...but the volume's next overwrite needs 64 MiB: no longer offered.
    expect(start.availablePreallocatedBytes - afterFirst.availablePreallocatedBytes).toBeGreaterThanOrEqual(
      60 * MiB,
    );

    await w.CreateSnapshot('second', p); // of the same blocks: nothing more to promise
    const afterSecond = await w.d.capacity.report();
    expect(afterFirst.availableBytes - afterSecond.availableBytes).toBeLessThan(8 * MiB);

    // A restore shares the snapshot's blocks: its own rewrite of them is promised too.
    const c = volumeIdOf(
      await w.CreateVolume('restored', {
        bytes: 64 * MiB,
        caps: [blockCapability],
        source: fromSnapshot(s1),
      }),
    );
    const afterRestore = await w.d.capacity.report();
    expect(afterSecond.availableBytes - afterRestore.availableBytes).toBeGreaterThanOrEqual(60 * MiB);
    // Counted from the pool too, not only in this process's memory (a restarted controller sees it).
    expect(Math.abs((await fresh(w)).availableBytes - afterRestore.availableBytes)).toBeLessThan(8 * MiB);

    // Everything left is promised to one more volume, which a pod fills.
    const f = await promiseAllBut(w, 8);
    expect(await codeOf(w.CreateSnapshot('of-unshared', q))).toBe('RESOURCE_EXHAUSTED');
    await writeRandom(w.volumes.imagePath(f), (await fs.stat(w.volumes.imagePath(f))).size / MiB, 5);
    // Every volume rewrites all of itself: none runs out of space.
    expect(await overwrite(w.volumes.imagePath(p))).toBe('none');
    expect(await overwrite(w.volumes.imagePath(c))).toBe('none');
    expect(await overwrite(w.volumes.imagePath(q))).toBe('none');
  }, 120_000);

  it('volumes made before records of shared blocks were kept count as sharing all until a controller records them', async () => {
    const w = await worldOn('xfs', 512);
    const src = await filled(w, 'source', 32);
    const other = await filled(w, 'unrelated', 32);
    await w.CreateSnapshot('of-source', src);
    const clone = volumeIdOf(
      await w.CreateVolume('clone', { bytes: 32 * MiB, caps: [blockCapability], source: fromVolume(src) }),
    );
    const l = w.pool.layout;
    const shared = async (id: string): Promise<unknown> =>
      (JSON.parse(await fs.readFile(l.volumeShared(id), 'utf8')) as { bytes: number }).bytes;
    const recorded = await fresh(w);
    // An older release kept no such records.
    for (const id of [src, other, clone]) await fs.rm(l.volumeShared(id));
    const older = await fresh(w);
    // The unrelated volume now counts as sharing its 32 MiB too.
    expect(recorded.availableBytes - older.availableBytes).toBeGreaterThanOrEqual(30 * MiB);

    expect(await recordSharing(w.pool, Capacity.of(w.pool, 1), w)).toBe(3);
    expect(await shared(src)).toBeGreaterThanOrEqual(32 * MiB);
    expect(await shared(clone)).toBeGreaterThanOrEqual(32 * MiB);
    expect(await shared(other)).toBe(0);
    expect(Math.abs((await fresh(w)).availableBytes - recorded.availableBytes)).toBeLessThan(4 * MiB);
    expect(await recordSharing(w.pool, Capacity.of(w.pool, 1), w)).toBe(0);

    // A restore from a snapshot deleted since: the snapshot's source is no longer known, so no volume
    // can be said to share nothing. No record is written; all count as sharing everything.
    const s2 = (await w.CreateSnapshot('restored-then-deleted', other)).snapshot?.snapshot_id ?? '';
    await w.CreateVolume('restored', { bytes: 32 * MiB, caps: [blockCapability], source: fromSnapshot(s2) });
    await w.snapshots.delete(s2);
    await fs.rm(l.volumeShared(other));
    expect(await recordSharing(w.pool, Capacity.of(w.pool, 1), w)).toBe(0);
    await expect(fs.access(l.volumeShared(other))).rejects.toThrow(/ENOENT/);
  }, 120_000);
});
