/**
 * Gives back the memory a burst of calls left behind, once the calls are over.
 *
 * The driver runs with `--max-semi-space-size=1` (npm start, the image): V8's young generation stays
 * small, so what a call holds across a few awaits is promoted to the old generation, and dies there.
 * V8 collects the old generation only when it reaches its limit, and its memory reducer (which gives
 * pages back when a process goes quiet) starts only after such a collection. A burst that ends below
 * the limit leaves its garbage, and the pages under it, for as long as the driver stays quiet: most of
 * a plugin's life. Measured after the end-to-end suite and csi-sanity: 48.5 MiB of heap in use where a
 * heap snapshot found 18.7 live, and in the image (Node 26) 68 MiB in use, 147 MiB of RSS. And where V8
 * did collect, Node 22 and later keep most freed pages for reuse (a plain full collection of 57 MiB of
 * garbage on Node 26 gave 3–15 MiB of RSS back, depending on the objects; with `last-resort`, 54).
 *
 * So: when no call is in flight and none ended for QUIET_MS, and V8's count of the heap's
 * size has grown by GROWTH_BYTES since the last collection here, the heap is collected in full and the
 * free pages given back (compacted first from V8 12 on), at most once every MIN_INTERVAL_MS; and once
 * after the start. Only CSI calls count as activity: a quiet driver is not collected again until calls come back.
 * The collection blocks the event loop: for the driver's heap after its start, 26 ms on Node 20 and
 * 56 ms on Node 26 on an idle machine here; 77–114 ms on Node 26 in other runs, over 200 ms with both
 * CPUs busy. A call arriving meanwhile waits that long; no timer of the driver is near that (the fence
 * heartbeat is 5 s, lock renewals 15 s).
 */
import v8 from 'node:v8';
import { runInNewContext } from 'node:vm';
import type { Logger } from 'pino';

/** How long no call may have begun or ended before the heap is collected. */
export const QUIET_MS = 2_000;
/** How much the heap must have grown since the last collection for one to be worth it. */
export const GROWTH_BYTES = 8 * 2 ** 20;
/** The least time between two collections. */
export const MIN_INTERVAL_MS = 30_000;

/** What the collector needs from the process; tests give their own. */
export interface CollectorDeps {
  /** A full collection that gives free pages back. */
  collect: () => void;
  /** The heap's size as V8 counts it (its spaces' committed pages; not the free pages it pools). */
  heapSize: () => number;
  /** Calls in flight, as the driver counts them. */
  inFlight: () => number;
  log: Logger;
}

/**
 * V8's own full collection, reached without starting Node with `--expose-gc`: the flag exposes `gc`
 * to contexts made after it is set (not to the driver's own). From V8 12 (Node 22) on, the
 * `last-resort` flavor compacts and gives the free pages back at once; V8 11 (Node 20) does no full
 * collection when given any options object, and its plain `gc()` collects in full, after which V8 unmaps the
 * freed pages on a thread of its own. Measured on Node 20, 22, 24 and 26. Undefined when this Node.js
 * refuses (the collector is then off).
 */
export function v8FullCollection(
  v8Major = Number.parseInt(process.versions.v8, 10),
): (() => void) | undefined {
  try {
    v8.setFlagsFromString('--expose-gc');
    const gc = runInNewContext('gc') as unknown;
    if (typeof gc !== 'function') return undefined;
    if (v8Major >= 12) {
      return () => {
        (gc as (options: object) => void)({ type: 'major', execution: 'sync', flavor: 'last-resort' });
      };
    }
    return () => {
      (gc as () => void)();
    };
  } catch {
    return undefined;
  }
}

/** The heap in use, as V8 counts it. */
export const heapUsed = (): number => v8.getHeapStatistics().used_heap_size;
/** The heap's size, as V8 counts it: the pages committed to its spaces. */
export const heapSize = (): number => v8.getHeapStatistics().total_heap_size;

/**
 * Told when a call ends, and collects the heap once calls stop, as above. Quiet is counted from the
 * last end: a call that began meanwhile is still in flight when the collector looks, or ended later.
 */
export class IdleCollector {
  private lastEnd: number;
  private lastCollection = Number.NEGATIVE_INFINITY;
  /** The heap's size after the last collection (or at the start): growth is measured from here. */
  private baseline: number;
  private timer: NodeJS.Timeout | undefined;
  private stopped = false;

  constructor(private readonly deps: CollectorDeps) {
    this.lastEnd = performance.now();
    this.baseline = deps.heapSize();
  }

  /**
   * Once the driver serves: the start's own garbage (the proto's coders, the pool's opening) is
   * collected like a burst's, once no call came for QUIET_MS; the whole heap at the start counts as
   * growth (the driver's is 18 MiB and more). Measured idle on Node 26 (the image's):
   * 82.9–85.4 MiB of RSS against 87.0–89.5 without (four starts each); on Node 20 no difference.
   */
  start(): void {
    this.baseline = 0;
    this.lastEnd = performance.now();
    this.schedule(QUIET_MS);
  }

  /** A call ended: once none is in flight, the next look is QUIET_MS away. */
  callEnded(): void {
    this.lastEnd = performance.now();
    if (this.deps.inFlight() <= 0) this.schedule(QUIET_MS);
  }

  stop(): void {
    this.stopped = true;
    clearTimeout(this.timer);
    this.timer = undefined;
  }

  private schedule(ms: number): void {
    if (this.timer || this.stopped) return;
    this.timer = setTimeout(() => {
      this.timer = undefined;
      this.check();
    }, ms);
    this.timer.unref();
  }

  /** Collects when quiet, grown and not too soon; otherwise waits as long as it must, or for calls. */
  private check(): void {
    if (this.deps.inFlight() > 0 || this.stopped) return; // the last call's end schedules the next look
    const now = performance.now();
    const quiet = now - this.lastEnd;
    const since = now - this.lastCollection;
    const wait = Math.max(QUIET_MS - quiet, MIN_INTERVAL_MS - since);
    if (wait > 0) {
      this.schedule(wait);
      return;
    }
    const size = this.deps.heapSize();
    // V8 gave pages back on its own meanwhile: growth counts from what it kept.
    this.baseline = Math.min(this.baseline, size);
    if (size - this.baseline < GROWTH_BYTES) return;
    const used = heapUsed();
    const t0 = performance.now();
    try {
      this.deps.collect();
    } catch (err) {
      // A way to save memory must never take the driver down: without it, V8 collects as it would.
      this.deps.log.warn({ err }, 'could not collect the heap; not trying again');
      this.stop();
      return;
    }
    this.lastCollection = performance.now();
    this.baseline = this.deps.heapSize();
    const mib = (bytes: number): number => +(bytes / 2 ** 20).toFixed(1);
    this.deps.log.debug(
      {
        heapMiB: { before: mib(size), after: mib(this.baseline) },
        heapUsedMiB: { before: mib(used), after: mib(heapUsed()) },
        ms: Math.round(performance.now() - t0),
      },
      'collected the heap after calls ended',
    );
  }
}
