/**
 * Keys of operations running in this process (a volume id, a snapshot name...). A second operation on
 * a key that is busy is refused at once (ABORTED, as the spec allows) instead of queueing behind it.
 */
/** The release of a call that holds no key (most reads and polls): nothing to undo, nothing to allocate. */
const noKeys = (): void => {};

export class InFlight {
  private readonly busy = new Map<string, string>();

  /** Takes all keys or none; returns a release function, or the method holding the first busy key. */
  tryAcquire(keys: readonly string[], holder: string): (() => void) | { heldBy: string; key: string } {
    if (keys.length === 0) return noKeys;
    for (const key of keys) {
      const heldBy = this.busy.get(key);
      if (heldBy !== undefined) return { heldBy, key };
    }
    const unique = [...new Set(keys)];
    for (const key of unique) this.busy.set(key, holder);
    let released = false;
    return () => {
      if (released) return;
      released = true;
      for (const key of unique) this.busy.delete(key);
    };
  }

  get size(): number {
    return this.busy.size;
  }
}
