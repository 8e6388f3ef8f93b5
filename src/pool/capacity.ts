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
 * Snapshots: a byte copy takes its blocks at once (admitted like a preallocated volume; statfs shows
 * them after). A reflink takes none, but every block it shares may have to be copied when its source
 * is rewritten: on a pool that reflinks, a snapshot promises its allocated bytes for as long as it
 * lives (counted in full even once its source has moved on: never more than the pool can honour).
 *
 * Summing over every image is O(volumes + snapshots), so the sum is cached for a few seconds and this
 * process's own creates, deletes and expansions adjust it in between; the free space is read fresh
 * each time.
 */
import fs from 'node:fs/promises';
import { noSpace } from '../errors.js';
import { listDir } from './fsutil.js';
import { isSnapshotId, isVolumeId } from './ids.js';
import type { PoolLayout } from './layout.js';
import type { Pool } from './pool.js';

const SCAN_TTL_MS = 5_000;
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

export class Capacity {
  private scan: { promised: number; startedAt: number } | undefined;
  private scanning: Promise<{ promised: number; startedAt: number }> | undefined;
  /** Changes this process made, with when, so a scan that predates them does not lose them. */
  private adjustments: { at: number; bytes: number }[] = [];
  /** Reservations for volumes being made: promises (sparse) and blocks about to be taken (preallocated). */
  private pendingPromise = 0;
  private pendingBlocks = 0;

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

  private async scanPromises(): Promise<{ promised: number; startedAt: number }> {
    const startedAt = Date.now();
    const volumes = (await listDir(this.layout.volumesDir)).filter(isVolumeId);
    let promised = await sumOver(volumes, this.layout.volumeImage.bind(this.layout), (size, allocated) =>
      Math.max(0, size - allocated),
    );
    if (await this.shares()) {
      const snapshots = (await listDir(this.layout.snapshotsDir)).filter(isSnapshotId);
      promised += await sumOver(
        snapshots,
        this.layout.snapshotImage.bind(this.layout),
        (_, allocated) => allocated,
      );
    }
    return { promised, startedAt };
  }

  private async scanned(): Promise<number> {
    let scan = this.scan;
    if (!scan || Date.now() - scan.startedAt > SCAN_TTL_MS) {
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
    return scan.promised;
  }

  /** Reads the filesystem, then computes synchronously so concurrent reservations see each other. */
  private async measure(): Promise<() => CapacityReport> {
    const st = await fs.statfs(this.layout.root);
    const scanned = await this.scanned();
    return () => {
      const totalBytes = st.blocks * st.bsize;
      const freeBytes = st.bavail * st.bsize;
      const free = freeBytes - this.pendingBlocks;
      const promisedBytes = Math.max(
        0,
        scanned + this.adjustments.reduce((sum, a) => sum + a.bytes, 0) + this.pendingPromise,
      );
      const availableBytes = Math.max(0, Math.floor(this.ratio * free - promisedBytes));
      const availablePreallocatedBytes = Math.max(0, Math.floor(free - promisedBytes / this.ratio));
      return { totalBytes, freeBytes, promisedBytes, availableBytes, availablePreallocatedBytes };
    };
  }

  async report(): Promise<CapacityReport> {
    return (await this.measure())();
  }

  /**
   * Reserves `bytes` for a volume about to be made, or throws RESOURCE_EXHAUSTED. The returned function
   * settles the reservation: `promisedAfter` is what the finished volume still promises (its unwritten
   * size), or undefined when it was not made.
   */
  async reserve(
    bytes: number,
    kind: Reservation,
    what: string,
  ): Promise<(promisedAfter: number | undefined) => void> {
    const report = (await this.measure())();
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
      if (promisedAfter !== undefined && promisedAfter !== 0) this.adjust(promisedAfter);
    };
  }

  /**
   * Reserves room for a snapshot of an image with `allocatedBytes` allocated, or throws
   * RESOURCE_EXHAUSTED: blocks taken now where it is a byte copy, a promise where it is a reflink. The
   * returned function settles it with the finished snapshot image's allocated bytes, or undefined when
   * it was not made.
   */
  async reserveSnapshot(
    allocatedBytes: number,
    what: string,
  ): Promise<(allocatedAfter: number | undefined) => void> {
    const shares = await this.shares();
    const settle = await this.reserve(allocatedBytes, shares ? 'sparse' : 'preallocate', what);
    return (allocatedAfter) => {
      settle(shares ? allocatedAfter : undefined);
    };
  }

  /** A snapshot image with `allocatedBytes` allocated went away. */
  async snapshotGone(allocatedBytes: number): Promise<void> {
    if (await this.shares()) this.adjust(-allocatedBytes);
  }

  /** Records a change in promised bytes made by this process (negative when a volume goes away). */
  adjust(bytes: number): void {
    this.adjustments.push({ at: Date.now(), bytes });
  }
}

/** The sum of `count(size, allocated)` over the images of `ids` (those that exist), read in batches. */
async function sumOver(
  ids: readonly string[],
  image: (id: string) => string,
  count: (size: number, allocated: number) => number,
): Promise<number> {
  let sum = 0;
  for (let i = 0; i < ids.length; i += SCAN_BATCH) {
    const stats = await Promise.all(
      ids.slice(i, i + SCAN_BATCH).map((id) => fs.stat(image(id)).catch(() => undefined)),
    );
    for (const st of stats) if (st) sum += count(st.size, st.blocks * 512);
  }
  return sum;
}

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
