/**
 * A snapshot never takes space the pool promised to a volume (GetCapacity: "never more than the pool can
 * honour"). A byte copy takes its blocks when it is made, so it is admitted against the free space; a
 * reflink takes none then, but its source's next overwrite needs new blocks for every one they share,
 * so it is counted as a promise for as long as it lives. Before this, both were made regardless: a
 * sparse volume then hit ENOSPC writing space it had been promised (its filesystem aborted), and a
 * preallocated one, overwritten, failed the same way.
 * Root only: real ext4 and XFS pools on loop devices this file makes and removes.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { Capacity } from '../../src/pool/capacity.js';
import {
  blockCapability,
  controllerWorld,
  type ControllerWorld,
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
async function worldOn(fsType: 'ext4' | 'xfs'): Promise<ControllerWorld> {
  const base = await fs.mkdtemp(path.join(os.tmpdir(), `loopvol-test-snapshot-space-${fsType}-`));
  bases.push(base);
  const scratch = await scratchFilesystem(base, fsType, 320);
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

/** A sparse volume that takes what the pool can still promise, less `leaveMiB`. */
async function promiseAllBut(w: ControllerWorld, leaveMiB: number): Promise<string> {
  const { availableBytes } = await w.d.capacity.report();
  const bytes = Math.floor((availableBytes - leaveMiB * MiB) / MiB) * MiB;
  expect(bytes).toBeGreaterThan(0);
  return volumeIdOf(await w.CreateVolume('promised', { bytes, caps: [blockCapability] }));
}

describe.skipIf(!isRoot())('snapshots and the pool space promised to volumes', () => {
  it('a byte copy (ext4 pool) is refused when its blocks are promised to a volume, and counted once made', async () => {
    const w = await worldOn('ext4');
    const src = await filled(w, 'src', 64);
    const promised = await promiseAllBut(w, 32); // 32 MiB left: the 64 MiB copy does not fit
    expect(await codeOf(w.CreateSnapshot('too-big', src))).toBe('RESOURCE_EXHAUSTED');
    expect(await fs.readdir(w.pool.layout.snapshotsDir)).toEqual([]); // nothing copied, nothing left

    await w.volumes.delete(promised);
    const before = await w.d.capacity.report();
    const snap = await w.CreateSnapshot('fits', src);
    expect(snap.snapshot?.ready_to_use).toBe(true);
    const after = await w.d.capacity.report();
    expect(before.availableBytes - after.availableBytes).toBeGreaterThanOrEqual(60 * MiB);
  }, 120_000);

  it('a reflink (XFS pool) of a preallocated volume is promised, refused when it cannot be, and given back when deleted', async () => {
    const w = await worldOn('xfs');
    const src = await filled(w, 'src', 64, { allocation: 'preallocate' });
    const before = await w.d.capacity.report();
    const snap = await w.CreateSnapshot('first', src);
    const id = snap.snapshot?.snapshot_id ?? '';
    expect(snap.snapshot?.ready_to_use).toBe(true);
    // The reflink took no blocks, but the volume's next overwrite needs 64 MiB: no longer offered.
    const after = await w.d.capacity.report();
    expect(before.freeBytes - after.freeBytes).toBeLessThan(8 * MiB);
    expect(before.availablePreallocatedBytes - after.availablePreallocatedBytes).toBeGreaterThanOrEqual(
      60 * MiB,
    );
    // Counted from the images too, not only in this process's memory (a restarted controller sees it).
    const fresh = await Capacity.of(w.pool, 1).report();
    expect(before.availablePreallocatedBytes - fresh.availablePreallocatedBytes).toBeGreaterThanOrEqual(
      60 * MiB,
    );

    const promised = await promiseAllBut(w, 32);
    expect(await codeOf(w.CreateSnapshot('second', src))).toBe('RESOURCE_EXHAUSTED');
    await w.volumes.delete(promised);

    await w.snapshots.delete(id);
    const gone = await w.d.capacity.report();
    expect(gone.availablePreallocatedBytes - after.availablePreallocatedBytes).toBeGreaterThanOrEqual(
      60 * MiB,
    );
  }, 120_000);
});
