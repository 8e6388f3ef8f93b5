/**
 * The sector size a volume's data was written on travels with its data: a snapshot records its source's,
 * and a restore or a clone gets it in its own `initialized` marker, so that its raw block device is
 * attached with the geometry the data was written on (loop.ts). In-process, on a real pool.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import { afterAll, describe, expect, it } from 'vitest';
import { parseSnapshotMeta } from '../../src/pool/types.js';
import {
  type ControllerWorld,
  controllerWorld,
  fromSnapshot,
  fromVolume,
  removeControllerWorlds,
  volumeIdOf,
} from '../helpers/controller-world.js';
import { MiB } from '../helpers/node-world.js';

afterAll(removeControllerWorlds);

/** A raw block volume a node initialized (`sectorSize`: what its marker records) and its pod wrote. */
async function written(w: ControllerWorld, name: string, sectorSize?: number): Promise<string> {
  const id = volumeIdOf(await w.CreateVolume(name));
  if (sectorSize) await w.volumes.markInitialized(id, 'node n1 (raw block)', sectorSize);
  else {
    // A marker of an older release: who and when, no sector size.
    const marker = JSON.stringify({ by: 'node n1 (raw block)', at: new Date().toISOString() });
    await fs.writeFile(w.pool.layout.volumeInitialized(id), marker);
  }
  const h = await fs.open(w.volumes.imagePath(id), 'r+');
  await h.write(Buffer.alloc(MiB, 0x5a), 0, MiB, 0);
  await h.close();
  return id;
}

/** What a snapshot, its restore, a clone and a group snapshot's member (and its restore) record. */
async function copiesOf(w: ControllerWorld, id: string) {
  const snapId = (await w.CreateSnapshot('snap', id)).snapshot?.snapshot_id ?? '';
  const restored = volumeIdOf(await w.CreateVolume('restored', { source: fromSnapshot(snapId) }));
  const cloned = volumeIdOf(await w.CreateVolume('cloned', { source: fromVolume(id) }));
  const group = await w.CreateVolumeGroupSnapshot('group', [id]);
  const memberId = group.group_snapshot?.snapshots?.[0]?.snapshot_id ?? '';
  const fromMember = volumeIdOf(await w.CreateVolume('from-member', { source: fromSnapshot(memberId) }));
  return {
    source: await w.volumes.initialization(id),
    snapshot: (await w.snapshots.get(snapId))?.sectorSize,
    restored: await w.volumes.initialization(restored),
    cloned: await w.volumes.initialization(cloned),
    member: (await w.snapshots.get(memberId))?.sectorSize,
    fromMember: await w.volumes.initialization(fromMember),
  };
}

describe('the sector size a volume was written on', () => {
  it('is kept by its snapshots, restores, clones and group snapshots', async () => {
    const w = await controllerWorld();
    expect(await copiesOf(w, await written(w, 'src', 4096))).toEqual({
      source: { sectorSize: 4096 },
      snapshot: 4096,
      restored: { sectorSize: 4096 },
      cloned: { sectorSize: 4096 },
      member: 4096,
      fromMember: { sectorSize: 4096 },
    });
  });

  it('is unknown, never made up, for a volume an older release initialized (still initialized)', async () => {
    const w = await controllerWorld();
    expect(await copiesOf(w, await written(w, 'src'))).toEqual({
      source: {},
      snapshot: undefined,
      restored: {},
      cloned: {},
      member: undefined,
      fromMember: {},
    });
  });

  it('is absent for a volume never initialized; a marker unreadable, a symlink or a FIFO still says initialized', async () => {
    const w = await controllerWorld();
    const blank = volumeIdOf(await w.CreateVolume('blank'));
    const damaged = volumeIdOf(await w.CreateVolume('damaged'));
    await fs.writeFile(w.pool.layout.volumeInitialized(damaged), '{"by": "node n1", "sectorS');
    // Planted in a shared pool: read through neither, nor blocked on.
    const dangling = volumeIdOf(await w.CreateVolume('dangling'));
    await fs.symlink('/nonexistent/marker', w.pool.layout.volumeInitialized(dangling));
    const fifo = volumeIdOf(await w.CreateVolume('fifo'));
    execFileSync('mkfifo', [w.pool.layout.volumeInitialized(fifo)]);
    const read = async (id: string) => ({
      initialization: await w.volumes.initialization(id),
      initialized: await w.volumes.isInitialized(id),
    });
    expect({
      blank: await read(blank),
      damaged: await read(damaged),
      dangling: await read(dangling),
      fifo: await read(fifo),
    }).toEqual({
      blank: { initialization: undefined, initialized: false },
      damaged: { initialization: {}, initialized: true },
      dangling: { initialization: {}, initialized: true },
      fifo: { initialization: {}, initialized: true },
    });
  });

  it('makes a snapshot record damaged when it is not a sector size', () => {
    const meta = {
      format: 1,
      id: 'snap-1',
      name: 'snap',
      state: 'ready',
      sourceVolumeId: 'vol-1',
      sizeBytes: MiB,
      fsType: 'none',
      initialized: true,
      parameters: {},
      groupSnapshotId: '',
      createdAt: new Date().toISOString(),
    };
    expect({
      valid: parseSnapshotMeta({ ...meta, sectorSize: 4096 })?.sectorSize,
      older: parseSnapshotMeta(meta) !== undefined,
      notAPowerOfTwo: parseSnapshotMeta({ ...meta, sectorSize: 1000 }),
      text: parseSnapshotMeta({ ...meta, sectorSize: '512' }),
    }).toEqual({ valid: 4096, older: true, notAPowerOfTwo: undefined, text: undefined });
  });
});
