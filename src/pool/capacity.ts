/**
 * What the pool can still honour. A sparse image promises its whole size but occupies only what was
 * written; what it may still claim (size - allocated) is its promise. The pool may promise R times its
 * free space (--overcommit-ratio R; R = 1 never promises space that is not there):
 *
 *   promised <= R * free
 *
 * so a new sparse volume of size S fits while S <= R * free - promised, and a preallocated one (which
 * takes S from free at once and promises nothing) while S <= free - promised / R. GetCapacity reports
 * the first for sparse requests and the second for allocation=preallocate.
 *
 * Copies: a byte copy (a snapshot on a pool that cannot reflink) takes its blocks at once, so it is
 * admitted like a preallocated volume of the source's allocated bytes; statfs shows them after. A
 * reflink takes none, but a volume's block that another image shares must be copied when the volume
 * rewrites it (snapshots never write). So on a pool that reflinks, each volume also promises its shared
 * blocks: `volumes/<id>/shared.json` records how many at most (its allocated bytes when it was last
 * copied, or made as a copy), and a snapshot or clone is admitted for what it adds to that. The record
 * only grows: blocks that stop being shared (rewritten, or their snapshot deleted) stay counted, never
 * more than the pool can honour.
 *
 * Summing over every image is O(volumes), so the sum is cached for a few seconds and this
 * process's own creates, deletes and expansions adjust it in between; the free space is read fresh
 * each time.
 */
import fs from 'node:fs/promises';
import { noSpace } from '../errors.js';
import { mapLimit } from '../limit.js';
import { listDir, readRecord, writeFileAtomic } from './fsutil.js';
import { isVolumeId } from './ids.js';
import type { PoolLayout } from './layout.js';
import type { Pool } from './pool.js';

export const SCAN_TTL_MS = 5_000;

/** A shared.json record: its byte count. */
const parseShared = (v: unknown): number | undefined =>
  typeof v === 'object' && v !== null && typeof (v as { bytes?: unknown }).bytes === 'number'
    ? (v as { bytes: number }).bytes
    : undefined;
const SCAN_BATCH = 128;

export interface CapacityReport {
  totalBytes: number;
  freeBytes: number;
  promisedBytes: number;
  /** The largest sparse volume that fits now. */
  availableBytes: number;
  /** The largest preallocated volume that fits now. */
  availablePreallocatedBytes: number;
}

export type Reservation = 'sparse' | 'preallocate';

/** A cached sum of promises; `terms`: each volume's share of it when it was read. */
interface Scan {
  promised: number;
  startedAt: number;
  terms: Map<string, number>;
}

/** What a volume's image still promises: its unwritten size. */
const volumePromise = (size: number, allocated: number): number => Math.max(0, size - allocated);

export class Capacity {
  private scan: Scan | undefined;
  private scanning: Promise<Scan> | undefined;
  /** Changes this process made, with when, so a scan that predates them does not lose them. */
  private adjustments: { at: number; bytes: number; id: string | undefined }[] = [];
  /** Reservations for volumes being made: promises (sparse) and blocks about to be taken (preallocated). */
  private pendingPromise = 0;
  private pendingBlocks = 0;
  /** Volumes' shared bytes as last read from their records, with the version of the record read. */
  private readonly shared = new Map<string, { bytes: number; version: string }>();

  /**
   * `sharesBlocks` says whether the pool's copies share blocks with their source (it reflinks); without
   * it, as for a pool that does not, snapshots promise nothing.
   */
  constructor(
    private readonly layout: PoolLayout,
    private readonly ratio: number,
    private readonly sharesBlocks: () => Promise<boolean> = () => Promise.resolve(false),
  ) {}

  /** The capacity of `pool`, which knows whether its copies share blocks. */
  static of(pool: Pool, ratio: number): Capacity {
    return new Capacity(pool.layout, ratio, () => pool.fs.canReflink());
  }

  /** Whether snapshots share their blocks; when the pool cannot tell, they count as sharing. */
  private shares(): Promise<boolean> {
    return this.sharesBlocks().catch(() => true);
  }

  private async scanPromises(): Promise<Scan> {
    const startedAt = Date.now();
    const shares = await this.shares();
    const ids = (await listDir(this.layout.volumesDir)).filter(isVolumeId);
    const terms = new Map<string, number>();
    await mapLimit(ids, SCAN_BATCH, async (id) => {
      const term = await this.termOf(id, shares);
      if (term !== undefined) terms.set(id, term);
    });
    return { promised: sum(terms.values()), startedAt, terms };
  }

  /** What volume `id` promises now; undefined when it has no image. */
  private async termOf(id: string, shares: boolean): Promise<number | undefined> {
    const v = await this.readVolume(id, shares);
    return v && v.unwritten + v.shared;
  }

  /**
   * Volume `id` as its image and its record of shared blocks show it now: its unwritten bytes, its
   * allocated bytes (at most its size: XFS may show more), and how many of those count as shared (none
   * on a pool that does not reflink). Undefined when it has no image.
   */
  private async readVolume(
    id: string,
    shares: boolean,
  ): Promise<{ unwritten: number; allocated: number; shared: number } | undefined> {
    const st = await fs.stat(this.layout.volumeImage(id)).catch(() => undefined);
    if (!st) return undefined;
    const allocated = Math.min(st.size, st.blocks * 512);
    const shared = shares ? Math.min(allocated, await this.sharedOf(id, allocated)) : 0;
    return { unwritten: volumePromise(st.size, st.blocks * 512), allocated, shared };
  }

  /**
   * Volume `id`'s shared bytes as its record says. A volume without one (made before records were kept;
   * recordSharing() writes them) or whose record cannot be read counts as sharing all of `allocated`.
   * The record is read again only when it changed (every write is a rename: a new inode): each scan
   * looks at it with one stat, and sees another controller's marks.
   */
  private async sharedOf(id: string, allocated: number): Promise<number> {
    const file = this.layout.volumeShared(id);
    const st = await fs.stat(file).catch(() => undefined);
    if (!st) return allocated;
    const version = `${st.ino}:${st.mtimeMs}:${st.size}`;
    const cached = this.shared.get(id);
    if (cached?.version === version) return cached.bytes;
    const bytes = (await this.readShared(id)) ?? allocated;
    this.shared.set(id, { bytes, version });
    return bytes;
  }

  /** Volume `id`'s record of shared bytes; undefined when it is missing or cannot be read. */
  private async readShared(id: string): Promise<number | undefined> {
    const r = await readRecord(this.layout.volumeShared(id), parseShared).catch(() => undefined);
    return r?.state === 'ok' ? r.value : undefined;
  }

  /** Whether volume `id` has a record of its shared blocks (false also when it cannot be read). */
  async hasSharedRecord(id: string): Promise<boolean> {
    return (await this.readShared(id)) !== undefined;
  }

  /**
   * Records that at least `bytes` of volume `id` may be shared with another image (a reflink was just
   * made of it, or it was made as one; 0 for a new volume that shares nothing), on a pool that reflinks.
   * The caller holds the volume's lock. Counted at once when its image is there (a volume being made
   * counts it when its reservation settles). True when the pool keeps such records.
   */
  async markShared(id: string, bytes: number): Promise<boolean> {
    if (!(await this.shares())) return false;
    const file = this.layout.volumeShared(id);
    const r = await readRecord(file, parseShared).catch(() => undefined);
    if (r?.state === 'ok' && r.value >= bytes) return true;
    // A first record need not be synced: lost or torn by a crash, it counts as all shared (sharedOf). One
    // that replaces a smaller record must be: a crash must not bring the smaller one back.
    const replaces = r !== undefined && r.state !== 'absent';
    await writeFileAtomic(file, `${JSON.stringify({ bytes, at: new Date().toISOString() })}\n`, replaces);
    const term = await this.termOf(id, true);
    if (this.scan && term !== undefined) this.recount(this.scan, id, term);
    return true;
  }

  /** The cached sum, read again when older than SCAN_TTL_MS (with `anyAge`, only when there is none). */
  private async scanned(anyAge = false): Promise<Scan> {
    let scan = this.scan;
    if (!scan || (!anyAge && Date.now() - scan.startedAt > SCAN_TTL_MS)) {
      this.scanning ??= this.scanPromises().finally(() => {
        this.scanning = undefined;
      });
      const result = await this.scanning;
      if (!this.scan || result.startedAt >= this.scan.startedAt) {
        this.scan = result;
        this.adjustments = this.adjustments.filter((a) => a.at >= result.startedAt);
      }
      scan = this.scan;
    }
    return scan;
  }

  /**
   * Reads volume `id`'s image again, and replaces what the cached scan says it promises with what it
   * promises now: a pod may have written it since, which took free space and lowered its promise.
   * Returns its allocated bytes (at most its size), and how many of them count as shared already.
   */
  private async refreshVolume(id: string): Promise<{ allocated: number; shared: number }> {
    await this.scanned(true); // under a freeze: the pool is not read again
    const v = await this.readVolume(id, await this.shares());
    // Into the sum as it is now: another scan may have landed meanwhile.
    if (this.scan) this.recount(this.scan, id, v ? v.unwritten + v.shared : 0);
    return { allocated: v?.allocated ?? 0, shared: v?.shared ?? 0 };
  }

  /** Counts `term` for volume `id` in place of whatever was counted for it (its scan term, its adjustments). */
  private recount(scan: Scan, id: string, term: number): void {
    this.adjustments = this.adjustments.filter((a) => a.id !== id);
    if (scan.terms.has(id)) {
      scan.promised += term - (scan.terms.get(id) ?? 0);
      scan.terms.set(id, term);
    } else if (term !== 0) {
      this.adjustments.push({ at: Date.now(), bytes: term, id });
    }
  }

  /** Volume `id` is gone: nothing is counted for it any more. */
  volumeGone(id: string): void {
    if (this.scan) this.recount(this.scan, id, 0);
    this.shared.delete(id);
  }

  /**
   * Reads the filesystem, then computes synchronously so concurrent reservations see each other.
   * `ownPromise`: a volume's own promise, left out of what preallocated room must keep for the others.
   */
  private async measure(anyAge = false): Promise<(ownPromise?: number) => CapacityReport> {
    const st = await fs.statfs(this.layout.root);
    const scanned = (await this.scanned(anyAge)).promised;
    return (ownPromise = 0) => {
      const totalBytes = st.blocks * st.bsize;
      const freeBytes = st.bavail * st.bsize;
      const free = freeBytes - this.pendingBlocks;
      const promisedBytes = Math.max(
        0,
        scanned + this.adjustments.reduce((sum, a) => sum + a.bytes, 0) + this.pendingPromise,
      );
      const availableBytes = Math.max(0, Math.floor(this.ratio * free - promisedBytes));
      const others = Math.max(0, promisedBytes - ownPromise);
      const availablePreallocatedBytes = Math.max(0, Math.floor(free - others / this.ratio));
      return { totalBytes, freeBytes, promisedBytes, availableBytes, availablePreallocatedBytes };
    };
  }

  async report(): Promise<CapacityReport> {
    return (await this.measure())();
  }

  /**
   * Reserves `bytes` for volume `id` about to be made (or grown), or throws RESOURCE_EXHAUSTED. The
   * returned function settles the reservation: `promisedAfter` is what the change adds to the volume's
   * promise (its unwritten size), or undefined when it was not made. `anyAge`: under a freeze, the
   * cached count is used however old (the caller read it before freezing). `promised`: what of the
   * count is the volume's own promise, which the blocks reserved replace (a sparse volume preallocated).
   */
  async reserve(
    bytes: number,
    kind: Reservation,
    what: string,
    { id, anyAge = false, promised = 0 }: { id?: string; anyAge?: boolean; promised?: number } = {},
  ): Promise<(promisedAfter: number | undefined) => void> {
    const report = (await this.measure(anyAge))(promised);
    const room = kind === 'sparse' ? report.availableBytes : report.availablePreallocatedBytes;
    if (bytes > room) {
      throw noSpace(
        `The pool has room for ${formatBytes(room)}${kind === 'preallocate' ? ' preallocated' : ''}, not enough for ${what} of ${formatBytes(bytes)}.`,
      );
    }
    if (kind === 'sparse') this.pendingPromise += bytes;
    else this.pendingBlocks += bytes;
    let settled = false;
    return (promisedAfter) => {
      if (settled) return;
      settled = true;
      if (kind === 'sparse') this.pendingPromise -= bytes;
      else this.pendingBlocks -= bytes;
      if (promisedAfter !== undefined && promisedAfter !== 0) this.adjust(promisedAfter, id);
    };
  }

  /**
   * Reserves room for a reflink of volume `sourceVolumeId` as it is now (the caller holds its lock and
   * its freeze, and read the count before freezing): what its shared blocks grow by, which the copy then
   * marks (markShared); nothing on a pool that cannot reflink. Throws RESOURCE_EXHAUSTED when that does
   * not fit. Either way the volume's count is read again first, so what a pod wrote since the last scan
   * is not counted twice. The returned function settles the reservation.
   */
  async reserveSharing(sourceVolumeId: string, what: string): Promise<() => void> {
    const shares = await this.shares();
    const { allocated, shared } = await this.refreshVolume(sourceVolumeId);
    if (!shares) return () => undefined;
    const settle = await this.reserve(Math.max(0, allocated - shared), 'sparse', what, { anyAge: true });
    return () => {
      settle(undefined);
    };
  }

  /** Reserves `bytes` of blocks a byte copy is about to take (under a freeze), or throws RESOURCE_EXHAUSTED. */
  async reserveBlocks(bytes: number, what: string): Promise<() => void> {
    const settle = await this.reserve(bytes, 'preallocate', what, { anyAge: true });
    return () => {
      settle(undefined);
    };
  }

  /** Records a change in promised bytes made by this process, to volume `id` when it says. */
  private adjust(bytes: number, id?: string): void {
    this.adjustments.push({ at: Date.now(), bytes, id });
  }
}

const sum = (xs: Iterable<number>): number => {
  let total = 0;
  for (const x of xs) total += x;
  return total;
};

/** `n` bytes in the largest binary unit that keeps the number at 1 or more: { value: 1.5, unit: 'GiB' }. */
export function binaryScale(n: number): { value: number; unit: string } {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return { value: v, unit: units[i] ?? 'B' };
}

export function formatBytes(n: number): string {
  const { value, unit } = binaryScale(n);
  return `${Number.isInteger(value) ? value : value.toFixed(1)} ${unit}`;
}
