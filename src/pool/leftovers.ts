/**
 * What crashed creations left: a volume or snapshot directory whose record still says "creating" (a
 * partial image with it, maybe), or that holds neither a record nor an image. Nothing was ever
 * returned for them, so nothing refers to them; a CO retries the create (which clears it first), but
 * one that gave up (its PVC or VolumeSnapshot deleted meanwhile) never retries, and never deletes what
 * it was never told of. A controller clears them when it starts and every few minutes after: each under
 * its pool lock, taken only when free (a create at work in another process holds it), read again under
 * it. A lock left by a crashed process in another container counts as held until it has stayed
 * unchanged for the lock lease (lock.ts), so such a leftover goes at the first look after that.
 *
 * Left alone: records that cannot be read (an operator decides: `loopvol check`), and members of a
 * group snapshot (the group's create or delete clears them).
 */
import path from 'node:path';
import type { Logger } from 'pino';
import { DomainError } from '../errors.js';
import { mapLimit } from '../limit.js';
import { listDir, type RecordRead } from './fsutil.js';
import { isSnapshotId, isVolumeId } from './ids.js';
import type { Pool } from './pool.js';
import type { SnapshotMeta, VolumeMeta } from './types.js';

interface Kind {
  what: 'volume' | 'snapshot';
  dir: string;
  isId: (id: string) => boolean;
  inspect: (id: string) => Promise<RecordRead<VolumeMeta | SnapshotMeta>>;
  dirOf: (id: string) => string;
  imageOf: (id: string) => string;
}

/**
 * Whether `id`'s directory is an unfinished creation of its own (not a group's member): its record says
 * "creating", or it has no record and holds nothing but a partial image and temp files.
 */
async function unfinished(k: Kind, id: string): Promise<boolean> {
  const r = await k.inspect(id);
  if (r.state === 'ok') {
    const member = 'groupSnapshotId' in r.value && r.value.groupSnapshotId !== '';
    return r.value.state === 'creating' && !member;
  }
  if (r.state === 'damaged') return false;
  const partial = `${path.basename(k.imageOf(id))}.partial`;
  return (await listDir(k.dirOf(id))).every((e) => e === partial || e.startsWith('.'));
}

/** Discards every unfinished creation nobody is working on; returns their directories. */
export async function discardUnfinished(
  pool: Pool,
  stores: {
    volumes: { inspect: (id: string) => Promise<RecordRead<VolumeMeta>> };
    snapshots: { inspect: (id: string) => Promise<RecordRead<SnapshotMeta>> };
  },
  log: Logger,
): Promise<string[]> {
  const l = pool.layout;
  const kinds: Kind[] = [
    {
      what: 'volume',
      dir: l.volumesDir,
      isId: isVolumeId,
      inspect: (id) => stores.volumes.inspect(id),
      dirOf: (id) => l.volumeDir(id),
      imageOf: (id) => l.volumeImage(id),
    },
    {
      what: 'snapshot',
      dir: l.snapshotsDir,
      isId: isSnapshotId,
      inspect: (id) => stores.snapshots.inspect(id),
      dirOf: (id) => l.snapshotDir(id),
      imageOf: (id) => l.snapshotImage(id),
    },
  ];
  const discarded: string[] = [];
  for (const k of kinds) {
    const ids = (await listDir(k.dir)).filter(k.isId);
    await mapLimit(ids, 16, async (id) => {
      if (!(await unfinished(k, id))) return;
      try {
        await pool.withLock(
          id,
          'discard an unfinished creation',
          async () => {
            if (!(await unfinished(k, id))) return;
            await pool.discard(k.dirOf(id));
            discarded.push(k.dirOf(id));
            log.warn({ [`${k.what}Id`]: id }, `discarded an unfinished ${k.what} creation a crash left`);
          },
          0,
        );
      } catch (err) {
        // Held: a create at work right now, in this process or another. Its own to finish or clear.
        if (!(err instanceof DomainError && err.kind === 'busy')) throw err;
      }
    });
  }
  return discarded;
}

/** How often a controller looks for unfinished creations (longer than the lock lease, lock.ts). */
export const DISCARD_EVERY_MS = 5 * 60_000;

/** Discards unfinished creations now and every `everyMs` until stopped; logs what it did. */
export function startDiscarding(
  pool: Pool,
  stores: Parameters<typeof discardUnfinished>[1],
  log: Logger,
  everyMs = DISCARD_EVERY_MS,
): { first: Promise<void>; stop: () => void } {
  let stopped = false;
  let timer: NodeJS.Timeout | undefined;
  const once = (): Promise<void> =>
    discardUnfinished(pool, stores, log).then(
      (gone) => {
        if (gone.length > 0) log.warn({ count: gone.length }, 'discarded unfinished creations crashes left');
      },
      (err: unknown) => {
        log.error({ err }, 'could not look for unfinished creations to discard; trying again later');
      },
    );
  const schedule = (): void => {
    if (stopped) return;
    timer = setTimeout(() => void once().finally(schedule), everyMs);
    timer.unref();
  };
  const first = once().finally(schedule);
  return {
    first,
    stop() {
      stopped = true;
      if (timer) clearTimeout(timer);
    },
  };
}
