/**
 * Records of shared blocks (capacity.ts) for volumes made before such records were kept. Until it has
 * one, a volume on a pool that reflinks counts as sharing everything it holds: never less than it may,
 * but a pool of written volumes would then offer too little. A controller writes the missing records
 * when it starts: a volume that is the source of a snapshot or of a clone, or was made from one, may
 * share all its allocated bytes; any other shares none. Only when every record of the pool can say so
 * (none damaged or quarantined, no restore from a snapshot deleted since); else none is written. Each
 * under the volume's lock, taken only when free (a create at work writes its own); a volume still being
 * made is left to its create.
 */
import type { Logger } from 'pino';
import { mapLimit } from '../limit.js';
import type { Capacity } from './capacity.js';
import { listDir } from './fsutil.js';
import { isSnapshotId, isVolumeId } from './ids.js';
import { allocatedBytes } from './images.js';
import type { Pool } from './pool.js';
import type { RecordReaders } from './types.js';

/** Writes the missing records; returns how many it wrote. */
export async function recordSharing(pool: Pool, capacity: Capacity, stores: RecordReaders): Promise<number> {
  if (!(await pool.fs.canReflink().catch(() => false))) return 0;
  const l = pool.layout;
  const volumes = (await listDir(l.volumesDir)).filter(isVolumeId);
  const missing = (
    await mapLimit(volumes, 16, async (id) => ((await capacity.hasSharedRecord(id)) ? undefined : id))
  ).filter((id): id is string => id !== undefined);
  if (missing.length === 0) return 0;

  // Who may share: sources of snapshots and of clones, and what was made from a source. Known only when
  // every record says: a snapshot that cannot be read, or was quarantined, or was deleted after a
  // restore from it (its source is then unknown), may share any volume's blocks. Then nothing is
  // written, and every volume without a record keeps counting as sharing all.
  const sharing = new Set<string>();
  let known = (await pool.quarantined()).length === 0;
  const snapshots = new Set((await listDir(l.snapshotsDir)).filter(isSnapshotId));
  await mapLimit([...snapshots], 16, async (id) => {
    const r = await stores.snapshots.inspect(id);
    if (r.state === 'ok') sharing.add(r.value.sourceVolumeId);
    else known = false;
  });
  await mapLimit(volumes, 16, async (id) => {
    const r = await stores.volumes.inspect(id);
    if (r.state !== 'ok') {
      known = false;
      return;
    }
    const from = r.value.contentSource;
    if (from === null) return;
    sharing.add(id);
    if (from.kind === 'volume') sharing.add(from.id);
    else if (!snapshots.has(from.id)) known = false;
  });
  if (!known) return 0;

  let written = 0;
  await mapLimit(missing, 16, async (id) => {
    // A volume whose lock is held keeps counting as sharing all.
    await pool.withLockIfFree(id, 'record shared blocks', async () => {
      if (await capacity.hasSharedRecord(id)) return;
      const r = await stores.volumes.inspect(id);
      if (r.state !== 'ok' || r.value.state !== 'ready') return;
      const allocated = sharing.has(id) ? await allocatedBytes(l.volumeImage(id)) : 0;
      await capacity.markShared(id, Math.min(allocated, r.value.capacityBytes));
      written++;
    });
  });

  return written;
}

/** recordSharing in the background, logged. */
export function startRecordingSharing(
  pool: Pool,
  capacity: Capacity,
  stores: RecordReaders,
  log: Logger,
): void {
  recordSharing(pool, capacity, stores).then(
    (written) => {
      if (written > 0)
        log.info({ volumes: written }, 'recorded the shared blocks of volumes made before such records');
    },
    (err: unknown) => {
      log.error(
        { err },
        'could not record the shared blocks of older volumes; they count as sharing everything',
      );
    },
  );
}
