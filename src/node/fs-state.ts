/**
 * A mounted filesystem that stopped answering: the kernel shut it down after I/O errors (xfs: every
 * look at its files fails with EIO; ext4: its mount shows `shutdown`, on recent kernels only: 6.18
 * does, 5.10 and 6.1 do not). statfs still answers for both, so sizes alone would call it healthy. It
 * can still be unmounted; staging it again checks it.
 */
import { conflict } from '../errors.js';
import type { MountEntry, PathKind } from '../host/host.js';
import type { NodeDeps } from './on-host.js';

/**
 * An ext4 that recorded an error since the stage's check (which clears the count): mounted
 * errors=remount-ro, as the driver mounts it, it stopped there, and on 6.1 nothing in its mount shows
 * it (no `ro`, no `shutdown`; the kernel sets its shutdown flag). Under errors=continue it keeps
 * running, but a filesystem with an error found since its check is not handed to another pod until
 * the next stage checks it either. Not a read-only staging (a read-only mount of a read-only
 * superblock): it is never checked, so its count may be old. One an error turned `ro` (5.10) is still
 * mounted read-write.
 */
function ext4Stopped(d: NodeDeps, m: MountEntry): boolean {
  const o = m.superOptions;
  if (m.fsType !== 'ext4' || o.includes('errors=continue')) return false;
  if (o.includes('ro') && m.options.includes('ro')) return false;
  return d.host.ext4Errors(m.source) > 0;
}

/** Whether mount `m`'s filesystem stopped answering; `kind`: what its mount point is, when just read. */
export const isDead = async (d: NodeDeps, m: MountEntry, kind?: PathKind): Promise<boolean> =>
  m.superOptions.includes('shutdown') ||
  ext4Stopped(d, m) ||
  (kind ?? (await d.host.pathKind(m.mountPoint))) === 'unreachable';

/** Refuses to use (publish, grow, answer a repeat stage for) a filesystem that stopped answering. */
export async function refuseDeadFilesystem(d: NodeDeps, id: string, m: MountEntry): Promise<void> {
  if (!(await isDead(d, m))) return;
  throw conflict(
    `The filesystem of volume ${id} at ${m.mountPoint} does not answer (the kernel stopped it after I/O or consistency errors); unpublish and unstage it, then stage it again, which checks it.`,
  );
}
