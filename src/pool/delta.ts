/**
 * Which byte ranges differ between two images of one volume, two ways:
 *
 * - By extents, where the pool shares them (reflink): both snapshots are clones of the same volume
 *   image, so a range whose blocks are the same physical blocks in both did not change; anything else
 *   did (new blocks written, blocks punched out or discarded, blocks added where the base had a hole).
 *   Only the two extent maps are read, never the data. Extents whose physical address says nothing
 *   about their content (delayed allocation, inline or tail data, unknown) count as changed; so do
 *   compressed (encoded) extents unless both maps name the very same one.
 * - By contents, where it does not (a byte copy shares nothing): the ranges where either image has
 *   data are read from both, in chunks, and compared block by block. Holes read as zeros.
 *
 * Both yield ascending, coalesced ranges, and stop as soon as their consumer stops.
 */
import type { FileHandle } from 'node:fs/promises';
import { checkpoint, type RunScope } from '../exec/runner.js';
import { coalesce, type Extent, FIEMAP, type Range } from './extents.js';

/** Flags of extents whose physical address cannot be compared. */
const UNCOMPARABLE =
  FIEMAP.UNKNOWN | FIEMAP.DELALLOC | FIEMAP.NOT_ALIGNED | FIEMAP.DATA_INLINE | FIEMAP.DATA_TAIL;

/** Walks an ascending extent stream: the extent that covers a position, or the hole up to the next. */
class Cursor {
  private cur: Extent | undefined;
  private done = false;

  constructor(private readonly it: AsyncIterator<Extent>) {}

  async at(pos: number): Promise<{ ext: Extent | undefined; end: number }> {
    while (!this.done && (this.cur === undefined || this.cur.offset + this.cur.length <= pos)) {
      const r = await this.it.next();
      if (r.done) {
        this.done = true;
        this.cur = undefined;
      } else {
        this.cur = r.value;
      }
    }
    const cur = this.cur;
    if (cur && cur.offset <= pos) return { ext: cur, end: cur.offset + cur.length };
    return { ext: undefined, end: cur ? cur.offset : Number.POSITIVE_INFINITY };
  }
}

/** A hole, or blocks allocated but never written: both read as zeros. */
const readsZero = (e: Extent | undefined): boolean =>
  e === undefined || e.physical === undefined || (e.flags & FIEMAP.UNWRITTEN) !== 0;

/** Whether the bytes at `pos` may differ between the base extent `a` and the target extent `b`. */
export function extentsDiffer(a: Extent | undefined, b: Extent | undefined, pos: number): boolean {
  const za = readsZero(a);
  const zb = readsZero(b);
  if (za && zb) return false;
  if (za !== zb || !a || !b || a.physical === undefined || b.physical === undefined) return true;
  if (((a.flags | b.flags) & UNCOMPARABLE) !== 0) return true;
  if (((a.flags | b.flags) & FIEMAP.ENCODED) !== 0) {
    const same =
      (a.flags & b.flags & FIEMAP.ENCODED) !== 0 &&
      a.offset === b.offset &&
      a.length === b.length &&
      a.physical === b.physical;
    return !same;
  }
  return a.physical + (pos - a.offset) !== b.physical + (pos - b.offset);
}

/**
 * The ranges of [from, size) whose extents differ between `base` and `target` (both ascending extent
 * streams of images in one filesystem). Unshared blocks are never equal: a block the target wrote is
 * a new physical block, so the SHARED flag needs no reading of its own.
 */
export async function* extentDelta(
  base: AsyncIterable<Extent>,
  target: AsyncIterable<Extent>,
  from: number,
  size: number,
  scope: RunScope,
): AsyncGenerator<Range> {
  const ib = base[Symbol.asyncIterator]();
  const it = target[Symbol.asyncIterator]();
  const a = new Cursor(ib);
  const b = new Cursor(it);
  const segments = async function* (): AsyncGenerator<Range> {
    for (let pos = from; pos < size;) {
      checkpoint(scope);
      const [sa, sb] = await Promise.all([a.at(pos), b.at(pos)]);
      const end = Math.min(sa.end, sb.end, size);
      if (extentsDiffer(sa.ext, sb.ext, pos)) yield { offset: pos, length: end - pos };
      pos = end;
    }
  };
  try {
    yield* coalesce(segments());
  } finally {
    await Promise.all([ib.return?.(), it.return?.()]);
  }
}

export interface ContentOptions {
  /** Bytes read at a time from each image. */
  chunkBytes?: number;
  /** The unit of comparison (and of the ranges reported). */
  blockBytes?: number;
  /** Told every read, with the bytes it returned (for the call's log line and the bench). */
  onRead?: (bytes: number) => void;
}

/** Reads `length` bytes at `position` into `buf`; past the end of the file reads zeros. */
async function readAt(
  file: FileHandle,
  buf: Buffer,
  length: number,
  position: number,
  onRead?: (n: number) => void,
): Promise<void> {
  let done = 0;
  while (done < length) {
    const { bytesRead } = await file.read(buf, done, length - done, position + done);
    if (bytesRead === 0) break;
    onRead?.(bytesRead);
    done += bytesRead;
  }
  buf.fill(0, done, length);
}

/**
 * The ranges among `candidates` (ascending; where either image may hold data) whose bytes differ
 * between `base` and `target`, compared in blocks. Memory: two chunk buffers, whatever the images.
 */
export async function* contentDelta(
  base: FileHandle,
  target: FileHandle,
  candidates: AsyncIterable<Range>,
  scope: RunScope,
  opts: ContentOptions = {},
): AsyncGenerator<Range> {
  const block = opts.blockBytes ?? 4096;
  const chunk = Math.max(block, Math.floor((opts.chunkBytes ?? 2 ** 20) / block) * block);
  const bufA = Buffer.allocUnsafe(chunk);
  const bufB = Buffer.allocUnsafe(chunk);
  const changed = async function* (): AsyncGenerator<Range> {
    for await (const r of candidates) {
      const end = r.offset + r.length;
      for (let off = Math.floor(r.offset / block) * block; off < end; off += chunk) {
        checkpoint(scope);
        const len = Math.min(chunk, end - off);
        await Promise.all([
          readAt(base, bufA, len, off, opts.onRead),
          readAt(target, bufB, len, off, opts.onRead),
        ]);
        if (bufA.subarray(0, len).equals(bufB.subarray(0, len))) continue;
        for (let k = 0; k < len; k += block) {
          const n = Math.min(block, len - k);
          if (!bufA.subarray(k, k + n).equals(bufB.subarray(k, k + n))) yield { offset: off + k, length: n };
        }
      }
    }
  };
  yield* coalesce(changed());
}
