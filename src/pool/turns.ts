/**
 * Turns: this process's work on one key in batches, one batch after the other, each in the order its
 * items came, in front of a pool lock (which still decides between processes). A burst of calls on one
 * key then neither polls the pool lock against itself (giving up after its short wait) nor pays for
 * the lock and its records once per call: everything that arrived while a batch ran forms the next
 * one, handled under one taking of the lock (a group commit).
 */
import { busy } from '../errors.js';

interface Waiting<T, R> {
  item: T;
  resolve: (r: R) => void;
  reject: (err: unknown) => void;
  timer: NodeJS.Timeout;
}

/**
 * `handle` gets a batch of items for one key, in their order, and settles each (its results in the same
 * order): one item failing fails only that item; `handle` throwing fails the whole batch.
 */
export type BatchHandler<T, R> = (key: string, items: readonly T[]) => Promise<PromiseSettledResult<R>[]>;

export class Turns<T, R> {
  private readonly waiting = new Map<string, Waiting<T, R>[]>();
  private readonly running = new Set<string>();

  constructor(
    private readonly waitMs: number,
    private readonly handle: BatchHandler<T, R>,
  ) {}

  /** Settles with `item`'s result once its batch ran; ABORTED when its batch has not begun within waitMs. */
  run(key: string, what: string, item: T): Promise<R> {
    return new Promise<R>((resolve, reject) => {
      const queue = this.waiting.get(key) ?? [];
      this.waiting.set(key, queue);
      const w: Waiting<T, R> = {
        item,
        resolve,
        reject,
        timer: setTimeout(() => {
          const i = queue.indexOf(w);
          if (i < 0) return; // its batch began meanwhile
          queue.splice(i, 1);
          reject(busy(`${what} is busy with other calls of this process; retry.`));
        }, this.waitMs),
      };
      queue.push(w);
      if (!this.running.has(key)) void this.drain(key);
    });
  }

  private async drain(key: string): Promise<void> {
    this.running.add(key);
    try {
      for (let batch = this.take(key); batch.length > 0; batch = this.take(key)) {
        try {
          const results = await this.handle(
            key,
            batch.map((w) => w.item),
          );
          for (const [i, w] of batch.entries()) {
            const r = results[i];
            if (r?.status === 'fulfilled') w.resolve(r.value);
            else w.reject(r ? r.reason : new Error('the batch gave no result for this call'));
          }
        } catch (err) {
          for (const w of batch) w.reject(err);
        }
      }
    } finally {
      this.running.delete(key);
    }
  }

  private take(key: string): Waiting<T, R>[] {
    const batch = this.waiting.get(key) ?? [];
    this.waiting.delete(key);
    for (const w of batch) clearTimeout(w.timer);
    return batch;
  }
}
