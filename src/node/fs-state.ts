/**
 * A mounted filesystem that stopped answering: the kernel shut it down after I/O errors (xfs: every
 * look at its files fails with EIO; ext4: its mount shows `shutdown`, on recent kernels only: 6.18
 * does, 5.10 and 6.1 do not). statfs still answers for both, so sizes alone would call it healthy. It
 * can still be unmounted; staging it again checks it.
 */
import { conflict } from '../errors.js';
import type { MountEntry } from '../host/host.js';
import type { NodeDeps } from './on-host.js';

/**
 * Whether mount `m`'s filesystem stopped answering. An ext4 mounted errors=remount-ro stopped at its
 * first error: on 6.1 the kernel then sets its shutdown flag, which neither its mount (no `ro`, no
 * `shutdown`) nor lstat or statfs show; only the error count does.
 */
export const isDead = async (d: NodeDeps, m: MountEntry): Promise<boolean> =>
  m.superOptions.includes('shutdown') ||
  (m.fsType === 'ext4' && m.superOptions.includes('errors=remount-ro') && d.host.ext4Errors(m.source) > 0) ||
  (await d.host.pathKind(m.mountPoint)) === 'unreachable';

/** Refuses to use (publish, grow, answer a repeat stage for) a filesystem that stopped answering. */
export async function refuseDeadFilesystem(d: NodeDeps, id: string, m: MountEntry): Promise<void> {
  if (!(await isDead(d, m))) return;
  throw conflict(
    `The filesystem of volume ${id} at ${m.mountPoint} does not answer (the kernel stopped it after I/O or consistency errors); unpublish and unstage it, then stage it again, which checks it.`,
  );
}
