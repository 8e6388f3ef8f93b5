/**
 * Disk image files: made sparse or preallocated, grown, and copied — by reflink (FICLONE: O(1) in time
 * and space) where the pool filesystem shares extents, otherwise by a sparse-aware copy that reads and
 * writes only the allocated extents (cp walks them with SEEK_DATA/SEEK_HOLE). Never a byte-for-byte
 * copy that fills the holes.
 */
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import { errnoCode } from '../errors.js';
import type { CallContext } from '../server/call.js';

export type CopyMethod = 'reflink' | 'sparse-copy';

/** Copies can be long; they run to the end even when the RPC that started them is cancelled. */
const COPY_TIMEOUT_MS = 6 * 60 * 60 * 1000;

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

/** Reserves the blocks of [offset, offset+length) so writes there cannot fail for lack of space. */
export async function preallocate(
  ctx: CallContext,
  file: string,
  offset: number,
  length: number,
): Promise<void> {
  if (length <= 0) return;
  await ctx.run('fallocate', ['--offset', String(offset), '--length', String(length), file], {
    timeoutMs: 10 * 60 * 1000,
  });
  await syncFile(file);
}

/** Grows an image to `size` bytes (never shrinks), keeping preallocated images preallocated. */
export async function growImage(
  ctx: CallContext,
  file: string,
  size: number,
  preallocated: boolean,
): Promise<void> {
  const st = await fs.stat(file);
  if (st.size >= size) return;
  if (preallocated) {
    await preallocate(ctx, file, st.size, size - st.size); // fallocate extends the file too
  }
  const handle = await fs.open(file, 'r+');
  try {
    await handle.truncate(size);
    await handle.sync();
  } finally {
    await handle.close();
  }
}

const NO_REFLINK = new Set(['ENOTSUP', 'EOPNOTSUPP', 'EXDEV', 'EINVAL', 'ENOSYS', 'ENOTTY', 'EBADF']);

/**
 * Copies image `src` to `dst` (which must not exist) and makes it durable. Returns how it copied.
 */
export async function copyImage(ctx: CallContext, src: string, dst: string): Promise<CopyMethod> {
  let method: CopyMethod = 'reflink';
  try {
    await fs.copyFile(src, dst, constants.COPYFILE_FICLONE_FORCE | constants.COPYFILE_EXCL);
  } catch (err) {
    const code = errnoCode(err);
    if (code === undefined || !NO_REFLINK.has(code)) throw err;
    await fs.rm(dst, { force: true });
    method = 'sparse-copy';
    await ctx.run('cp', ['--sparse=always', '--reflink=never', '--no-preserve=all', '--', src, dst], {
      detached: true,
      timeoutMs: COPY_TIMEOUT_MS,
    });
  }
  await syncFile(dst);
  return method;
}

/** Bytes the file really occupies on disk. */
export async function allocatedBytes(file: string): Promise<number> {
  const st = await fs.stat(file);
  return st.blocks * 512;
}
