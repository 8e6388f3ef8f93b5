/**
 * Where a volume can be put: checked before anything is attached, formatted or mounted, so that a path
 * that can never hold a mount is refused at once (FAILED_PRECONDITION) instead of failing half-way.
 */
import path from 'node:path';
import { conflict } from '../errors.js';
import type { PathKind } from '../host/host.js';
import type { NodeDeps } from './on-host.js';

const WHAT: Record<Exclude<PathKind, 'absent' | 'directory'>, string> = {
  file: 'a file',
  'empty-file': 'a file',
  symlink: 'a symbolic link',
  other: 'neither a file nor a directory',
  unreachable: 'on a filesystem that does not answer',
};

/**
 * Refuses `p` (the caller's `field`) unless it is a directory, or is absent below directories only, so
 * that the driver can create it as one. `p` is canonical (callerPath): no symlink leads to it.
 */
export async function refuseNonDirectory(d: NodeDeps, p: string, field: string): Promise<void> {
  for (let q = p; ; q = path.dirname(q)) {
    const kind = await d.host.pathKind(q);
    if (kind === 'directory') return;
    if (kind !== 'absent') {
      const where =
        q === p ? `${field} ${p} is ${WHAT[kind]}` : `${field} ${p} lies under ${q}, which is ${WHAT[kind]}`;
      throw conflict(`${where}; it must be a directory, or a path the driver can create as one.`);
    }
    if (path.dirname(q) === q) return;
  }
}
