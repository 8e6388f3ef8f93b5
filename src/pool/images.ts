/**
 * Disk image files: made sparse or preallocated, grown, and copied — by reflink (FICLONE: O(1) in time
 * and space) where the pool filesystem shares extents, otherwise by a sparse-aware copy that reads and
 * writes only the allocated extents (cp walks them with SEEK_DATA/SEEK_HOLE). Never a byte-for-byte
 * copy that fills the holes.
 */
import { randomBytes } from 'node:crypto';
import { constants } from 'node:fs';
import fs, { type FileHandle } from 'node:fs/promises';
import { busy, conflict, errnoCode, invalid, unsafe } from '../errors.js';
import { CommandError, type Exec } from '../exec/runner.js';
import { type CopyPurpose, telemetry } from '../telemetry.js';
import type { HeldLock } from './lock.js';
import { isSectorSize } from './types.js';

export type CopyMethod = 'reflink' | 'sparse-copy';

/** Copies can be long; they run to the end even when the RPC that started them is cancelled. */
const COPY_TIMEOUT_MS = 6 * 60 * 60 * 1000;
/** How often a byte copy logs how far it got. */
const COPY_PROGRESS_MS = 10_000;

/**
 * Opens an image of the pool for reading (or writing): a regular file reached through no symlink.
 * Anyone who can write to a shared pool could plant a symlink to a host file or a device there, or a
 * FIFO (opened without blocking). Commands then work on `pinnedPath` of the handle: the file checked,
 * whatever the path leads to by then.
 */
export async function openImage(file: string, write = false): Promise<FileHandle> {
  const flags = (write ? constants.O_RDWR : constants.O_RDONLY) | constants.O_NOFOLLOW | constants.O_NONBLOCK;
  let handle: FileHandle;
  try {
    handle = await fs.open(file, flags);
  } catch (err) {
    // A symlink (ELOOP), or a socket (ENXIO), in its place.
    if (errnoCode(err) === 'ELOOP' || errnoCode(err) === 'ENXIO') throw notAnImage(file);
    throw err;
  }
  try {
    const [st, real] = await Promise.all([handle.stat(), fs.readlink(`/proc/self/fd/${handle.fd}`)]);
    if (st.isFile() && real === file) return handle;
  } catch (err) {
    await handle.close();
    throw err;
  }
  await handle.close();
  throw notAnImage(file);
}

/** A path that reaches the file `handle` opened, for a command this process runs. */
export const pinnedPath = (handle: FileHandle): string => `/proc/${process.pid}/fd/${handle.fd}`;

export const notAnImage = (file: string) =>
  unsafe(
    `${file} is not a regular file of the pool (a symlink, a device or a FIFO in its place); it was left alone.`,
  );

/** Runs `use` on image `file` opened by openImage, then closes it. */
export async function withImage<T>(
  file: string,
  write: boolean,
  use: (h: FileHandle) => Promise<T>,
): Promise<T> {
  const handle = await openImage(file, write);
  try {
    return await use(handle);
  } finally {
    await handle.close();
  }
}

async function syncFile(file: string): Promise<void> {
  const handle = await fs.open(file, 'r+');
  try {
    await handle.sync();
  } finally {
    await handle.close();
  }
}

/** Creates `file` (which must not exist) as a sparse image of `size` bytes, durably. */
export async function createSparseImage(file: string, size: number): Promise<void> {
  const handle = await fs.open(file, 'wx', 0o600);
  try {
    await handle.truncate(size);
    await handle.sync();
  } finally {
    await handle.close();
  }
}

/**
 * Reserves the blocks of [offset, offset+length) so writes there cannot fail for lack of space; stopped
 * when `lock` (the volume's) is lost, not by the caller, and not begun once it is.
 */
export async function preallocate(
  x: Exec,
  file: string,
  offset: number,
  length: number,
  lock?: HeldLock,
): Promise<void> {
  if (length <= 0) return;
  await withImage(file, true, (h) => {
    lock?.assertHeld();
    return reserveBlocks(x, h, offset, length, lock?.signal);
  });
}

/**
 * fallocate on the image `h` holds open, then synced. It runs to its end, as a copy does: one killed at
 * the caller's deadline threw away the whole copy before it (a restore or clone longer than the
 * provisioner's timeout was made again at every retry, and never finished).
 */
async function reserveBlocks(
  x: Exec,
  h: FileHandle,
  offset: number,
  length: number,
  signal?: AbortSignal,
  keepSize = false,
): Promise<void> {
  const range = ['--offset', String(offset), '--length', String(length)];
  try {
    await x.run('fallocate', [...(keepSize ? ['--keep-size'] : []), ...range, pinnedPath(h)], {
      detached: true,
      diesWithProcess: true,
      timeoutMs: 10 * 60 * 1000,
      ...(signal ? { signal } : {}),
    });
  } catch (err) {
    if (err instanceof CommandError && /not supported/i.test(err.stderr)) {
      throw invalid(
        "This pool's filesystem cannot reserve blocks (fallocate is not supported there, as on many network filesystems); use allocation: sparse.",
        err,
      );
    }
    throw err;
  }
  await h.sync();
}

/** Whether `lock` (none: nothing to lose) is still held, by the check a committing step makes. */
function stillHeld(lock: HeldLock | undefined): boolean {
  try {
    lock?.assertHeld();
    return true;
  } catch {
    return false;
  }
}

/**
 * Grows an image to `size` bytes (never shrinks), keeping preallocated images preallocated. `lock`, the
 * volume's, is checked right before the length is set: a process that lost it (stalled past its lease)
 * must not set back an image another process grew meanwhile, and the pod's data written past `size`.
 */
export async function growImage(
  x: Exec,
  file: string,
  size: number,
  preallocated: boolean,
  lock?: HeldLock,
): Promise<void> {
  await withImage(file, true, async (h) => {
    const st = await h.stat();
    if (st.size >= size) return;
    // The blocks are reserved past the end first, and the image made longer only once they all are: a
    // fallocate that fails midway (ENOSPC) or is killed leaves the length, which nodes grow their
    // filesystems to, as it was. A sparse image is only made longer.
    if (preallocated) {
      try {
        await reserveBlocks(x, h, st.size, size - st.size, lock?.signal, true);
      } catch (err) {
        // What it did reserve is given back: a truncate to the length the image had frees the blocks
        // past it. Not once the lock is lost, nor when the length changed: another holder may be
        // growing the image.
        const now = (await h.stat()).size;
        if (now === st.size && stillHeld(lock)) await h.truncate(now);
        throw err;
      }
    }
    const now = (await h.stat()).size;
    lock?.assertHeld();
    if (now < size) await h.truncate(size);
    await h.sync();
  });
}

/**
 * Makes every block of `file` its own: a reflinked file shares its extents with its source until they
 * are written, so a pool that fills up makes its writes fail (ENOSPC) however it was preallocated. It
 * is rewritten by a byte copy beside it (every block written, none shared), synced and renamed over it.
 * Only for a file nobody else uses yet (a new volume's image before it is ready).
 */
export async function ownBlocks(x: Exec, file: string, lock?: HeldLock): Promise<void> {
  const signal = lock?.signal;
  // A name of this attempt's own: a process that lost the lock never touches the next holder's copy.
  const own = `${file}.own-${randomBytes(6).toString('hex')}`;
  try {
    await withImage(file, false, (h) =>
      intoNewFile(own, async (dst) => {
        const src = pinnedPath(h);
        await x.run('cp', ['--sparse=never', '--reflink=never', '--no-preserve=all', '--', src, dst], {
          detached: true,
          diesWithProcess: true,
          timeoutMs: COPY_TIMEOUT_MS,
          ...(signal ? { signal } : {}),
        });
      }),
    );
    lock?.assertHeld(); // the names are another's once the lock is lost
    await fs.rename(own, file);
  } finally {
    await fs.rm(own, { force: true });
  }
}

/**
 * Creates `file` (O_EXCL: a symlink planted there is not followed, it fails), lets `write` fill it
 * through a pinned path, and syncs it.
 */
async function intoNewFile(file: string, write: (pinned: string) => Promise<void>): Promise<void> {
  const handle = await fs.open(file, 'wx', 0o600);
  try {
    await write(pinnedPath(handle));
    await handle.sync();
  } finally {
    await handle.close();
  }
}

/** errno codes that mean "this filesystem cannot clone these files by reflink". */
export const NO_REFLINK = new Set(['ENOTSUP', 'EOPNOTSUPP', 'EXDEV', 'EINVAL', 'ENOSYS', 'ENOTTY', 'EBADF']);

export interface CopyOptions {
  /**
   * Whether a byte copy may stand in when a reflink is impossible. A byte copy takes time, so it is
   * only a point-in-time copy while nothing writes the source; callers that cannot promise that say no.
   */
  allowCopy: boolean;
  /** Stops a byte copy when the lock it is made under is lost (ABORTED; the copy is incomplete). */
  signal?: AbortSignal;
  /** Upper bound for a byte copy. */
  timeoutMs?: number;
  /** What the copy is for (the copy metrics' label). */
  purpose?: CopyPurpose;
  /**
   * Called with the bytes a byte copy is about to write, before it writes them (it may throw to refuse
   * it: a snapshot's blocks are admitted against the pool's space, capacity.ts).
   */
  admitByteCopy?: (bytes: number) => Promise<void>;
  /** How often a byte copy logs its progress (default 10 s). */
  progressMs?: number;
}

export interface CopyResult {
  method: CopyMethod;
  /** Bytes the copy read and wrote (allocated bytes of the source; 0 for a reflink). */
  bytes: number;
  seconds: number;
}

/**
 * Copies image `src` to `dst` (which must not exist) and makes it durable: by reflink when the pool
 * can, else (when allowed) by a sparse copy that runs to its end even when the RPC is cancelled (a
 * retry would redo it), unless `signal` stops it.
 */
export async function copyImage(x: Exec, src: string, dst: string, opts: CopyOptions): Promise<CopyResult> {
  const result = await withImage(src, false, (h) => copyImageOnce(x, src, pinnedPath(h), dst, opts));
  telemetry.copied(opts.purpose ?? 'snapshot', result.method, result.bytes, result.seconds);
  return result;
}

/** Copies `src`, read through `pinned` (the file openImage checked), to `dst`. */
async function copyImageOnce(
  x: Exec,
  src: string,
  pinned: string,
  dst: string,
  opts: CopyOptions,
): Promise<CopyResult> {
  const started = performance.now();
  try {
    await fs.copyFile(pinned, dst, constants.COPYFILE_FICLONE_FORCE | constants.COPYFILE_EXCL);
    await syncFile(dst);
    return { method: 'reflink', bytes: 0, seconds: (performance.now() - started) / 1000 };
  } catch (err) {
    const code = errnoCode(err);
    if (code === undefined || !NO_REFLINK.has(code)) throw err;
    await fs.rm(dst, { force: true });
    if (!opts.allowCopy) {
      throw conflict(
        `The pool could not clone ${src} by reflink (${code}), and a byte copy is not safe here.`,
      );
    }
  }
  const bytes = await allocatedBytes(pinned);
  await opts.admitByteCopy?.(bytes);
  const progress = logProgress(x, src, dst, bytes, started, opts.progressMs ?? COPY_PROGRESS_MS);
  try {
    await intoNewFile(dst, async (out) => {
      await x.run('cp', ['--sparse=always', '--reflink=never', '--no-preserve=all', '--', pinned, out], {
        detached: true,
        diesWithProcess: true,
        timeoutMs: opts.timeoutMs ?? COPY_TIMEOUT_MS,
        ...(opts.signal ? { signal: opts.signal } : {}),
      });
    });
  } catch (err) {
    // Stopped by `signal`: the lock it was made under was lost (another process took over), which is
    // not the caller cancelling.
    if (opts.signal?.aborted && err instanceof CommandError && err.reason === 'cancelled')
      throw busy(`Copying ${src} stopped: this process lost its lock on it to another; retry.`, err);
    throw err;
  } finally {
    clearInterval(progress);
  }
  return { method: 'sparse-copy', bytes, seconds: (performance.now() - started) / 1000 };
}

/**
 * Logs a byte copy's progress every `everyMs`: what the destination holds so far (its allocated bytes,
 * read from the pool: cp writes only the source's allocated extents), of how much, and how fast.
 */
function logProgress(
  x: Exec,
  src: string,
  dst: string,
  totalBytes: number,
  started: number,
  everyMs: number,
): NodeJS.Timeout {
  const timer = setInterval(() => {
    allocatedBytes(dst).then(
      (copiedBytes) => {
        const seconds = (performance.now() - started) / 1000;
        const done = Math.min(copiedBytes, totalBytes);
        x.log.info(
          {
            source: src,
            target: dst,
            copiedBytes: done,
            totalBytes,
            percent: totalBytes > 0 ? Math.floor((done / totalBytes) * 100) : 100,
            bytesPerSecond: seconds > 0 ? Math.round(done / seconds) : 0,
            seconds: Math.round(seconds),
          },
          'copying image',
        );
      },
      () => undefined, // not there yet, or already renamed: the next look (or the end) says
    );
  }, everyMs);
  timer.unref();
  return timer;
}

/** Bytes the file really occupies on disk. */
export async function allocatedBytes(file: string): Promise<number> {
  const st = await fs.stat(file);
  return st.blocks * 512;
}

/** The unit of the XFS (sector size) or ext2/3/4 (block size) an image holds; undefined for anything else. */
export async function filesystemUnit(h: FileHandle): Promise<number | undefined> {
  const buf = Buffer.alloc(EXT_SUPER + 64);
  const { bytesRead } = await h.read(buf, 0, buf.length, 0);
  let unit: number | undefined;
  if (bytesRead >= 104 && buf.toString('latin1', 0, 4) === 'XFSB') unit = buf.readUInt16BE(102);
  else if (bytesRead === buf.length && buf.readUInt16LE(EXT_SUPER + 56) === 0xef53)
    unit = 1024 * 2 ** Math.min(buf.readUInt32LE(EXT_SUPER + 24), 16);
  return isSectorSize(unit) ? unit : undefined;
}
/** Where an ext2/3/4 superblock starts (its magic at +56, log2(block size / 1024) at +24). */
const EXT_SUPER = 1024;
