/**
 * Paths on the host: what a path really names (symlinks resolved, the way mountinfo shows it), which
 * file a path is (device and inode: what cannot change under us), and removing only what the driver
 * itself created.
 */
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { conflict, errnoCode } from '../errors.js';

/** A file's identity: the device it lives on (major:minor) and its inode number. */
export interface FileId {
  dev: string;
  ino: string;
}

export const sameFile = (a: FileId | undefined, b: FileId | undefined): boolean =>
  a !== undefined && b !== undefined && a.dev === b.dev && a.ino === b.ino;

/** glibc's encoding of st_dev → "major:minor". */
export function devToMajorMinor(dev: bigint): string {
  const major = ((dev >> 8n) & 0xfffn) | ((dev >> 32n) & ~0xfffn);
  const minor = (dev & 0xffn) | ((dev >> 12n) & ~0xffn);
  return `${major}:${minor}`;
}

/**
 * The identity of the regular file `p` names, or undefined when there is none. A symlink there is not
 * followed (it is none): the images this names are the pool's, and one planted in a shared pool would
 * make another volume's devices, or another pool's, look like this one's.
 */
export async function fileId(p: string): Promise<FileId | undefined> {
  try {
    const st = await fs.lstat(p, { bigint: true });
    if (!st.isFile()) return undefined;
    return { dev: devToMajorMinor(st.dev), ino: st.ino.toString() };
  } catch (err) {
    const code = errnoCode(err);
    if (code === 'ENOENT' || code === 'ENOTDIR') return undefined;
    throw err;
  }
}

/**
 * `p` normalized and without a trailing slash: lstat of "link/" follows the link, so a symlink there
 * would pass for the directory it points to.
 */
export function normalPath(p: string): string {
  const normal = path.normalize(p);
  return normal.length > 1 ? normal.replace(/\/+$/, '') : normal;
}

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
    if (code !== 'ENOENT' && code !== 'ENOTDIR' && !doesNotAnswer(code)) throw err;
  }
  const parent = path.dirname(normal);
  if (parent === normal) return normal;
  return path.join(await canonicalPath(parent), path.basename(normal));
}

/**
 * The errors of a path on a filesystem that is mounted but no longer answers: shut down by the kernel
 * after I/O errors (xfs, ext4), or a network or FUSE mount whose server is gone. Such a mount can
 * still be unmounted.
 */
export const doesNotAnswer = (code: string | undefined): boolean =>
  code === 'EIO' || code === 'ENOTCONN' || code === 'ESTALE';

/**
 * What is at a path, not following a symlink there. `unreachable`: the path's filesystem does not
 * answer (see doesNotAnswer); a symlink is read from its parent directory, so a mount point whose own
 * filesystem died is never taken for one.
 */
export type PathKind = 'absent' | 'directory' | 'empty-file' | 'file' | 'symlink' | 'other' | 'unreachable';

export async function pathKind(p: string): Promise<PathKind> {
  let st;
  try {
    st = await fs.lstat(p);
  } catch (err) {
    const code = errnoCode(err);
    if (code === 'ENOENT' || code === 'ENOTDIR') return 'absent';
    if (doesNotAnswer(code)) return 'unreachable';
    throw err;
  }
  if (st.isSymbolicLink()) return 'symlink';
  if (st.isDirectory()) return 'directory';
  if (st.isFile()) return st.size === 0 ? 'empty-file' : 'file';
  return 'other';
}

/** True when `p` is a directory holding anything: a mount there would hide it. */
export async function holdsEntries(p: string): Promise<boolean> {
  let dir;
  try {
    dir = await fs.opendir(p);
  } catch (err) {
    const code = errnoCode(err);
    if (code === 'ENOENT' || code === 'ENOTDIR') return false;
    if (doesNotAnswer(code))
      throw conflict(`${p} cannot be read (${code}): the filesystem mounted there does not answer.`, err);
    throw err;
  }
  try {
    return (await dir.read()) !== null;
  } finally {
    await dir.close();
  }
}

/** The size in bytes of the file `p` names. */
export async function fileSize(p: string): Promise<number> {
  return (await fs.stat(p)).size;
}

export async function makeDir(p: string): Promise<void> {
  await fs.mkdir(p, { recursive: true, mode: 0o750 });
}

/** Creates an empty file (a block volume's bind target) unless something is there: true when it made it. */
export async function createFile(p: string): Promise<boolean> {
  try {
    const handle = await fs.open(p, 'wx', 0o660);
    await handle.close();
    return true;
  } catch (err) {
    if (errnoCode(err) === 'EEXIST') return false;
    throw err;
  }
}

/**
 * Removes what publish or stage created at `p`, and only that: an empty directory, or the empty regular
 * file a block volume is bound onto. A non-empty directory or file, a symlink (never its target), a
 * device node or a socket is left in place and reported as a conflict: the driver did not make it.
 */
export async function removeCreated(p: string): Promise<'removed' | 'absent'> {
  const kind = await pathKind(p);
  switch (kind) {
    case 'absent':
      return 'absent';
    case 'directory':
      try {
        await fs.rmdir(p);
      } catch (err) {
        const code = errnoCode(err);
        if (code === 'ENOENT') return 'absent';
        if (code === 'ENOTEMPTY' || code === 'EEXIST') {
          throw conflict(
            `${p} is not empty after unmounting; it holds files written beside the volume, so it was left in place.`,
          );
        }
        throw err;
      }
      return 'removed';
    case 'empty-file':
      await fs.unlink(p).catch((err: unknown) => {
        if (errnoCode(err) !== 'ENOENT') throw err;
      });
      return 'removed';
    case 'file':
      throw conflict(
        `${p} is a file that holds data; the driver only removes what it created, so it was left in place.`,
      );
    case 'symlink':
      throw conflict(`${p} is a symbolic link, which the driver never creates; it was left in place.`);
    case 'other':
      throw conflict(`${p} is neither a directory nor a regular file; it was left in place.`);
    case 'unreachable':
      throw conflict(`${p} cannot be read (its filesystem does not answer); it was left in place.`);
  }
}

/**
 * True when a block device is claimed exclusively (a filesystem's superblock holds it), whether or not
 * a mount of it is visible here: a frozen filesystem that was unmounted still holds its device.
 */
export async function isClaimed(device: string): Promise<boolean> {
  try {
    const handle = await fs.open(device, constants.O_RDONLY | constants.O_EXCL);
    await handle.close();
    return false;
  } catch (err) {
    if (errnoCode(err) === 'EBUSY') return true;
    throw err;
  }
}
