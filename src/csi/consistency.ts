/**
 * Point-in-time copies of volumes: their locks held (no expand, delete or second copy meanwhile, in any
 * process) and their filesystems frozen where they are mounted on this host, for the whole copy, so
 * the copies of a group all stand for one instant.
 */
import type { Freezer } from '../host/freeze.js';
import type { Pool } from '../pool/pool.js';
import type { VolumeStore } from '../pool/volumes.js';
import type { CallContext } from '../server/call.js';

export interface CopyDeps {
  pool: Pool;
  volumes: VolumeStore;
  freezer: Freezer;
}

export async function withVolumesQuiesced<T>(
  ctx: CallContext,
  d: CopyDeps,
  volumeIds: readonly string[],
  fn: (takenAt: Date) => Promise<T>,
): Promise<T> {
  const ids = [...new Set(volumeIds)].sort();
  const hold = async (i: number): Promise<T> => {
    const id = ids[i];
    if (id === undefined) {
      return d.freezer.freezeWhile(
        ctx,
        ids.map((v) => d.volumes.imagePath(v)),
        () => fn(new Date()),
      );
    }
    return d.pool.withLock(id, 'snapshot copy', () => hold(i + 1));
  };
  return hold(0);
}
