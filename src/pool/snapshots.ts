/**
 * Snapshots and volume group snapshots: point-in-time copies of volume images, independent of their
 * source (deleting the volume leaves them usable). Crash-safe like volumes: a directory named by the
 * id derived from the CO's name, meta.json "creating" until the copy is complete and durable, then
 * "ready"; a retry discards a "creating" leftover and copies again.
 */
import fs from 'node:fs/promises';
import type { Logger } from 'pino';
import { busy, invalid, missing } from '../errors.js';
import { failpoint } from '../failpoints.js';
import { exists, fsyncDir, listDir, readRecord, type RecordRead, writeFileAtomic } from './fsutil.js';
import { isGroupSnapshotId, isSnapshotId } from './ids.js';
import type { HeldLock } from './lock.js';
import { damagedRecord, type Pool } from './pool.js';
import {
  type GroupSnapshotMeta,
  parseGroupSnapshotMeta,
  parseSnapshotMeta,
  type SnapshotMeta,
} from './types.js';

/** What a snapshot's copy found: the instant it stands for, and its source as it was then. */
export interface CopiedSource {
  takenAt: Date;
  sizeBytes: number;
  fsType: SnapshotMeta['fsType'];
  initialized: boolean;
  sectorSize?: number;
}

const json = (v: unknown): string => `${JSON.stringify(v, null, 2)}\n`;
const LIST_BATCH = 256;

export class SnapshotStore {
  constructor(
    private readonly pool: Pool,
    private readonly log: Logger,
  ) {}

  private get layout() {
    return this.pool.layout;
  }

  imagePath(id: string): string {
    return this.layout.snapshotImage(id);
  }

  inspect(id: string): Promise<RecordRead<SnapshotMeta>> {
    if (!isSnapshotId(id)) return Promise.resolve({ state: 'absent' });
    return readRecord(this.layout.snapshotMeta(id), parseSnapshotMeta);
  }

  /** The snapshot's record in whatever state; an unreadable one is an error, never "absent". */
  async read(id: string): Promise<SnapshotMeta | undefined> {
    const r = await this.inspect(id);
    if (r.state === 'damaged') throw damagedRecord(`snapshot ${id}`, r.reason);
    if (r.state === 'absent') await this.pool.assertPresent(); // absent, or the pool is not mounted?
    return r.state === 'ok' ? r.value : undefined;
  }

  async get(id: string): Promise<SnapshotMeta | undefined> {
    const meta = await this.read(id);
    return meta && (await this.complete(meta)) ? meta : undefined;
  }

  /**
   * Whether a snapshot is complete: ready, and for a group's member, its group not unfinished. Members
   * are marked ready one by one before their group; a crash between them leaves members of a group no
   * CO was told of, which must not be listed or restored as snapshots of their own. `groups` caches
   * the groups' states for one listing.
   */
  private async complete(meta: SnapshotMeta, groups = new Map<string, Promise<boolean>>()): Promise<boolean> {
    if (meta.state !== 'ready') return false;
    if (!meta.groupSnapshotId) return true;
    let unfinished = groups.get(meta.groupSnapshotId);
    if (!unfinished) {
      unfinished = this.inspectGroup(meta.groupSnapshotId).then(
        (r) => r.state === 'ok' && r.value.state !== 'ready',
      );
      groups.set(meta.groupSnapshotId, unfinished);
    }
    return !(await unfinished);
  }

  /**
   * Runs `fn` on a complete snapshot while holding it (DeleteSnapshot waits, then answers ABORTED),
   * so a restore never reads an image that is being deleted. NOT_FOUND when it does not exist.
   */
  async holding<T>(
    id: string,
    purpose: string,
    fn: (meta: SnapshotMeta, lock: HeldLock) => Promise<T>,
  ): Promise<T> {
    return this.pool.withLock(id, purpose, async (lock) => {
      const meta = await this.get(id);
      if (!meta) throw missing(`Snapshot ${id} does not exist.`);
      return fn(meta, lock);
    });
  }

  /**
   * Creates the snapshot `meta` describes, or returns the complete one already under its id. `copy`
   * writes the image at the path it is given and returns the instant it stands for, and what it found
   * of its source while holding it (its size, filesystem, and whether it was initialized), which the
   * record keeps in place of what `meta` guessed before.
   *
   * With `ready: false` the complete snapshot stays "creating" (never listed, never restored) until
   * `markReady`: a group snapshot's members wait until the group's copy is known to be good.
   */
  async create(
    meta: SnapshotMeta,
    copy: (imagePath: string, lock: HeldLock) => Promise<CopiedSource>,
    { ready: makeReady = true }: { ready?: boolean } = {},
  ): Promise<{ snapshot: SnapshotMeta; created: boolean }> {
    const { id } = meta;
    return this.pool.withLock(id, 'CreateSnapshot', async (lock) => {
      const record = await this.inspect(id);
      if (record.state === 'ok' && record.value.state === 'ready')
        return { snapshot: record.value, created: false };
      const dir = this.layout.snapshotDir(id);
      await this.pool.clearLeftover(`snapshot ${id}`, dir, record, this.layout.snapshotImage(id), lock);
      await this.pool.refuseQuarantined(`snapshot ${id}`, id);
      await this.pool.assertPresent();
      try {
        await fs.mkdir(dir, { mode: 0o750 });
        await fsyncDir(this.layout.snapshotsDir);
        await writeFileAtomic(this.layout.snapshotMeta(id), json({ ...meta, state: 'creating' }));
        const partial = this.layout.snapshotImageTemp(id);
        const { takenAt, sizeBytes, fsType, initialized, sectorSize } = await copy(partial, lock);
        failpoint('create-snapshot:image-written');
        lock.assertHeld();
        await fs.rename(partial, this.layout.snapshotImage(id));
        await fsyncDir(dir);
        const ready: SnapshotMeta = {
          ...meta,
          state: makeReady ? 'ready' : 'creating',
          sizeBytes,
          fsType,
          initialized,
          ...(sectorSize ? { sectorSize } : {}),
          createdAt: takenAt.toISOString(),
        };
        await writeFileAtomic(this.layout.snapshotMeta(id), json(ready));
        return { snapshot: ready, created: true };
      } catch (err) {
        // With the lock lost, another process may own this snapshot now (and have finished it): what is
        // left is that process's, or the next holder's, to clear.
        if (lock.signal.aborted) throw err;
        await this.pool.discard(dir, lock).catch((cleanupErr: unknown) => {
          this.log.error({ snapshotId: id, err: cleanupErr }, 'could not remove a failed snapshot');
        });
        throw err;
      }
    });
  }

  /** Makes a snapshot that `create` left complete but "creating" (`ready: false`) ready. */
  async markReady(made: SnapshotMeta): Promise<SnapshotMeta> {
    const { id } = made;
    return this.pool.withLock(id, 'CreateSnapshot', async () => {
      const record = await this.inspect(id);
      const now = record.state === 'ok' ? record.value : undefined;
      if (
        now?.state !== 'creating' ||
        now.createdAt !== made.createdAt ||
        !(await exists(this.layout.snapshotImage(id)))
      ) {
        throw busy(`Snapshot ${id} was changed by another call while it was being made; retry.`);
      }
      const ready: SnapshotMeta = { ...now, state: 'ready' };
      await writeFileAtomic(this.layout.snapshotMeta(id), json(ready));
      return ready;
    });
  }

  /**
   * Deletes a snapshot; absent is success. A member of a group snapshot goes only with its group
   * (INVALID_ARGUMENT, as the spec asks), unless `group` names that group (its delete, holding its
   * lock: nothing is removed once that lock is lost).
   */
  async delete(id: string, group?: { id: string; lock: HeldLock }): Promise<void> {
    if (!isSnapshotId(id)) return;
    const fromGroup = group?.id;
    await this.pool.withLock(id, 'DeleteSnapshot', async (own) => {
      const record = await this.inspect(id);
      if (record.state === 'absent') await this.pool.assertPresent(); // gone, or the pool not mounted?
      group?.lock.assertHeld(); // after the waits: another process may own the group by now
      if (record.state !== 'ok') {
        // An unfinished copy goes; a snapshot whose record cannot be read is quarantined.
        await this.pool.clearLeftover(
          `snapshot ${id}`,
          this.layout.snapshotDir(id),
          record,
          this.layout.snapshotImage(id),
          own,
          ...(group ? [group.lock] : []),
        );
        return;
      }
      const meta = record.value;
      // A group's delete takes only its own members: an id its record lists that is another
      // snapshot's (a record edited by hand) stays.
      if (fromGroup !== undefined && meta.groupSnapshotId !== fromGroup) {
        this.log.warn(
          { snapshotId: id, groupSnapshotId: fromGroup },
          "group snapshot's record lists a snapshot that is not its member; it was left alone",
        );
        return;
      }
      if (
        meta.groupSnapshotId &&
        meta.groupSnapshotId !== fromGroup &&
        (await this.readGroup(meta.groupSnapshotId))
      ) {
        throw invalid(
          `Snapshot ${id} is part of group snapshot ${meta.groupSnapshotId}; delete the group snapshot instead.`,
        );
      }
      await this.pool.discard(this.layout.snapshotDir(id), own, ...(group ? [group.lock] : []));
    });
  }

  /** Complete snapshots in id order after `after`, filtered; max 0 means all. */
  async list(
    after: string | undefined,
    max: number,
    filter: (s: SnapshotMeta) => boolean,
  ): Promise<{ snapshots: SnapshotMeta[]; next: string | undefined }> {
    await this.pool.assertPresent();
    const ids = (await listDir(this.layout.snapshotsDir)).filter(isSnapshotId).sort();
    let i = after === undefined ? 0 : ids.findIndex((id) => id > after);
    if (i < 0) i = ids.length;
    const limit = max > 0 ? max : Number.POSITIVE_INFINITY;
    const snapshots: SnapshotMeta[] = [];
    const groups = new Map<string, Promise<boolean>>();
    while (snapshots.length < limit && i < ids.length) {
      const batch = ids.slice(i, i + LIST_BATCH);
      let used = 0;
      for (const r of await Promise.all(batch.map((id) => this.inspect(id)))) {
        used++;
        const meta = r.state === 'ok' ? r.value : undefined;
        if (meta && filter(meta) && (await this.complete(meta, groups))) {
          snapshots.push(meta);
          if (snapshots.length >= limit) break;
        }
      }
      i += used;
    }
    const last = snapshots.at(-1);
    return { snapshots, next: i < ids.length && last ? last.id : undefined };
  }

  inspectGroup(id: string): Promise<RecordRead<GroupSnapshotMeta>> {
    if (!isGroupSnapshotId(id)) return Promise.resolve({ state: 'absent' });
    return readRecord(this.layout.groupMeta(id), parseGroupSnapshotMeta);
  }

  /** A group snapshot's record; an unreadable one is an error, never "absent". */
  async readGroup(id: string): Promise<GroupSnapshotMeta | undefined> {
    const r = await this.inspectGroup(id);
    if (r.state === 'damaged') throw damagedRecord(`group snapshot ${id}`, r.reason);
    return r.state === 'ok' ? r.value : undefined;
  }

  /**
   * Moves a group snapshot whose record cannot be read into quarantine (its members stay where they
   * are: without the record nobody can say which they are) and reports where it went.
   */
  async quarantineGroup(id: string, reason: string, lock: HeldLock): Promise<never> {
    const to = await this.pool.quarantine(this.layout.groupDir(id), reason, lock);
    throw damagedRecord(`group snapshot ${id}`, reason, to);
  }

  async refuseQuarantinedGroup(id: string): Promise<void> {
    await this.pool.refuseQuarantined(`group snapshot ${id}`, id);
  }

  /** Records a group snapshot (state "creating" while its members are copied, then "ready"). */
  async writeGroup(meta: GroupSnapshotMeta): Promise<void> {
    await fs.mkdir(this.layout.groupDir(meta.id), { recursive: true, mode: 0o750 });
    await writeFileAtomic(this.layout.groupMeta(meta.id), json(meta));
  }

  /**
   * Deletes a group snapshot and its members; absent is success. `lock` is the group's: each step
   * commits only while it is still held (lost, another process may own the group by now).
   */
  async deleteGroup(id: string, memberIds: readonly string[], lock: HeldLock): Promise<void> {
    if (!isGroupSnapshotId(id)) return;
    for (const member of memberIds) await this.delete(member, { id, lock });
    await this.pool.discard(this.layout.groupDir(id), lock);
  }
}
