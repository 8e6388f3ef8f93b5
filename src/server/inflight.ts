/**
 * Keys of operations running in this process (a volume id, a snapshot name...). A second operation on
 * a key that is busy is refused at once (ABORTED, as the spec allows) instead of queueing behind it.
 *
 * A path's key (pathKey) is busy while the same path, a directory above it or a path below it is: two
 * node calls that check a place and then mount there (two volumes staged at one path, published at a
 * target and at a target inside it) would otherwise both see it free, and both mount.
 */
import path from 'node:path';

const PATH = 'path:';
/** The key of a node path: it overlaps the keys of the paths above and below it. */
export const pathKey = (p: string): string => `${PATH}${path.resolve(p)}`;
const overlap = (a: string, b: string): boolean =>
  a === b || (a.startsWith(PATH) && b.startsWith(PATH) && (a.startsWith(`${b}/`) || b.startsWith(`${a}/`)));

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
      if (!key.startsWith(PATH)) continue;
      for (const [held, by] of this.busy) if (overlap(key, held)) return { heldBy: by, key: held };
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
