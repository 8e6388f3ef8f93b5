/**
 * The heap collected once calls stop (src/idle-gc.ts): when, and only when, no call is in flight,
 * none ended for QUIET_MS, the heap's size grew by GROWTH_BYTES and the last collection is MIN_INTERVAL_MS
 * old; and V8's own collection, reached without --expose-gc, really collects (in a process of its own).
 */
import { spawnSync } from 'node:child_process';
import path from 'node:path';
import { pino } from 'pino';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { GROWTH_BYTES, IdleCollector, MIN_INTERVAL_MS, QUIET_MS } from '../../src/idle-gc.js';

const log = pino({ level: 'silent' });
const MiB = 2 ** 20;

/**
 * A collector over a heap the test sets and calls the test counts in and out. A collection drops the
 * heap to `live`, or does what `collect` says.
 */
function setup(opts: { live?: number; collect?: () => void; log?: typeof log } = {}) {
  const live = opts.live ?? 20 * MiB;
  let heap = live;
  let inFlight = 0;
  const state = { collections: 0 };
  const collector = new IdleCollector({
    collect: () => {
      state.collections++;
      opts.collect?.();
      heap = live;
    },
    heapSize: () => heap,
    inFlight: () => inFlight,
    log: opts.log ?? log,
  });
  const t = {
    collector,
    state,
    grow: (bytes: number) => {
      heap += bytes;
    },
    setHeap: (bytes: number) => {
      heap = bytes;
    },
    begin: () => {
      inFlight++;
    },
    end: () => {
      inFlight--;
      collector.callEnded();
    },
    /** One call, begun and ended now. */
    call: () => {
      t.begin();
      t.end();
    },
  };
  return t;
}

describe('when the heap is collected', () => {
  beforeEach(() => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'performance'] });
  });
  afterEach(() => {
    vi.useRealTimers();
  });

  it('collects once the last call ended and QUIET_MS passed, when the heap grew enough', () => {
    const t = setup();
    t.begin();
    t.grow(GROWTH_BYTES);
    t.end();
    vi.advanceTimersByTime(QUIET_MS - 1);
    expect(t.state.collections).toBe(0);
    vi.advanceTimersByTime(1);
    expect(t.state.collections).toBe(1);
    // Nothing more while quiet: the next look comes with the next call's end.
    vi.advanceTimersByTime(10 * MIN_INTERVAL_MS);
    expect(t.state.collections).toBe(1);
  });

  it('does not collect a heap that grew less than GROWTH_BYTES', () => {
    const t = setup();
    t.grow(GROWTH_BYTES - 1);
    t.call();
    vi.advanceTimersByTime(10 * QUIET_MS);
    expect(t.state.collections).toBe(0);
  });

  it('never collects while a call is in flight, however long it runs', () => {
    const t = setup();
    t.grow(2 * GROWTH_BYTES);
    t.call(); // the last call ended: a look is due in QUIET_MS
    t.begin(); // and another began meanwhile
    vi.advanceTimersByTime(10 * MIN_INTERVAL_MS);
    expect(t.state.collections).toBe(0);
    t.end();
    vi.advanceTimersByTime(QUIET_MS);
    expect(t.state.collections).toBe(1);
  });

  it('does not look while calls overlap, only once the last one ended', () => {
    const t = setup();
    t.begin();
    t.call(); // another call ends while the first runs
    t.grow(2 * GROWTH_BYTES);
    vi.advanceTimersByTime(10 * MIN_INTERVAL_MS);
    expect(t.state.collections).toBe(0);
    t.end();
    vi.advanceTimersByTime(QUIET_MS);
    expect(t.state.collections).toBe(1);
  });

  it('waits for QUIET_MS after the last call, however the calls come', () => {
    const t = setup();
    t.grow(GROWTH_BYTES);
    for (let i = 0; i < 5; i++) {
      t.call();
      vi.advanceTimersByTime(QUIET_MS / 2);
    }
    expect(t.state.collections).toBe(0);
    vi.advanceTimersByTime(QUIET_MS / 2);
    expect(t.state.collections).toBe(1);
  });

  it('collects at most once per MIN_INTERVAL_MS, and then as soon as it may', () => {
    const t = setup();
    t.grow(GROWTH_BYTES);
    t.call();
    vi.advanceTimersByTime(QUIET_MS);
    expect(t.state.collections).toBe(1);
    t.grow(GROWTH_BYTES);
    t.call();
    vi.advanceTimersByTime(QUIET_MS);
    expect(t.state.collections).toBe(1);
    vi.advanceTimersByTime(MIN_INTERVAL_MS - QUIET_MS - 1);
    expect(t.state.collections).toBe(1);
    vi.advanceTimersByTime(1);
    expect(t.state.collections).toBe(2);
  });

  it('measures growth from what V8 kept when it gave pages back on its own meanwhile', () => {
    const t = setup({ live: 40 * MiB });
    t.setHeap(20 * MiB); // V8 gave back 20 MiB of what it held at the start
    t.call();
    vi.advanceTimersByTime(QUIET_MS);
    expect(t.state.collections).toBe(0);
    t.setHeap(20 * MiB + GROWTH_BYTES); // grown from there, though not from the start
    t.call();
    vi.advanceTimersByTime(QUIET_MS);
    expect(t.state.collections).toBe(1);
  });

  it('collects once after the start, when no call came for QUIET_MS: the start counts as growth', () => {
    const t = setup();
    t.collector.start();
    vi.advanceTimersByTime(QUIET_MS / 2);
    t.call();
    vi.advanceTimersByTime(QUIET_MS - 1);
    expect(t.state.collections).toBe(0);
    vi.advanceTimersByTime(1);
    expect(t.state.collections).toBe(1);
    t.call();
    vi.advanceTimersByTime(10 * MIN_INTERVAL_MS);
    expect(t.state.collections).toBe(1);
  });

  it('counts quiet from the end of the last call, also when a look was already due', () => {
    const t = setup();
    t.grow(GROWTH_BYTES);
    t.call(); // a look is due at QUIET_MS
    vi.advanceTimersByTime(100);
    t.begin();
    vi.advanceTimersByTime(QUIET_MS - 200);
    t.end(); // at QUIET_MS - 100: quiet counts from here
    vi.advanceTimersByTime(QUIET_MS - 1);
    expect(t.state.collections).toBe(0);
    vi.advanceTimersByTime(1);
    expect(t.state.collections).toBe(1);
  });

  it('stops for good, and says so, when a collection throws', () => {
    const warnings: string[] = [];
    const warnLog = pino(
      { level: 'warn' },
      {
        write: (line: string) => {
          warnings.push((JSON.parse(line) as { msg: string }).msg);
        },
      },
    );
    const t = setup({
      log: warnLog,
      collect: () => {
        throw new Error('no');
      },
    });
    t.collector.start();
    vi.advanceTimersByTime(QUIET_MS);
    expect(t.state.collections).toBe(1);
    expect(warnings).toEqual(['could not collect the heap; not trying again']);
    t.grow(2 * GROWTH_BYTES);
    t.call();
    vi.advanceTimersByTime(10 * MIN_INTERVAL_MS);
    expect(t.state.collections).toBe(1);
  });

  it('does nothing after stop', () => {
    const t = setup();
    t.grow(GROWTH_BYTES);
    t.call();
    t.collector.stop();
    t.call();
    vi.advanceTimersByTime(10 * MIN_INTERVAL_MS);
    expect(t.state.collections).toBe(0);
  });
});

describe("V8's own full collection, without --expose-gc", () => {
  it('collects garbage promoted to the old generation and gives the pages back', () => {
    // In a process of its own, as the driver runs (--max-semi-space-size=1).
    const child = spawnSync(
      process.execPath,
      ['--max-semi-space-size=1', 'test/helpers/collect-probe.mjs', path.resolve('dist/idle-gc.js')],
      { encoding: 'utf8', timeout: 30_000 },
    );
    expect(child.status, child.stderr).toBe(0);
    const r = JSON.parse(child.stdout) as {
      garbage: number;
      after: number;
      rssBefore: number;
      rssAfter: number;
      exposed: string;
    };
    expect(r.garbage).toBeGreaterThan(40 * MiB);
    expect(r.after).toBeLessThan(r.garbage - 32 * MiB);
    expect(r.rssAfter).toBeLessThan(r.rssBefore - 16 * MiB);
    // The driver's own context is left as it was: no global gc.
    expect(r.exposed).toBe('undefined');
  });
});
