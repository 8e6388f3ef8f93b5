/**
 * What crashed creations left: a volume or snapshot whose record still says "creating" (a partial image
 * with it, maybe). Nothing was ever returned for it, so nothing refers to it; a CO retries the create
 * (which clears it first), but one that gave up (its PVC or VolumeSnapshot deleted meanwhile) never
 * retries, and never deletes what it was never told of. A controller clears them: it looks when it
 * starts and every few minutes, and discards one only when two looks in a row saw it unchanged (its
 * record, its partial image) and its pool lock is free (a create at work, in any process, holds it);
 * under that lock it is read again. A lock a crashed process left in another container counts as held
 * until it has stayed unchanged for the lock lease (lock.ts), which is shorter than a look's interval.
 *
 * Left alone: a directory without a record (it may be one an operator is copying back: a restore
 * writes the image before the record), records that cannot be read (an operator decides: `loopvol
 * check`), and members of a group snapshot (the group's create or delete clears them).
 */
import fs from 'node:fs/promises';
import type { Logger } from 'pino';
import { mapLimit, repeat, type Repeating } from '../limit.js';
import { listDir, type RecordRead } from './fsutil.js';
import { isSnapshotId, isVolumeId } from './ids.js';
import type { Pool } from './pool.js';
import type { RecordReaders, SnapshotMeta, VolumeMeta } from './types.js';

/** How often a controller looks for unfinished creations (longer than the lock lease, lock.ts). */
export const DISCARD_EVERY_MS = 5 * 60_000;

interface Kind {
  what: 'volume' | 'snapshot';
  dir: string;
  isId: (id: string) => boolean;
  inspect: (id: string) => Promise<RecordRead<VolumeMeta | SnapshotMeta>>;
  dirOf: (id: string) => string;
  partialOf: (id: string) => string;
}

export class LeftoverSweeper {
  /** What the last look saw unfinished: `kind:id` → its fingerprint. */
  private seen = new Map<string, string>();
  private readonly kinds: Kind[];

  constructor(
    private readonly pool: Pool,
    stores: RecordReaders,
    private readonly log: Logger,
  ) {
    const l = pool.layout;
    this.kinds = [
      {
        what: 'volume',
        dir: l.volumesDir,
        isId: isVolumeId,
        inspect: (id) => stores.volumes.inspect(id),
        dirOf: (id) => l.volumeDir(id),
        partialOf: (id) => l.volumeImageTemp(id),
      },
      {
        what: 'snapshot',
        dir: l.snapshotsDir,
        isId: isSnapshotId,
        inspect: (id) => stores.snapshots.inspect(id),
        dirOf: (id) => l.snapshotDir(id),
        partialOf: (id) => l.snapshotImageTemp(id),
      },
    ];
  }

  /**
   * One look: discards what the previous look saw unfinished and is unchanged and free now, and
   * remembers what is unfinished for the next. Returns the directories it discarded.
   */
  async look(): Promise<{ discarded: string[]; waiting: number }> {
    const previous = this.seen;
    const seen = new Map<string, string>();
    const discarded: string[] = [];
    for (const k of this.kinds) {
      const ids = (await listDir(k.dir)).filter(k.isId);
      await mapLimit(ids, 16, async (id) => {
        const key = `${k.what}:${id}`;
        const now = await fingerprint(k, id);
        if (now === undefined) return;
        if (previous.get(key) !== now || !(await this.discard(k, id, now))) seen.set(key, now);
        else discarded.push(k.dirOf(id));
      });
    }
    this.seen = seen;
    return { discarded, waiting: seen.size };
  }

  /** Discards `id` under its lock if it is still as `expected`; false when held or changed. */
  private async discard(k: Kind, id: string, expected: string): Promise<boolean> {
    // Held: a create at work right now, in this process or another. Its own to finish or clear.
    const done = await this.pool.withLockIfFree(id, 'discard an unfinished creation', async () => {
      if ((await fingerprint(k, id)) !== expected) return false;
      await this.pool.discard(k.dirOf(id));
      this.log.warn({ [`${k.what}Id`]: id }, `discarded an unfinished ${k.what} creation a crash left`);
      return true;
    });
    return done === true;
  }
}

/**
 * What an unfinished creation of its own (not a group's member) looks like now: its record and its
 * partial image. Undefined when `id` is not one.
 */
async function fingerprint(k: Kind, id: string): Promise<string | undefined> {
  const r = await k.inspect(id);
  if (r.state !== 'ok' || r.value.state !== 'creating') return undefined;
  if ('groupSnapshotId' in r.value && r.value.groupSnapshotId !== '') return undefined;
  const partial = await fs.stat(k.partialOf(id)).catch(() => undefined);
  return JSON.stringify([r.value, partial ? [partial.size, partial.mtimeMs, partial.ino] : null]);
}

/** Looks now and every `everyMs` until stopped; logs what it did. */
export function startDiscarding(
  pool: Pool,
  stores: RecordReaders,
  log: Logger,
  everyMs = DISCARD_EVERY_MS,
): Repeating {
  const sweeper = new LeftoverSweeper(pool, stores, log);
  return repeat(everyMs, () =>
    sweeper.look().then(
      ({ discarded, waiting }) => {
        if (discarded.length > 0)
          log.warn({ count: discarded.length }, 'discarded unfinished creations crashes left');
        if (waiting > 0)
          log.info(
            { count: waiting, nextLookMs: everyMs },
            'unfinished creations seen; each is discarded at the next look if it is unchanged and nobody holds it',
          );
      },
      (err: unknown) => {
        log.error({ err }, 'could not look for unfinished creations to discard; trying again later');
      },
    ),
  );
}
