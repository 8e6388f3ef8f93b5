/**
 * What crashed creations left: a volume, snapshot or volume group snapshot whose record still says
 * "creating" (a partial image with it, maybe; a group's member snapshots with a group). Nothing was
 * ever returned for it, so nothing refers to it; a CO retries the create (which clears it first), but
 * one that gave up (its PVC, VolumeSnapshot or VolumeGroupSnapshot deleted meanwhile) never retries,
 * and never deletes what it was never told of. A controller clears them: it looks when it starts and
 * every few minutes, and discards one only when two looks in a row saw it unchanged (its record, its
 * partial image; a group's record and each member's record and images) and its pool lock is free (a
 * create at work, in any process, holds it); under that lock it is read again. A lock a crashed process
 * left in another container counts as held until it has stayed unchanged for the lock lease (lock.ts),
 * which is shorter than a look's interval.
 *
 * Left alone: a directory without a record (it may be one an operator is copying back: a restore
 * writes the image before the record), records that cannot be read (an operator decides: `loopvol
 * check`), and members of a group snapshot on their own (they go with their group: its create, its
 * delete, or this sweep of an unfinished group).
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import { mapLimit, repeat, type Repeating } from '../limit.js';
import { isTempName, listDir, type RecordRead } from './fsutil.js';
import { layoutProblem } from './layout.js';
import { type HeldLock, isAsideName } from './lock.js';
import { isGroupSnapshotId, isSnapshotId, isVolumeId } from './ids.js';
import type { Pool } from './pool.js';
import type { GroupSnapshotMeta, RecordReaders, SnapshotMeta, VolumeMeta } from './types.js';

/** How often a controller looks for unfinished creations (longer than the lock lease, lock.ts). */
export const DISCARD_EVERY_MS = 5 * 60_000;
/**
 * How long a record's temporary file must stay unchanged to count as left by a killed writer: an hour,
 * far beyond any write. Measured by this process's own clock from the look that first saw it so, never
 * by the file's times (another host's clock, on a shared pool).
 */
export const TEMP_AGE_MS = 60 * 60_000;

/** What the sweep needs of the snapshot store beyond reading records: a group's record, and its delete. */
export interface LeftoverStores extends RecordReaders {
  snapshots: RecordReaders['snapshots'] & {
    inspectGroup: (id: string) => Promise<RecordRead<GroupSnapshotMeta>>;
    deleteGroup: (id: string, memberIds: readonly string[], lock: HeldLock) => Promise<void>;
  };
}

interface Kind {
  what: 'volume' | 'snapshot' | 'group snapshot';
  dir: string;
  isId: (id: string) => boolean;
  /** What an unfinished creation looks like now; undefined when `id` is not one. */
  fingerprint: (id: string) => Promise<string | undefined>;
  dirOf: (id: string) => string;
  /** Removes it (called under its lock, once it was seen unchanged). */
  discard: (id: string, lock: HeldLock) => Promise<void>;
}

export class LeftoverSweeper {
  /** What the last look saw unfinished: `kind:id` → its fingerprint. */
  private seen = new Map<string, string>();
  private readonly kinds: Kind[];

  constructor(
    private readonly pool: Pool,
    stores: LeftoverStores,
    private readonly log: Logger,
  ) {
    const l = pool.layout;
    const { snapshots } = stores;
    const snapshot = (id: string) => created(snapshots.inspect(id), l.snapshotImageTemp(id));
    this.kinds = [
      {
        what: 'volume',
        dir: l.volumesDir,
        isId: isVolumeId,
        fingerprint: async (id) =>
          ownCreation(await created(stores.volumes.inspect(id), l.volumeImageTemp(id))),
        dirOf: (id) => l.volumeDir(id),
        discard: (id, lock) => pool.discard(l.volumeDir(id), lock),
      },
      {
        what: 'snapshot',
        dir: l.snapshotsDir,
        isId: isSnapshotId,
        fingerprint: async (id) => ownCreation(await snapshot(id)),
        dirOf: (id) => l.snapshotDir(id),
        discard: (id, lock) => pool.discard(l.snapshotDir(id), lock),
      },
      {
        what: 'group snapshot',
        dir: l.groupsDir,
        isId: isGroupSnapshotId,
        // The group's record and, for each member, its record, its partial image and its image (a
        // member's copy ends in a rename, and members are marked ready one by one). A group with a
        // member whose record cannot be read is left to an operator, as such a record is.
        fingerprint: async (id) => {
          const r = await snapshots.inspectGroup(id);
          if (r.state !== 'ok' || r.value.state !== 'creating') return undefined;
          const members = await Promise.all(
            r.value.snapshotIds.map(async (m) =>
              isSnapshotId(m) ? { ...(await snapshot(m)), image: await statOf(l.snapshotImage(m)) } : null,
            ),
          );
          if (members.some((m) => m?.record.state === 'damaged')) return undefined;
          return JSON.stringify([r.value, members]);
        },
        dirOf: (id) => l.groupDir(id),
        discard: async (id, lock) => {
          const r = await snapshots.inspectGroup(id);
          if (r.state === 'ok') await snapshots.deleteGroup(id, r.value.snapshotIds, lock);
        },
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
        try {
          const now = await k.fingerprint(id);
          if (now === undefined) return;
          if (previous.get(key) !== now || !(await this.discard(k, id, now))) seen.set(key, now);
          else discarded.push(k.dirOf(id));
        } catch (err) {
          // This one only: the others are looked at all the same. It is looked at anew next time.
          this.log.warn(
            { err, [idField(k)]: id },
            `could not look at or discard an unfinished ${k.what}; trying again at the next look`,
          );
        }
      });
    }
    this.seen = seen;
    return { discarded, waiting: seen.size };
  }

  /** The temporary files looks saw, by path: what they were (inode, size, times) and since when. */
  private temps = new Map<string, { was: string; since: number }>();

  /**
   * Removes what killed writers left where the pool's own records live (its root, nodes/, locks/): a
   * record's temporary file (fsutil's writeTemp), or a stale lock moved aside to be broken, once looks
   * saw it unchanged for `ageMs`. (A volume's or a snapshot's go with its directory.) Returns the files
   * removed.
   */
  async removeLeftTemps(ageMs = TEMP_AGE_MS): Promise<string[]> {
    const l = this.pool.layout;
    // Never through a directory of the pool that is a symlink (see layoutProblem).
    if ((await layoutProblem(l)) !== undefined) return [];
    const now = performance.now();
    const seen = new Map<string, { was: string; since: number }>();
    const removed: string[] = [];
    const places: [string, (name: string) => boolean][] = [
      [l.root, isTempName],
      [l.nodesDir, isTempName],
      [l.locksDir, (n) => isTempName(n) || isAsideName(n)],
    ];
    for (const [dir, isLeft] of places) {
      for (const name of (await listDir(dir)).filter(isLeft)) {
        const file = path.join(dir, name);
        const st = await fs.lstat(file).catch(() => undefined);
        if (!st?.isFile()) continue;
        const was = `${st.ino}:${st.size}:${st.mtimeMs}:${st.ctimeMs}`;
        const before = this.temps.get(file);
        const since = before?.was === was ? before.since : now;
        if (before?.was === was && now - since >= ageMs) {
          if (
            await fs.unlink(file).then(
              () => true,
              () => false,
            )
          )
            removed.push(file);
          continue;
        }
        seen.set(file, { was, since });
      }
    }
    this.temps = seen;
    return removed;
  }

  /** Discards `id` under its lock if it is still as `expected`; false when held or changed. */
  private async discard(k: Kind, id: string, expected: string): Promise<boolean> {
    // Held: a create at work right now, in this process or another. Its own to finish or clear.
    const done = await this.pool.withLockIfFree(id, 'discard an unfinished creation', async (lock) => {
      if ((await k.fingerprint(id)) !== expected) return false;
      lock.assertHeld();
      try {
        await k.discard(id, lock);
      } catch (err) {
        // Not "held": a group's member whose lock is busy stops the discard half-way, which is said.
        if (lock.signal.aborted) throw err;
        throw new Error(`discarding ${k.what} ${id} stopped half-way; the next looks finish it`, {
          cause: err,
        });
      }
      this.log.warn({ [idField(k)]: id }, `discarded an unfinished ${k.what} creation a crash left`);
      return true;
    });
    return done === true;
  }
}

const idField = (k: Kind): string => `${k.what === 'group snapshot' ? 'groupSnapshot' : k.what}Id`;

/** A record as read, with the partial image beside it (its size, time and inode), when it is there. */
async function created<T>(
  record: Promise<RecordRead<T>>,
  partial: string,
): Promise<{ record: RecordRead<T>; partial: number[] | null }> {
  const [r, p] = await Promise.all([record, statOf(partial)]);
  return { record: r, partial: p };
}

async function statOf(file: string): Promise<number[] | null> {
  const st = await fs.stat(file).catch(() => undefined);
  return st ? [st.size, st.mtimeMs, st.ino] : null;
}

/**
 * What an unfinished creation of its own (not a group's member) looks like now: its record and its
 * partial image. Undefined when it is not one.
 */
function ownCreation(c: {
  record: RecordRead<VolumeMeta | SnapshotMeta>;
  partial: number[] | null;
}): string | undefined {
  const r = c.record;
  if (r.state !== 'ok' || r.value.state !== 'creating') return undefined;
  if ('groupSnapshotId' in r.value && r.value.groupSnapshotId !== '') return undefined;
  return JSON.stringify([r.value, c.partial]);
}

/** Looks now and every `everyMs` until stopped; logs what it did. */
export function startDiscarding(
  pool: Pool,
  stores: LeftoverStores,
  log: Logger,
  everyMs = DISCARD_EVERY_MS,
  tempAgeMs = TEMP_AGE_MS,
): Repeating {
  const sweeper = new LeftoverSweeper(pool, stores, log);
  const temps = (): Promise<void> =>
    sweeper.removeLeftTemps(tempAgeMs).then(
      (removed) => {
        if (removed.length > 0)
          log.info(
            { count: removed.length, files: removed.slice(0, 10) },
            'removed temporary files killed writers left',
          );
      },
      (err: unknown) => {
        log.warn({ err }, 'could not look for temporary files killed writers left; trying again later');
      },
    );
  return repeat(everyMs, async () => {
    await temps();
    await sweeper.look().then(
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
    );
  });
}
