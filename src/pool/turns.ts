/**
 * Turns: this process's work on one key, one after the other in the order it came, in front of a pool
 * lock (which still decides between processes). A burst of calls on one key then queues instead of
 * polling the pool lock against each other and giving up after its short wait.
 */
import { busy } from '../errors.js';

export class Turns {
  /** The tail of each key's queue. */
  private readonly tails = new Map<string, Promise<void>>();

  constructor(private readonly waitMs: number) {}

  /** Runs `fn` once this process's earlier work on `key` has ended; ABORTED when that takes longer than waitMs. */
  async run<T>(key: string, what: string, fn: () => Promise<T>): Promise<T> {
    const before = this.tails.get(key) ?? Promise.resolve();
    let done!: () => void;
    const mine = new Promise<void>((resolve) => {
      done = resolve;
    });
    const tail = before.then(() => mine);
    this.tails.set(key, tail);
    let timer: NodeJS.Timeout | undefined;
    try {
      const reached = await Promise.race([
        before.then(() => true),
        new Promise<false>((resolve) => {
          timer = setTimeout(() => {
            resolve(false);
          }, this.waitMs);
        }),
      ]);
      if (!reached) throw busy(`${what} is busy with other calls of this process; retry.`);
      return await fn();
    } finally {
      clearTimeout(timer);
      done();
      if (this.tails.get(key) === tail) this.tails.delete(key);
    }
  }
}
