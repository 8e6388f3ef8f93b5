/**
 * Freezing a mounted filesystem (fsfreeze) so that a copy of its device holds a clean filesystem, and
 * thawing it again. A freeze acts on the superblock, not on one mount: any mount of the same
 * superblock (mountinfo's major:minor) reaches it, so a thaw looks for one wherever it is mounted.
 */
import { CommandError, type Exec } from '../exec/runner.js';
import { isReadOnlyMount, type MountEntry, readMounts } from './mounts.js';

export async function freeze(x: Exec, mountPoint: string): Promise<void> {
  await x.run('fsfreeze', ['--freeze', mountPoint], { timeoutMs: 60_000 });
}

/** Thaws the filesystem mounted at `mountPoint`: true when it was frozen, false when it was not. */
export async function thaw(x: Exec, mountPoint: string): Promise<boolean> {
  try {
    await x.run('fsfreeze', ['--unfreeze', mountPoint], { timeoutMs: 60_000, quiet: true });
    return true;
  } catch (err) {
    // EINVAL: the filesystem is not frozen.
    if (err instanceof CommandError && err.reason === 'exit' && /invalid argument/i.test(err.stderr))
      return false;
    throw err;
  }
}

/**
 * Thaws the filesystem on `device` (a /dev/loopN path) through any mount of it in `table`. Returns false
 * when it is not frozen, undefined when no mount of it is left to reach it through.
 */
export async function thawDevice(
  x: Exec,
  device: string,
  table?: readonly MountEntry[],
): Promise<boolean | undefined> {
  const mounts = (table ?? (await readMounts())).filter((e) => e.source === device);
  const m = mounts.find((e) => !isReadOnlyMount(e)) ?? mounts[0];
  if (!m) return undefined;
  return thaw(x, m.mountPoint);
}
