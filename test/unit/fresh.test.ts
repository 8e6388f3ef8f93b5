/**
 * freshReading: calls that look at the host at once share readings, and no call is handed a reading
 * that began before it asked (which could miss the call's own last step).
 */
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { CallStopped } from '../../src/exec/runner.js';
import { freshReading, whileCalling } from '../../src/host/fresh.js';

/** A reading whose end the test decides; it records when it began. */
function controlled() {
  const starts: number[] = [];
  const ends: ((v: number) => void)[] = [];
  const fails: ((e: Error) => void)[] = [];
  let clock = 0;
  const read = freshReading(
    () =>
      new Promise<number>((resolve, reject) => {
        starts.push(clock);
        ends.push(resolve);
        fails.push(reject);
      }),
  );
  const tick = () => new Promise((r) => setTimeout(r, 0));
  return { read, starts, ends, fails, tick, at: (t: number) => (clock = t) };
}

describe('freshReading', () => {
  it('gives each caller a reading that began after it asked, and shares the one that did', async () => {
    const c = controlled();
    c.at(1);
    const first = c.read(); // starts at once
    c.at(2);
    const late = [c.read(), c.read(), c.read()]; // asked while the first runs: they wait for the next
    await c.tick();
    expect(c.starts).toEqual([1]);
    c.at(3);
    c.ends[0]?.(10);
    expect(await first).toBe(10);
    await c.tick();
    expect(c.starts).toEqual([1, 3]); // one more reading for the three, begun after they asked
    c.ends[1]?.(20);
    expect(await Promise.all(late)).toEqual([20, 20, 20]);
  });

  it('begins a new reading for a caller who asks once all are done', async () => {
    const c = controlled();
    const a = c.read();
    c.ends[0]?.(1);
    await a;
    await c.tick();
    const b = c.read();
    c.ends[1]?.(2);
    expect({ a: await a, b: await b, readings: c.starts.length }).toEqual({ a: 1, b: 2, readings: 2 });
  });

  it('hands a failed reading to those who shared it, and the next caller reads again', async () => {
    const c = controlled();
    const first = c.read();
    const second = c.read();
    c.fails[0]?.(new Error('first failed'));
    await expect(first).rejects.toThrow('first failed');
    await c.tick();
    c.fails[1]?.(new Error('second failed'));
    await expect(second).rejects.toThrow('second failed');
    await c.tick();
    const third = c.read();
    c.ends[2]?.(3);
    expect(await third).toBe(3);
  });

  it('gives a caller who asks while the queued reading runs a later one still', async () => {
    const c = controlled();
    const a = c.read();
    const b = c.read(); // queued behind a's
    c.ends[0]?.(0);
    await a;
    await c.tick(); // b's reading has begun
    expect(c.starts.length).toBe(2);
    const late = c.read(); // asked while b's reading runs: must not get it
    c.ends[1]?.(1);
    expect(await b).toBe(1);
    await c.tick();
    expect(c.starts.length).toBe(3);
    c.ends[2]?.(2);
    expect(await late).toBe(2);
  });
});

describe('whileCalling', () => {
  it("stops a caller's wait at its cancellation and its deadline, and leaves the shared reading running", async () => {
    const log = pino({ level: 'silent' });
    let finish!: (v: number) => void;
    const shared = new Promise<number>((r) => (finish = r));
    const caller = new AbortController();
    const cancelled = whileCalling({ log, signal: caller.signal }, shared);
    const late = whileCalling({ log, deadline: Date.now() + 30 }, shared);
    const patient = whileCalling({ log }, shared);
    caller.abort();
    const why = async (p: Promise<number>) =>
      p.then(String, (e: unknown) => (e instanceof CallStopped ? e.reason : String(e)));
    expect(await why(cancelled)).toBe('cancelled');
    expect(await why(late)).toBe('deadline');
    finish(7);
    expect(await patient).toBe(7);
  });

  it('never leaves a reading that fails after the caller stopped waiting unhandled', async () => {
    const log = pino({ level: 'silent' });
    let fail!: (e: Error) => void;
    const shared = new Promise<number>((_, reject) => (fail = reject));
    const gone = new AbortController();
    gone.abort();
    const stopped = whileCalling({ log, signal: gone.signal }, shared).catch((e: unknown) => e);
    fail(new Error('losetup output unparsable'));
    await new Promise((r) => setTimeout(r, 10)); // vitest fails the run on an unhandled rejection
    expect(await stopped).toBeInstanceOf(CallStopped);
  });

  it('takes a deadline past what a timer holds (more than 24.8 days away) as none', async () => {
    const log = pino({ level: 'silent' });
    const shared = new Promise<number>((r) =>
      setTimeout(() => {
        r(5);
      }, 30),
    );
    expect(await whileCalling({ log, deadline: Date.now() + 30 * 24 * 3600 * 1000 }, shared)).toBe(5);
  });
});
