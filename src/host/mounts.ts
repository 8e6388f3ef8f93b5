/**
 * The mount table as the kernel sees it (/proc/self/mountinfo): the truth about what is staged and
 * published on this host, whatever our own files say.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { CallContext } from '../server/call.js';
import { errnoCode } from '../errors.js';
import { CommandError } from '../exec/runner.js';

export interface MountEntry {
  id: number;
  parent: number;
  majorMinor: string;
  /** The path inside the mounted filesystem that is mounted here ("/" for a whole filesystem). */
  root: string;
  mountPoint: string;
  options: string[];
  fsType: string;
  source: string;
  superOptions: string[];
}

/** Undoes mountinfo's octal escapes (\040 for a space, \011, \012, \134). */
export function unescapeMountPath(s: string): string {
  return s.replace(/\\([0-7]{3})/g, (_, oct: string) => String.fromCharCode(parseInt(oct, 8)));
}

export function parseMountInfo(text: string): MountEntry[] {
  const out: MountEntry[] = [];
  for (const line of text.split('\n')) {
    if (!line) continue;
    const fields = line.split(' ');
    const sep = fields.indexOf('-', 6);
    if (sep < 0 || fields.length < sep + 3) continue;
    const [id, parent, majorMinor, root, mountPoint, options] = fields;
    if (!id || !parent || !majorMinor || !root || !mountPoint || !options) continue;
    out.push({
      id: Number(id),
      parent: Number(parent),
      majorMinor,
      root: unescapeMountPath(root),
      mountPoint: unescapeMountPath(mountPoint),
      options: options.split(','),
      fsType: fields[sep + 1] ?? '',
      source: unescapeMountPath(fields[sep + 2] ?? ''),
      superOptions: (fields[sep + 3] ?? '').split(','),
    });
  }
  return out;
}

export async function readMounts(): Promise<MountEntry[]> {
  return parseMountInfo(await fs.readFile('/proc/self/mountinfo', 'utf8'));
}

/** The mounts stacked on `mountPoint`, the visible (last mounted) one last. */
export function mountsAt(mounts: readonly MountEntry[], mountPoint: string): MountEntry[] {
  return mounts.filter((m) => m.mountPoint === mountPoint);
}

export const isReadOnlyMount = (m: MountEntry): boolean => m.options.includes('ro');

/**
 * An absolute, normalized path with symlinks in its existing part resolved, so it compares equal to
 * what mountinfo shows. The path itself need not exist.
 */
export async function canonicalPath(p: string): Promise<string> {
  const normal = path.resolve(p);
  try {
    return await fs.realpath(normal);
  } catch (err) {
    const code = errnoCode(err);
    if (code !== 'ENOENT' && code !== 'ENOTDIR' && code !== 'ENOTCONN' && code !== 'ESTALE' && code !== 'EIO')
      throw err;
  }
  const parent = path.dirname(normal);
  if (parent === normal) return normal;
  return path.join(await canonicalPath(parent), path.basename(normal));
}

/**
 * Unmounts every mount stacked on `mountPoint` (a path that is not mounted is fine) and returns the
 * mount table as it is afterwards. `table` is a mount table just read, to save reading it again.
 */
export async function unmountAll(
  ctx: CallContext,
  mountPoint: string,
  table?: MountEntry[],
): Promise<MountEntry[]> {
  let current = table ?? (await readMounts());
  for (let round = 0; round < 4; round++) {
    const stacked = mountsAt(current, mountPoint).length;
    if (stacked === 0) return current;
    for (let i = 0; i < stacked; i++) {
      try {
        await ctx.run('umount', [mountPoint], { timeoutMs: 120_000 });
      } catch (err) {
        // A mount that vanished between our look and umount is what we wanted.
        if (!(err instanceof CommandError && /not mounted|no mount point/i.test(err.stderr))) throw err;
      }
    }
    current = await readMounts();
  }
  throw new Error(`${mountPoint} is still mounted after repeated unmounts`);
}
