/**
 * Room to free room: a pool filled to its last block (a sparse volume's pod wrote until ENOSPC) must
 * still let the calls that free space run, and each of them writes first: a lock file, a record, the
 * fence file rewritten beside itself. On ext4 and btrfs not one of those fits, so without this every
 * DeleteVolume, DeleteSnapshot, unpublish and unstage answered RESOURCE_EXHAUSTED for good.
 *
 * The pool keeps `reserve`, a file of RESERVE_BYTES of written (random, so incompressible) blocks. A
 * call that frees space and fails for lack of it gives the reserve back (truncates it) and runs once
 * more (csi/space.ts). The reserve is written again when the pool has room. Every process on the pool
 * (controllers, node plugins of a shared pool) shares the one file.
 *
 * A shared pool is writable by more than the driver: the file is opened without following a link, and
 * used only when it is a regular file with no other name (never a planted symlink or hard link to
 * another file, which a truncation would empty).
 */
import { randomFillSync } from 'node:crypto';
import { constants } from 'node:fs';
import fs, { type FileHandle } from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import { errnoCode, isNoSpace } from '../errors.js';

export const RESERVE_FILE = 'reserve';
export const RESERVE_BYTES = 4 * 1024 * 1024;
/** Written again only with this many times its size free: never the last blocks a pod is asking for. */
const REFILL_HEADROOM = 8;
/** What a reserve lent to a call is taken back by, as far as the pool has room. */
const CHUNK_BYTES = 64 * 1024;

export class SpaceReserve {
  private readonly file: string;
  private refilling: Promise<void> | undefined;
  /** Not known to be whole: given back, or last left unwritten (no room, an error). */
  private short = true;
  /**
   * Given back by this process and not whole since: what is free is taken back at once, up to its size,
   * without headroom. Left free, the blocks a call that freed space was lent went to the next writer
   * (a stage's mkfs), and the next such call found none.
   */
  private lent = false;
  /** Calls of this process running on the reserve lent to them (csi/space.ts). */
  private borrowers = 0;
  private queue: Promise<unknown> = Promise.resolve();

  /** `present` throws unless the pool is still there (a reserve is never written into a bare mount point). */
  constructor(
    root: string,
    private readonly log: Logger,
    private readonly present: () => Promise<void>,
  ) {
    this.file = path.join(root, RESERVE_FILE);
  }

  /**
   * refill() when this process last found the reserve short, else nothing (the calls that free space
   * end with this: on their path it costs no file operation; the periodic refill() sees the others').
   */
  refillIfShort(): Promise<void> {
    return this.short ? this.refill() : Promise.resolve();
  }

  /** Writes the reserve when it is not whole and the pool has room for it; never fails. */
  refill(): Promise<void> {
    this.refilling ??= this.write()
      .catch((err: unknown) => {
        this.log.debug({ err, file: this.file }, "could not write the pool's space reserve; trying later");
      })
      .finally(() => {
        this.refilling = undefined;
      });
    return this.refilling;
  }

  private async write(): Promise<void> {
    this.short = true;
    await this.present();
    const whole = await this.serially(() =>
      this.withFile(true, async (h, held) => {
        if (held >= RESERVE_BYTES) return true;
        // With room, written whole (a hole another process's give-back left is filled too); without,
        // only one lent to a call is taken back, as far as there is room.
        const st = await fs.statfs(path.dirname(this.file));
        if (st.bavail * st.bsize < REFILL_HEADROOM * RESERVE_BYTES) return this.lent && this.takeBack(h);
        const bytes = randomFillSync(Buffer.allocUnsafe(RESERVE_BYTES));
        await h.write(bytes, 0, RESERVE_BYTES, 0);
        await h.truncate(RESERVE_BYTES);
        await h.sync();
        return true;
      }),
    );
    this.short = whole !== true;
    if (whole === true) this.lent = false;
  }

  /**
   * Lengthens the reserve a chunk at a time for as long as the pool has room and no call it was lent
   * to (in this process) runs, which may need every block; true once it holds all its blocks. What it
   * holds is never cut, nor written again (btrfs would need new blocks for it).
   */
  private async takeBack(h: FileHandle): Promise<boolean> {
    const chunk = randomFillSync(Buffer.allocUnsafe(CHUNK_BYTES));
    let size = (await h.stat()).size;
    while (size < RESERVE_BYTES && this.borrowers === 0) {
      const wrote = await h.write(chunk, 0, Math.min(CHUNK_BYTES, RESERVE_BYTES - size), size).then(
        (r) => r.bytesWritten,
        (err: unknown) => {
          if (isNoSpace(err)) return 0;
          throw err;
        },
      );
      if (wrote === 0) break;
      size += wrote;
    }
    await h.sync();
    return (await h.stat()).blocks * 512 >= RESERVE_BYTES;
  }

  /** File operations on the reserve one at a time: a give-back never lands inside a take-back. */
  private serially<T>(op: () => Promise<T>): Promise<T> {
    const run = this.queue.then(op, op);
    this.queue = run.catch(() => undefined);
    return run;
  }

  /** Runs `step`, a call the reserve is lent to: the reserve is not taken back meanwhile. */
  async lending<T>(step: () => Promise<T>): Promise<T> {
    this.borrowers++;
    try {
      return await step();
    } finally {
      this.borrowers--;
    }
  }

  /** Frees the reserve's blocks; false when it held none (given back already, or never written). */
  async giveBack(): Promise<boolean> {
    const freed = await this.serially(() =>
      this.withFile(false, async (h, held) => {
        if (held === 0) return false;
        await h.truncate(0);
        return true;
      }),
    );
    this.short = true;
    if (freed) {
      this.lent = true;
      this.log.warn(
        { file: this.file },
        'the pool is full: gave back its space reserve so that a call freeing space can run',
      );
    }
    return freed === true;
  }

  /** `fn` on the reserve, opened without following links, with its allocated bytes; undefined if absent. */
  private async withFile<T>(
    create: boolean,
    fn: (h: FileHandle, heldBytes: number) => Promise<T>,
  ): Promise<T | undefined> {
    const flags = constants.O_RDWR | constants.O_NOFOLLOW | (create ? constants.O_CREAT : 0);
    const foreign = (): void => {
      this.log.warn(
        { file: this.file },
        "the pool's space reserve is not a regular file of its own (a link, or another kind); left alone",
      );
    };
    let h: FileHandle;
    try {
      h = await fs.open(this.file, flags, 0o600);
    } catch (err) {
      const code = errnoCode(err);
      if (code === 'ELOOP' || code === 'EISDIR') {
        foreign();
        return undefined;
      }
      if (!create && code === 'ENOENT') return undefined;
      throw err;
    }
    try {
      const st = await h.stat();
      if (!st.isFile() || st.nlink !== 1) {
        foreign();
        return undefined;
      }
      return await fn(h, st.blocks * 512);
    } finally {
      await h.close();
    }
  }
}
