/**
 * The copy speed a freeze budget is judged by (pool/filesystem.ts): a frozen copy stopped at the end of
 * its budget makes the next attempt at as many bytes refused before anything is frozen, for a while,
 * and then what finished copies showed counts again (a pool that was slow once is not refused forever).
 */
import { afterEach, describe, expect, it, vi } from 'vitest';
import { PoolFilesystem, SLOW_COPY_MEMORY_MS } from '../../src/pool/filesystem.js';
import { PoolLayout } from '../../src/pool/layout.js';

const MiB = 2 ** 20;
afterEach(() => {
  vi.useRealTimers();
});

describe('the copy speed a freeze budget is judged by', () => {
  it('after an unfinished copy, estimates as many bytes at twice the budget, until the memory expires', () => {
    vi.useFakeTimers({ now: new Date('2026-12-01T12:00:00Z') });
    const fsys = new PoolFilesystem(new PoolLayout('/nonexistent-pool'));
    fsys.recordCopy(512 * MiB, 1); // finished copies showed 512 MiB/s
    expect(fsys.copySeconds(16 * MiB)).toBeLessThan(0.1);

    fsys.recordUnfinishedCopy(16 * MiB, 5); // stopped at the end of a 5 s budget
    expect(fsys.copySeconds(16 * MiB)).toBeCloseTo(10, 5);
    expect(fsys.copySeconds(4 * MiB)).toBeCloseTo(2.5, 5); // smaller copies still fit

    vi.setSystemTime(Date.now() + SLOW_COPY_MEMORY_MS + 1);
    expect(fsys.copySeconds(16 * MiB)).toBeLessThan(0.1);
  });
});
