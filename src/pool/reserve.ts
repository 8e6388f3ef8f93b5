/**
 * Room to free room: a pool filled to its last block (a sparse volume's pod wrote until ENOSPC) must
 * still let the calls that free space run, and each of them writes first: a lock file, a record, the
 * fence file rewritten beside itself. On ext4 and btrfs not one of those fits, so without this every
 * DeleteVolume, DeleteSnapshot, unpublish and unstage answered RESOURCE_EXHAUSTED for good.
 *
 * The pool keeps `reserve`, a file of RESERVE_BYTES of written blocks. A call that frees space and
 * fails for lack of it gives the reserve back (truncates it) and runs once more: its steps are
 * idempotent, as a CO's retry would find them. The reserve is written again when the pool has room.
 * Every process on the pool (controllers, node plugins of a shared pool) shares the one file.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';

export const RESERVE_FILE = 'reserve';
export const RESERVE_BYTES = 4 * 1024 * 1024;
/** Written again only with this many times its size free: never the last blocks a pod is asking for. */
const REFILL_HEADROOM = 8;

export class SpaceReserve {
  private readonly file: string;
  private refilling: Promise<void> | undefined;

  constructor(
    root: string,
    private readonly log: Logger,
  ) {
    this.file = path.join(root, RESERVE_FILE);
  }

  /** Writes the reserve when it is not whole and the pool has room for it; never fails. */
  refill(): Promise<void> {
    this.refilling ??= this.write()
      .catch((err: unknown) => {
        this.log.debug({ err, file: this.file }, 'could not write the pool’s space reserve; trying later');
      })
      .finally(() => {
        this.refilling = undefined;
      });
    return this.refilling;
  }

  private async write(): Promise<void> {
    const held = await fs.stat(this.file).then(
      (st) => st.blocks * 512,
      () => 0,
    );
    if (held >= RESERVE_BYTES) return;
    const st = await fs.statfs(path.dirname(this.file));
    if (st.bavail * st.bsize < REFILL_HEADROOM * RESERVE_BYTES) return;
    const h = await fs.open(this.file, 'w', 0o600);
    try {
      await h.write(Buffer.alloc(RESERVE_BYTES, 0x72), 0, RESERVE_BYTES, 0);
      await h.sync();
    } finally {
      await h.close();
    }
  }

  /** Frees the reserve's blocks; false when it held none (given back already, or never written). */
  async giveBack(): Promise<boolean> {
    const held = await fs.stat(this.file).then(
      (st) => st.blocks > 0,
      () => false,
    );
    if (!held) return false;
    await fs.truncate(this.file, 0);
    this.log.warn(
      { file: this.file },
      'the pool is full: gave back its space reserve so that a call freeing space can run',
    );
    return true;
  }
}
