/**
 * Filesystem-consistent copies: a volume whose filesystem is mounted on this host is frozen
 * (fsfreeze) for the instant its image is copied, so the copy holds a clean filesystem rather than a
 * crash image. A volume mounted on another host (or not mounted, or used as a raw block device) is
 * copied as it is: crash-consistent, like pulling the power.
 */
import type { CallContext } from '../server/call.js';
import { loopsFor, listLoops } from './loop.js';
import { isReadOnlyMount, readMounts } from './mounts.js';

export interface Freezer {
  /** Runs `fn` with the filesystems of `images` frozen where they are mounted on this host. */
  freezeWhile<T>(ctx: CallContext, images: readonly string[], fn: () => Promise<T>): Promise<T>;
}

async function mountPointsOf(images: readonly string[]): Promise<string[]> {
  const mounts = await readMounts();
  const points: string[] = [];
  for (const image of images) {
    for (const loop of await loopsFor(image)) {
      // One mount point per filesystem is enough: freezing acts on the superblock.
      const m = mounts.find((x) => x.source === loop.path && !isReadOnlyMount(x));
      if (m) points.push(m.mountPoint);
    }
  }
  return points;
}

export class HostFreezer implements Freezer {
  async freezeWhile<T>(ctx: CallContext, images: readonly string[], fn: () => Promise<T>): Promise<T> {
    const points = await mountPointsOf(images);
    const frozen: string[] = [];
    try {
      for (const p of points) {
        await ctx.run('fsfreeze', ['--freeze', p], { timeoutMs: 60_000, detached: true });
        frozen.push(p);
      }
      if (frozen.length > 0) ctx.log.info({ frozen }, 'froze filesystems for a consistent copy');
      return await fn();
    } finally {
      for (const p of frozen.reverse()) {
        await ctx
          .run('fsfreeze', ['--unfreeze', p], { timeoutMs: 60_000, detached: true })
          .catch((err: unknown) => {
            ctx.log.error(
              { mountPoint: p, err },
              'could not thaw a filesystem; run fsfreeze --unfreeze on it',
            );
          });
      }
    }
  }
}

/** A freezer for processes that cannot see node mounts (the controller in its own pod). */
export class NoFreezer implements Freezer {
  async freezeWhile<T>(_ctx: CallContext, _images: readonly string[], fn: () => Promise<T>): Promise<T> {
    return fn();
  }
}

/**
 * Thaws every filesystem of the pool mounted on this host. A process killed while it held a freeze
 * would leave applications blocked forever; the next start ends that. Thawing what is not frozen is
 * harmless (fsfreeze fails and is ignored).
 */
export async function thawPoolFilesystems(ctx: CallContext, poolRoot: string): Promise<number> {
  const mounts = await readMounts();
  let thawed = 0;
  for (const loop of await listLoops()) {
    if (!loop.backingFile.startsWith(`${poolRoot}/`)) continue;
    const m = mounts.find((x) => x.source === loop.path && !isReadOnlyMount(x));
    if (!m) continue;
    try {
      await ctx.run('fsfreeze', ['--unfreeze', m.mountPoint], { timeoutMs: 30_000, quiet: true });
      thawed++;
      ctx.log.warn({ mountPoint: m.mountPoint }, 'thawed a filesystem left frozen by an earlier run');
    } catch {
      // not frozen: nothing to do
    }
  }
  return thawed;
}
