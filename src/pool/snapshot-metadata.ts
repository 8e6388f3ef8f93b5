/**
 * Changed block tracking over snapshot images: which ranges of a snapshot hold data, and which changed
 * between two snapshots of one volume. A snapshot is pinned when a call begins (its image opened and
 * its record read again after), so a DeleteSnapshot meanwhile cannot change what the call reads: the
 * tools read the open file through /proc/<pid>/fd, and the contents are read from the same handle.
 *
 * The delta compares extent maps where the pool shares extents (reflink: snapshots are clones of one
 * image, an unchanged range is the same physical blocks in both) and contents elsewhere (see delta.ts).
 */
import type { FileHandle } from 'node:fs/promises';
import { CommandError, type Exec } from '../exec/runner.js';
import { contentDelta, extentDelta } from './delta.js';
import { coalesce, dataRanges, extentMap, type ImageRef, type Range, union } from './extents.js';
import { openImage } from './images.js';
import type { Pool } from './pool.js';
import type { SnapshotStore } from './snapshots.js';
import type { SnapshotMeta } from './types.js';

/** A snapshot whose image is open for the length of a call. */
export interface PinnedSnapshot {
  readonly meta: SnapshotMeta;
  readonly image: ImageRef;
  readonly handle: FileHandle;
  /** The volume's size when the snapshot was taken (the stream's volume_capacity_bytes). */
  readonly capacityBytes: number;
  close(): Promise<void>;
}

export type DeltaMethod = 'extents' | 'contents';

/** What a call did, for its log line and the bench. */
export interface MetadataStats {
  method?: DeltaMethod | 'seek';
  /** Image bytes read (0 when only extent maps were read). */
  bytesRead: number;
  /** Ranges found. */
  ranges: number;
}

/** The tool's words for "this filesystem has no FIEMAP" (NFS, tmpfs, FUSE...). */
const NO_FIEMAP = /Operation not supported|Inappropriate ioctl|Function not implemented|Invalid argument/i;

export class SnapshotMetadataReader {
  constructor(
    private readonly pool: Pool,
    private readonly snapshots: SnapshotStore,
  ) {}

  /** Opens snapshot `id` for reading; undefined when there is no complete snapshot of that id. */
  async pin(id: string): Promise<PinnedSnapshot | undefined> {
    const meta = await this.snapshots.get(id);
    if (!meta) return undefined;
    let handle: FileHandle;
    try {
      handle = await openImage(this.snapshots.imagePath(id)); // a regular file, through no symlink
    } catch (err) {
      if (err instanceof Error && 'code' in err && err.code === 'ENOENT') return undefined;
      throw err;
    }
    try {
      // The record again, now that the image is held: the same snapshot (not one deleted and made
      // again under the same name between the two reads).
      const again = await this.snapshots.get(id);
      if (!again || again.createdAt !== meta.createdAt) {
        await handle.close();
        return undefined;
      }
      const st = await handle.stat();
      const capacityBytes = meta.sizeBytes;
      return {
        meta,
        handle,
        capacityBytes,
        image: { path: `/proc/${process.pid}/fd/${handle.fd}`, size: Math.min(st.size, capacityBytes) },
        close: () => handle.close(),
      };
    } catch (err) {
      await handle.close();
      throw err;
    }
  }

  /** The data ranges of `snap` from `from` on: what was written, holes and unwritten blocks left out. */
  async *allocated(x: Exec, snap: PinnedSnapshot, from: number, stats: MetadataStats): AsyncGenerator<Range> {
    stats.method = 'seek';
    for await (const r of coalesce(dataRanges(x, snap.image, from))) {
      stats.ranges++;
      yield r;
    }
  }

  /** How this pool compares two snapshots. */
  async deltaMethod(): Promise<DeltaMethod> {
    return (await this.pool.fs.canReflink()) ? 'extents' : 'contents';
  }

  /**
   * The ranges of [from, target's size) that differ between `base` and `target`: data written,
   * overwritten, or punched out (a range that held data in the base and is a hole now).
   */
  async *delta(
    x: Exec,
    base: PinnedSnapshot,
    target: PinnedSnapshot,
    from: number,
    stats: MetadataStats,
  ): AsyncGenerator<Range> {
    let method = await this.deltaMethod();
    if (method === 'extents') {
      stats.method = 'extents';
      try {
        for await (const r of this.byExtents(x, base, target, from)) {
          stats.ranges++;
          yield r;
        }
        return;
      } catch (err) {
        // A filesystem without FIEMAP says so at once, before any range: compare contents instead.
        if (stats.ranges > 0 || !(err instanceof CommandError && NO_FIEMAP.test(err.stderr))) throw err;
        x.log.info({ stderr: err.stderr }, 'the pool has no extent maps (FIEMAP); comparing contents');
        method = 'contents';
      }
    }
    stats.method = method;
    const candidates = union(dataRanges(x, base.image, from), dataRanges(x, target.image, from));
    for await (const r of contentDelta(base.handle, target.handle, candidates, x, {
      onRead: (n) => (stats.bytesRead += n),
    })) {
      stats.ranges++;
      yield r;
    }
  }

  private byExtents(x: Exec, base: PinnedSnapshot, target: PinnedSnapshot, from: number) {
    // The base's map beyond its own size is a hole; the target's size bounds the delta.
    return extentDelta(
      extentMap(x, base.image, from),
      extentMap(x, target.image, from),
      from,
      target.image.size,
      x,
    );
  }
}
