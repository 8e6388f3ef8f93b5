/**
 * Volumes in the pool: what CreateVolume does on a crash, and what DeleteVolume leaves behind. How
 * attachments and node leases fence a volume is in fences.ts (this class extends that one).
 *
 * Create: the directory volumes/<id> (id derived from the name) is the reservation. Its meta.json says
 * "creating" until the image is complete and renamed into place, then "ready". A retry that finds a
 * "creating" volume (a crash at any point) discards it and starts over, because nothing was ever
 * returned for it; a retry that finds a "ready" one returns it. So a name never yields two volumes, and
 * a half-written image is never handed out.
 *
 * Delete: one rename moves the directory into the trash (the volume is gone at that instant, for every
 * process), then the files are removed. A crash in between leaves only trash, swept at the next start.
 */
import fs, { type FileHandle } from 'node:fs/promises';
import type { Logger } from 'pino';
import { failpoint } from '../failpoints.js';
import { conflict, DomainError, errnoCode, missing } from '../errors.js';
import type { Capacity } from './capacity.js';
import {
  createExclusive,
  exists,
  fsyncDir,
  isRecord,
  listDir,
  readRecord,
  type RecordRead,
  writeFileAtomic,
} from './fsutil.js';
import { VolumeFences } from './fences.js';
import { isVolumeId } from './ids.js';
import { allocatedBytes, openImage } from './images.js';
import type { NodeRegistry } from './nodes.js';
import type { HeldLock } from './lock.js';
import { damagedRecord, type Pool } from './pool.js';
import {
  type FsType,
  isFsType,
  isSectorSize,
  type Lease,
  parseVolumeMeta,
  type VolumeMeta,
} from './types.js';

const LIST_BATCH = 256;
/** An `initialized` marker is a few dozen bytes; what is read of one at most. */
const MARKER_MAX = 4096;

const json = (v: unknown): string => `${JSON.stringify(v, null, 2)}\n`;

export interface FillResult {
  /** The image holds a filesystem or raw data already (a clone or a restore). */
  initialized: boolean;
  /** It was made by reflink: how many of its bytes it shares with its source (capacity.ts). */
  sharedBytes?: number;
  /** The sector size its source's data was written on, when recorded. */
  sectorSize?: number;
}

/** What a volume's `initialized` marker records. */
export interface Initialization {
  /**
   * The logical sector size of the device its data was first written on; absent in markers of older
   * releases (and unreadable ones). A raw block volume is always attached with it (loop.ts).
   */
  sectorSize?: number;
}

export class VolumeStore extends VolumeFences {
  constructor(
    pool: Pool,
    private readonly capacity: Capacity,
    nodes: NodeRegistry,
    log: Logger,
  ) {
    super(pool, nodes, log);
  }

  imagePath(id: string): string {
    return this.layout.volumeImage(id);
  }

  /** The volume's record as it is on disk: absent, sound, or damaged. */
  inspect(id: string): Promise<RecordRead<VolumeMeta>> {
    if (!isVolumeId(id)) return Promise.resolve({ state: 'absent' });
    return readRecord(this.layout.volumeMeta(id), parseVolumeMeta);
  }

  /**
   * The volume's record in whatever state it is; undefined when there is none (or the id is not ours).
   * A record that cannot be read is an error, never "absent": it may stand for data.
   */
  async read(id: string): Promise<VolumeMeta | undefined> {
    const r = await this.inspect(id);
    if (r.state === 'damaged') throw damagedRecord(`volume ${id}`, r.reason);
    if (r.state === 'absent') await this.pool.assertPresent(); // absent, or the pool is not mounted?
    return r.state === 'ok' ? r.value : undefined;
  }

  /** A volume that exists and is complete. */
  async get(id: string): Promise<VolumeMeta | undefined> {
    const meta = await this.read(id);
    return meta?.state === 'ready' ? meta : undefined;
  }

  async mustGet(id: string): Promise<VolumeMeta> {
    const meta = await this.get(id);
    if (!meta) throw missing(`Volume ${id} does not exist.`);
    return meta;
  }

  private async writeMeta(meta: VolumeMeta, durable = true): Promise<void> {
    await writeFileAtomic(this.layout.volumeMeta(meta.id), json(meta), durable);
  }

  /**
   * Creates the volume `meta` describes, or returns the one already made under its name. `fill` writes
   * the image at the path it is given. The caller holds the volume's in-flight key.
   */
  async create(
    meta: VolumeMeta,
    fill: (imagePath: string, lock: HeldLock) => Promise<FillResult>,
  ): Promise<{ volume: VolumeMeta; created: boolean }> {
    const { id } = meta;
    return this.pool.withLock(id, 'CreateVolume', async (lock) => {
      const record = await this.inspect(id);
      if (record.state === 'ok' && record.value.state === 'ready')
        return { volume: record.value, created: false };
      const dir = this.layout.volumeDir(id);
      await this.pool.clearLeftover(`volume ${id}`, dir, record, this.layout.volumeImage(id), lock);
      await this.pool.refuseQuarantined(`volume ${id}`, id);
      await this.pool.assertPresent();
      // A preallocated volume takes its blocks now, whatever fills it (a clone or a restore too): it is
      // admitted against the free space, never against the overcommitted budget.
      const settle = await this.capacity.reserve(
        meta.capacityBytes,
        meta.allocation === 'preallocate' ? 'preallocate' : 'sparse',
        `volume ${meta.name}`,
        { id },
      );
      let promisedAfter: number | undefined;
      try {
        // Nothing before the final "ready" record needs to survive a power cut: a retry finds either
        // no directory or an unfinished one, and starts over. So only that record (and the image and
        // the directory entry it stands for) is synced.
        await fs.mkdir(dir, { mode: 0o750 });
        failpoint('create-volume:dir');
        await this.writeMeta({ ...meta, state: 'creating' }, false);
        failpoint('create-volume:meta-creating');
        const partial = this.layout.volumeImageTemp(id);
        const { initialized, sharedBytes, sectorSize } = await fill(partial, lock);
        failpoint('create-volume:image-written');
        // Its record of shared blocks (on a pool that reflinks) exists before its image appears.
        lock.assertHeld();
        const recorded = await this.capacity.markShared(id, sharedBytes ?? 0);
        lock.assertHeld(); // the image's name is the new holder's once the lock is lost
        await fs.rename(partial, this.layout.volumeImage(id));
        failpoint('create-volume:image-renamed');
        if (initialized) await this.markInitialized(id, 'controller (content source)', sectorSize);
        lock.assertHeld();
        const ready: VolumeMeta = { ...meta, state: 'ready', updatedAt: new Date().toISOString() };
        await this.writeMeta(ready); // its directory sync also makes the image's rename durable
        await fsyncDir(this.layout.volumesDir);
        failpoint('create-volume:ready');
        const unwritten = Math.max(
          0,
          meta.capacityBytes - (await allocatedBytes(this.layout.volumeImage(id))),
        );
        promisedAfter = unwritten + (recorded ? (sharedBytes ?? 0) : 0);
        return { volume: ready, created: true };
      } catch (err) {
        // With the lock lost, another process may own this volume now (and have finished it): what is
        // left is that process's, or the next holder's, to clear.
        if (lock.signal.aborted) throw err;
        await this.pool.discard(dir, lock).catch((cleanupErr: unknown) => {
          this.log.error({ volumeId: id, err: cleanupErr }, 'could not remove a failed volume creation');
        });
        throw err;
      } finally {
        settle(promisedAfter);
      }
    });
  }

  /**
   * Deletes a volume; absent is success. Refused while any node has it published or staged, or while
   * `inUseHere` (a look at this host) says its image is attached. A volume whose record cannot be read
   * is quarantined, not deleted.
   */
  async delete(id: string, inUseHere?: (image: string) => Promise<string | undefined>): Promise<void> {
    if (!isVolumeId(id)) return;
    await this.pool.withLock(id, 'DeleteVolume', async (lock) => {
      const dir = this.layout.volumeDir(id);
      if (!(await exists(dir))) {
        await this.pool.assertPresent(); // gone, or is the pool itself not mounted?
        return;
      }
      const record = await this.inspect(id);
      if (record.state !== 'ok') {
        // An unfinished creation goes; anything that may hold data is quarantined.
        await this.pool.clearLeftover(`volume ${id}`, dir, record, this.layout.volumeImage(id), lock);
        return;
      }
      const attachments = await this.attachments(id);
      if (attachments.length > 0) {
        throw conflict(
          `Volume ${id} is still published to node ${attachments.map((a) => a.node).join(', ')}; unpublish it first.`,
        );
      }
      const leases: Lease[] = [];
      for (const l of await this.leases(id)) {
        if (!(l.revokedAt !== undefined && (await this.released(l)))) leases.push(l);
      }
      if (leases.length > 0) {
        throw conflict(
          `Volume ${id} is still staged on node ${leases.map((l) => l.node).join(', ')}; unstage it first.`,
        );
      }
      const here = await inUseHere?.(this.layout.volumeImage(id));
      if (here !== undefined) {
        throw conflict(`Volume ${id} is still in use on this host (${here}); it was not deleted.`);
      }
      await this.pool.discard(dir, lock); // still held after those looks: nobody staged it meanwhile
      this.capacity.volumeGone(id);
    });
  }

  /** One page of complete volumes in id order, starting after `after`. max 0 means all. */
  async list(
    after: string | undefined,
    max: number,
  ): Promise<{ volumes: VolumeMeta[]; next: string | undefined }> {
    await this.pool.assertPresent();
    const ids = (await listDir(this.layout.volumesDir)).filter(isVolumeId).sort();
    let i = after === undefined ? 0 : ids.findIndex((id) => id > after);
    if (i < 0) i = ids.length;
    const limit = max > 0 ? max : Number.POSITIVE_INFINITY;
    const volumes: VolumeMeta[] = [];
    while (volumes.length < limit && i < ids.length) {
      const want = Math.min(LIST_BATCH, limit - volumes.length);
      const batch = ids.slice(i, i + want);
      i += batch.length;
      for (const r of await Promise.all(batch.map((id) => this.inspect(id)))) {
        if (r.state === 'ok' && r.value.state === 'ready') volumes.push(r.value);
      }
    }
    const last = volumes.at(-1);
    return { volumes, next: i < ids.length && last ? last.id : undefined };
  }

  /**
   * Whether the volume was ever formatted or written raw; never "no" for a pool that is not there.
   * Anything in the marker's place says "initialized" (as `initialization` reads it too): one lstat,
   * on the path of every filesystem stage.
   */
  async isInitialized(id: string): Promise<boolean> {
    if (await exists(this.layout.volumeInitialized(id))) return true;
    await this.pool.assertPresent();
    return false;
  }

  /**
   * What the volume's marker records; undefined when it was never initialized (never for a pool that
   * is not there). Anything in the marker's place says "initialized" (as before there were sizes to
   * record): one that is not a small regular file, or not readable, records no sector size.
   */
  async initialization(id: string): Promise<Initialization | undefined> {
    let h: FileHandle;
    try {
      // As an image is opened: never through a symlink, never blocking on a FIFO planted there.
      h = await openImage(this.layout.volumeInitialized(id));
    } catch (err) {
      if (err instanceof DomainError && err.kind === 'unsafe') return {}; // not a regular file
      if (errnoCode(err) !== 'ENOENT' && errnoCode(err) !== 'ENOTDIR') throw err;
      await this.pool.assertPresent();
      return undefined;
    }
    try {
      const buf = Buffer.alloc(MARKER_MAX);
      const { bytesRead } = await h.read(buf, 0, MARKER_MAX, 0);
      const v = JSON.parse(buf.toString('utf8', 0, bytesRead)) as unknown;
      return isRecord(v) && isSectorSize(v.sectorSize) ? { sectorSize: v.sectorSize } : {};
    } catch (err) {
      if (err instanceof SyntaxError) return {}; // damaged, or larger than a marker is
      throw err;
    } finally {
      await h.close();
    }
  }

  /** At least `bytes` of volume `id` may now be shared with a reflink of it; the caller holds its lock. */
  markShared(id: string, bytes: number): Promise<boolean> {
    return this.capacity.markShared(id, bytes);
  }

  /**
   * Records that the volume holds a filesystem or data, so it is never formatted again, and the sector
   * size that data was written on. False when it was recorded already.
   */
  async markInitialized(id: string, by: string, sectorSize?: number): Promise<boolean> {
    const at = new Date().toISOString();
    return createExclusive(
      this.layout.volumeInitialized(id),
      json({ by, at, ...(sectorSize ? { sectorSize } : {}) }),
    );
  }

  /**
   * Records, durably and before mkfs runs, that a filesystem of `fsType` is being made on the volume:
   * mkfs stopped half-way (the driver killed, its container replaced) can leave a signature blkid
   * recognises (an XFS superblock still marked in progress). Until the volume is marked initialized,
   * a filesystem of that type found on it is that unfinished one, never mounted, and made again.
   */
  async markFormatting(id: string, by: string, fsType: FsType): Promise<void> {
    await writeFileAtomic(
      this.layout.volumeFormatting(id),
      json({ by, at: new Date().toISOString(), fsType }),
    );
  }

  /** The filesystem a mkfs that began on the volume was making (markFormatting), if one began. */
  async formatting(id: string): Promise<FsType | undefined> {
    const r = await readRecord(this.layout.volumeFormatting(id), (v) =>
      isRecord(v) && isFsType(v.fsType) ? v.fsType : undefined,
    );
    return r.state === 'ok' ? r.value : undefined;
  }

  /**
   * Runs `fn` holding the volume's format lock, which every node takes to decide whether to format it
   * and to format it: two nodes staging a fresh volume at once never both run mkfs. mkfs takes time,
   * so the lock is waited for longer than the short-step locks.
   */
  withFormatLock<T>(id: string, waitMs: number, fn: (lock: HeldLock) => Promise<T>): Promise<T> {
    return this.pool.withLock(`${id}.format`, 'format decision', fn, waitMs);
  }

  /**
   * Runs `fn` on the current record under the volume's lock and stores what it returns, unless the
   * lock was lost meanwhile (another process's record is newer).
   */
  async update(
    id: string,
    purpose: string,
    fn: (meta: VolumeMeta, lock: HeldLock) => Promise<VolumeMeta | undefined>,
  ): Promise<VolumeMeta> {
    return this.pool.withLock(id, purpose, async (lock) => {
      const meta = await this.mustGet(id);
      const next = await fn(meta, lock);
      if (!next) return meta;
      lock.assertHeld();
      const stored = { ...next, updatedAt: new Date().toISOString() };
      await this.writeMeta(stored);
      return stored;
    });
  }
}
