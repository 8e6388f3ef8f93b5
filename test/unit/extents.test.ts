/** The extent logic of changed block tracking, without a kernel: parsing, range algebra, the two deltas. */
import fs from 'node:fs/promises';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { CallStopped } from '../../src/exec/runner.js';
import { contentDelta, extentDelta, extentsDiffer } from '../../src/pool/delta.js';
import {
  coalesce,
  type Extent,
  FIEMAP,
  parseFiemapLine,
  parseSeekLine,
  type Range,
  union,
} from '../../src/pool/extents.js';
import { tempDir } from '../helpers/driver.js';

const scope = { log: pino({ level: 'silent' }) };
const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await fs.rm(d, { recursive: true, force: true });
});

async function* from<T>(items: readonly T[]): AsyncGenerator<T> {
  for (const i of items) {
    await Promise.resolve();
    yield i;
  }
}
const all = async <T>(it: AsyncIterable<T>): Promise<T[]> => {
  const out: T[] = [];
  for await (const x of it) out.push(x);
  return out;
};
const ext = (offset: number, length: number, physical: number | undefined, flags = 0): Extent => ({
  offset,
  length,
  physical,
  flags,
});

describe('xfs_io output', () => {
  it('parses seek lines, EOF included, and nothing else', () => {
    expect(parseSeekLine('DATA\t40960')).toEqual({ kind: 'DATA', at: 40960 });
    expect(parseSeekLine('HOLE\t0')).toEqual({ kind: 'HOLE', at: 0 });
    expect(parseSeekLine('DATA\tEOF')).toEqual({ kind: 'DATA', at: 'EOF' });
    expect(parseSeekLine('Whence\tResult')).toBeUndefined();
  });

  it('parses fiemap lines in 512-byte sectors, holes and hex flags', () => {
    expect(parseFiemapLine('   1: [80..103]:       461389904..461389927    24   0x0')).toEqual(
      ext(80 * 512, 24 * 512, 461389904 * 512, 0),
    );
    expect(parseFiemapLine('   4: [45056..81919]:  hole                 36864')).toEqual(
      ext(45056 * 512, 36864 * 512, undefined, 0),
    );
    expect(parseFiemapLine('   5: [81920..83967]:  461379584..461381631  2048 0x801')?.flags).toBe(
      FIEMAP.UNWRITTEN | FIEMAP.LAST,
    );
    expect(parseFiemapLine(' EXT: FILE-OFFSET      BLOCK-RANGE          TOTAL FLAGS')).toBeUndefined();
    expect(parseFiemapLine('/proc/1/fd/20:')).toBeUndefined();
  });
});

describe('range algebra', () => {
  it('coalesces touching and overlapping ranges, drops empty ones', async () => {
    const r = await all(
      coalesce(
        from<Range>([
          { offset: 0, length: 4 },
          { offset: 4, length: 4 },
          { offset: 6, length: 10 },
          { offset: 20, length: 0 },
          { offset: 30, length: 1 },
        ]),
      ),
    );
    expect(r).toEqual([
      { offset: 0, length: 16 },
      { offset: 30, length: 1 },
    ]);
  });

  it('unites two ascending streams', async () => {
    const a = from<Range>([
      { offset: 0, length: 10 },
      { offset: 50, length: 10 },
    ]);
    const b = from<Range>([
      { offset: 5, length: 10 },
      { offset: 30, length: 5 },
      { offset: 100, length: 1 },
    ]);
    expect(await all(union(a, b))).toEqual([
      { offset: 0, length: 15 },
      { offset: 30, length: 5 },
      { offset: 50, length: 10 },
      { offset: 100, length: 1 },
    ]);
  });
});

describe('the delta by extents', () => {
  it('says which extents may differ', () => {
    expect(extentsDiffer(undefined, undefined, 0)).toBe(false);
    expect(extentsDiffer(ext(0, 8, undefined), ext(0, 8, 100, FIEMAP.UNWRITTEN), 0)).toBe(false);
    expect(extentsDiffer(ext(0, 8, 100), undefined, 0)).toBe(true); // punched out
    expect(extentsDiffer(undefined, ext(0, 8, 100), 0)).toBe(true); // written into a hole
    expect(extentsDiffer(ext(0, 8, 100), ext(4, 4, 104), 4)).toBe(false); // same block, other split
    expect(extentsDiffer(ext(0, 8, 100), ext(0, 8, 200), 0)).toBe(true);
    expect(extentsDiffer(ext(0, 8, 100, FIEMAP.DELALLOC), ext(0, 8, 100), 0)).toBe(true);
    expect(extentsDiffer(ext(0, 8, 100, FIEMAP.ENCODED), ext(0, 8, 100, FIEMAP.ENCODED), 0)).toBe(false);
    expect(extentsDiffer(ext(0, 8, 100, FIEMAP.ENCODED), ext(0, 4, 100, FIEMAP.ENCODED), 0)).toBe(true);
  });

  it('sweeps two maps: rewritten, punched, new and unchanged ranges', async () => {
    const base = [ext(0, 4096, 1_000_000), ext(4096, 8192, 2_000_000), ext(16384, 4096, 3_000_000)];
    const target = [
      ext(0, 4096, 1_000_000), // unchanged
      ext(4096, 4096, 2_000_000), // first half unchanged
      ext(8192, 4096, 9_000_000), // second half rewritten
      // 16384..20480 punched out
      ext(65536, 4096, 5_000_000), // new data in the base's hole
    ];
    const r = await all(extentDelta(from(base), from(target), 0, 1 << 20, scope));
    expect(r).toEqual([
      { offset: 8192, length: 4096 },
      { offset: 16384, length: 4096 },
      { offset: 65536, length: 4096 },
    ]);
    // Resumed at a byte inside the punched range.
    const later = await all(extentDelta(from(base), from(target), 17000, 1 << 20, scope));
    expect(later[0]).toEqual({ offset: 17000, length: 20480 - 17000 });
  });

  it('stops when its caller is cancelled', async () => {
    const controller = new AbortController();
    controller.abort();
    const it = extentDelta(from([ext(0, 4096, 1)]), from([]), 0, 4096, {
      ...scope,
      signal: controller.signal,
    });
    await expect(all(it)).rejects.toBeInstanceOf(CallStopped);
  });
});

describe('the delta by contents', () => {
  it('compares blocks, holes as zeros, a shorter base as zeros past its end', async () => {
    const dir = await tempDir('content-delta');
    dirs.push(dir);
    const a = path.join(dir, 'a');
    const b = path.join(dir, 'b');
    const size = 64 * 4096;
    await fs.writeFile(a, Buffer.alloc(size / 2, 7)); // half the size of b
    const bb = Buffer.alloc(size, 0);
    bb.fill(7, 0, size / 2);
    bb[5 * 4096 + 100] = 1; // one byte changed in block 5
    bb.fill(9, 40 * 4096, 42 * 4096); // new data past a's end
    bb.fill(0, 10 * 4096, 11 * 4096); // block 10 zeroed
    await fs.writeFile(b, bb);
    const ha = await fs.open(a, 'r');
    const hb = await fs.open(b, 'r');
    let read = 0;
    try {
      const r = await all(
        contentDelta(ha, hb, from<Range>([{ offset: 0, length: size }]), scope, {
          chunkBytes: 3 * 4096,
          onRead: (n) => (read += n),
        }),
      );
      expect(r).toEqual([
        { offset: 5 * 4096, length: 4096 },
        { offset: 10 * 4096, length: 4096 },
        { offset: 40 * 4096, length: 2 * 4096 },
      ]);
      expect(read).toBe(size / 2 + size);
    } finally {
      await ha.close();
      await hb.close();
    }
  });
});
