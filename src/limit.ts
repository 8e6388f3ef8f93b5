/** `fn` over `items` with at most `limit` calls in flight, results in the items' order. */
export async function mapLimit<T, R>(
  items: readonly T[],
  limit: number,
  fn: (item: T) => Promise<R>,
): Promise<R[]> {
  const out = new Array<R>(items.length);
  let next = 0;
  const worker = async (): Promise<void> => {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i] as T);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return out;
}

/** What `p` settles to, or what `late()` gives once `ms` have passed first. The timer never outlives it. */
export async function orAfter<T>(p: Promise<T>, ms: number, late: () => T): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      p,
      new Promise<T>((resolve) => {
        timer = setTimeout(() => {
          resolve(late());
        }, ms);
      }),
    ]);
  } finally {
    clearTimeout(timer);
  }
}

/** Something that runs again and again until stopped; `first` settles after the first run. */
export interface Repeating {
  readonly first: Promise<void>;
  stop(): void;
}

/**
 * Runs `fn` now, then `everyMs` after each run ends, until stopped. `fn` must not reject (it logs its
 * own failures). The timer does not keep the process alive.
 */
export function repeat(everyMs: number, fn: (first: boolean) => Promise<void>): Repeating {
  let stopped = false;
  let timer: NodeJS.Timeout | undefined;
  const schedule = (): void => {
    if (stopped) return;
    timer = setTimeout(() => void fn(false).finally(schedule), everyMs);
    timer.unref();
  };
  const first = fn(true).finally(schedule);
  return {
    first,
    stop() {
      stopped = true;
      if (timer) clearTimeout(timer);
    },
  };
}
