/**
 * What an image file holds, as the kernel maps it: its data ranges (SEEK_DATA/SEEK_HOLE) and its
 * extents with their physical addresses and flags (FIEMAP). Node.js binds neither, so xfs_io (of
 * xfsprogs, which every loopvol image ships) asks the kernel and prints them; its output is parsed
 * line by line as it comes, never held whole. xfs_io works on any filesystem with these calls (ext4,
 * xfs, btrfs; SEEK_DATA also on NFS 4.2), not only on xfs.
 *
 *   xfs_io -r -c 'seek -a -r OFF' FILE      "DATA 40960" / "HOLE 53248" lines, in bytes
 *   xfs_io -r -c 'fiemap -v OFF LEN' FILE   " 3: [40960..45055]: 461545472..461549567 4096 0x2000"
 *                                           (512-byte sectors, inclusive; "hole" for a hole; hex flags)
 */
import type { Exec } from '../exec/runner.js';
import { commandLines } from '../exec/lines.js';

/** A byte range of an image. */
export interface Range {
  offset: number;
  length: number;
}

/** One extent of a file as FIEMAP reports it; `physical` undefined for a hole. */
export interface Extent {
  offset: number;
  length: number;
  physical: number | undefined;
  flags: number;
}

/** FIEMAP extent flags (linux/fiemap.h). */
export const FIEMAP = {
  LAST: 0x1,
  UNKNOWN: 0x2,
  DELALLOC: 0x4,
  ENCODED: 0x8,
  DATA_ENCRYPTED: 0x80,
  NOT_ALIGNED: 0x100,
  DATA_INLINE: 0x200,
  DATA_TAIL: 0x400,
  UNWRITTEN: 0x800,
  MERGED: 0x1000,
  SHARED: 0x2000,
} as const;

const SECTOR = 512;

/** An image to read: a path the tools can open. Pinned images use /proc/<pid>/fd/<n> (see pinImage). */
export interface ImageRef {
  path: string;
  size: number;
}

/** One line of `seek -a -r`: where data or a hole starts ('EOF': nothing more). */
export function parseSeekLine(line: string): { kind: 'DATA' | 'HOLE'; at: number | 'EOF' } | undefined {
  const m = /^(DATA|HOLE)\s+(\d+|EOF)\s*$/.exec(line.trim());
  if (!m) return undefined;
  return { kind: m[1] === 'DATA' ? 'DATA' : 'HOLE', at: m[2] === 'EOF' ? 'EOF' : Number(m[2]) };
}

/** One extent line of `fiemap -v`; undefined for the file name and the header. */
export function parseFiemapLine(line: string): Extent | undefined {
  const m =
    /^\s*\d+:\s+\[(\d+)\.\.(\d+)\]:\s+(?:(\d+)\.\.(\d+)|hole)\s+(\d+)(?:\s+0x([0-9a-fA-F]+))?\s*$/.exec(line);
  if (!m) return undefined;
  const first = Number(m[1]);
  const last = Number(m[2]);
  return {
    offset: first * SECTOR,
    length: (last - first + 1) * SECTOR,
    physical: m[3] === undefined ? undefined : Number(m[3]) * SECTOR,
    flags: m[6] === undefined ? 0 : parseInt(m[6], 16),
  };
}

/** A line that is neither an extent nor one of the tool's own headers is something we do not understand. */
function unexpected(tool: string, line: string): Error {
  return new Error(`unexpected output from ${tool}: ${JSON.stringify(line.slice(0, 200))}`);
}

/**
 * The data ranges of `image` from `from` on (SEEK_DATA/SEEK_HOLE: what was written, merged; holes and
 * preallocated-but-unwritten blocks are not data), ascending, clipped to [from, size).
 */
export async function* dataRanges(x: Exec, image: ImageRef, from: number): AsyncGenerator<Range> {
  if (from >= image.size) return;
  let dataAt: number | undefined;
  for await (const line of commandLines(x, 'xfs_io', ['-r', '-c', `seek -a -r ${from}`, image.path])) {
    const s = parseSeekLine(line);
    if (!s) {
      if (/^Whence\s+Result/.test(line.trim()) || line.trim() === '') continue;
      throw unexpected('xfs_io seek', line);
    }
    const at = s.at === 'EOF' ? image.size : Math.min(s.at, image.size);
    if (s.kind === 'DATA') {
      dataAt ??= Math.max(at, from);
    } else if (dataAt !== undefined) {
      if (at > dataAt) yield { offset: dataAt, length: at - dataAt };
      dataAt = undefined;
    }
  }
  if (dataAt !== undefined && dataAt < image.size) yield { offset: dataAt, length: image.size - dataAt };
}

/**
 * The extents of `image` from `from` on, ascending, clipped to [from, size). Holes may be reported or
 * left out (a gap between extents is a hole). Throws a CommandError when the filesystem has no FIEMAP.
 */
export async function* extentMap(x: Exec, image: ImageRef, from: number): AsyncGenerator<Extent> {
  if (from >= image.size) return;
  const args = ['-r', '-c', `fiemap -v ${from} ${image.size - from}`, image.path];
  for await (const line of commandLines(x, 'xfs_io', args)) {
    const e = parseFiemapLine(line);
    if (!e) {
      const t = line.trim();
      if (t === '' || /^EXT:/.test(t) || t.endsWith(':')) continue;
      throw unexpected('xfs_io fiemap', line);
    }
    const start = Math.max(e.offset, from);
    const end = Math.min(e.offset + e.length, image.size);
    if (end <= start) continue;
    const shift = start - e.offset;
    yield {
      offset: start,
      length: end - start,
      physical: e.physical === undefined ? undefined : e.physical + shift,
      flags: e.flags,
    };
  }
}

/**
 * Joins ranges that touch or overlap into one (input ascending by offset), so a client gets the
 * fewest, largest tuples.
 */
export async function* coalesce(ranges: AsyncIterable<Range>): AsyncGenerator<Range> {
  let cur: Range | undefined;
  for await (const r of ranges) {
    if (r.length <= 0) continue;
    if (cur && r.offset <= cur.offset + cur.length) {
      cur.length = Math.max(cur.length, r.offset + r.length - cur.offset);
      continue;
    }
    if (cur) yield cur;
    cur = { offset: r.offset, length: r.length };
  }
  if (cur) yield cur;
}

/** The union of two ascending range streams, ascending (overlaps merged). */
export async function* union(a: AsyncIterable<Range>, b: AsyncIterable<Range>): AsyncGenerator<Range> {
  const ia = a[Symbol.asyncIterator]();
  const ib = b[Symbol.asyncIterator]();
  try {
    let ra = await ia.next();
    let rb = await ib.next();
    const merged = async function* (): AsyncGenerator<Range> {
      while (!ra.done || !rb.done) {
        if (rb.done || (!ra.done && ra.value.offset <= rb.value.offset)) {
          if (ra.done) break;
          yield ra.value;
          ra = await ia.next();
        } else {
          yield rb.value;
          rb = await ib.next();
        }
      }
    };
    yield* coalesce(merged());
  } finally {
    await Promise.all([ia.return?.(), ib.return?.()]);
  }
}
