/**
 * What a pool's filesystem can do, found by trying it on files of its own (in trash/): clone by
 * reflink, hold a file of a given size, and how fast it has copied lately.
 */
import { randomBytes } from 'node:crypto';
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { errnoCode } from '../errors.js';
import { NO_REFLINK } from './images.js';
import type { PoolLayout } from './layout.js';

/** A cautious guess at sparse-copy speed until this process has measured one (100 MiB/s). */
const INITIAL_COPY_RATE = 100 * 2 ** 20;
const MIB = 2 ** 20;
/** How long an unfinished frozen copy keeps the estimate low (recordUnfinishedCopy). */
export const SLOW_COPY_MEMORY_MS = 15 * 60_000;

export class PoolFilesystem {
  private reflink: Promise<boolean> | undefined;
  private largest: Promise<number> | undefined;
  /** Bytes per second of recent sparse copies in this pool (an estimate for the freeze budget). */
  private copyRate = INITIAL_COPY_RATE;
  /** The speed a recent unfinished copy allows at most, and until when it is remembered. */
  private slow: { rate: number; until: number } | undefined;

  /**
   * `present` throws unless the pool is still there: a probe that finds no trash/ (a shared filesystem
   * unmounted under the driver) then says that, not "no such file".
   */
  constructor(
    private readonly layout: PoolLayout,
    private readonly present: () => Promise<void> = () => Promise.resolve(),
  ) {}

  /** `err`, or why the pool is not there when that is why the probe found no file. */
  private async whyMissing(err: unknown): Promise<never> {
    if (errnoCode(err) === 'ENOENT') await this.present();
    throw err;
  }

  /** Whether the pool's filesystem can clone files by reflink (probed once, with a file of its own). */
  canReflink(): Promise<boolean> {
    this.reflink ??= (async () => {
      const probe = path.join(this.layout.trashDir, `.reflink-probe-${randomBytes(6).toString('hex')}`);
      try {
        await fs.writeFile(probe, 'reflink probe\n').catch((err: unknown) => this.whyMissing(err));
        await fs.copyFile(
          probe,
          `${probe}.clone`,
          constants.COPYFILE_FICLONE_FORCE | constants.COPYFILE_EXCL,
        );
        return true;
      } catch (err) {
        const code = errnoCode(err);
        if (code !== undefined && NO_REFLINK.has(code)) return false;
        throw err;
      } finally {
        await fs.rm(probe, { force: true });
        await fs.rm(`${probe}.clone`, { force: true });
      }
    })();
    this.reflink.catch(() => {
      this.reflink = undefined;
    });
    return this.reflink;
  }

  /**
   * The largest file the pool's filesystem holds (ext4 with 4 KiB blocks: 16 TiB), found once by growing
   * a sparse probe file until the filesystem says EFBIG.
   */
  maxFileSize(): Promise<number> {
    this.largest ??= (async () => {
      const probe = path.join(this.layout.trashDir, `.size-probe-${randomBytes(6).toString('hex')}`);
      const handle = await fs.open(probe, 'wx', 0o600).catch((err: unknown) => this.whyMissing(err));
      const fits = async (n: number): Promise<boolean> => {
        try {
          await handle.truncate(n);
          return true;
        } catch (err) {
          const code = errnoCode(err);
          // EFBIG is the answer; network filesystems relay the server's refusal as EPERM and the like.
          if (code && ['EFBIG', 'EINVAL', 'EPERM', 'EOVERFLOW', 'ENOSPC', 'EDQUOT', 'EACCES'].includes(code))
            return false;
          throw err;
        }
      };
      try {
        if (await fits(Number.MAX_SAFE_INTEGER)) return Number.MAX_SAFE_INTEGER;
        // A filesystem that refuses even a small sparse file says nothing about sizes: no limit known.
        if (!(await fits(MIB))) return Number.MAX_SAFE_INTEGER;
        let lo = MIB; // fits
        let hi = Number.MAX_SAFE_INTEGER; // does not
        while (hi - lo > 4096) {
          const mid = lo + Math.floor((hi - lo) / 2);
          if (await fits(mid)) lo = mid;
          else hi = mid;
        }
        return lo;
      } finally {
        await handle.truncate(0).catch(() => undefined);
        await handle.close();
        await fs.rm(probe, { force: true });
      }
    })();
    this.largest.catch(() => {
      this.largest = undefined;
    });
    return this.largest;
  }

  /** Records how fast a sparse copy of `bytes` went, to judge the next one against the freeze budget. */
  recordCopy(bytes: number, seconds: number): void {
    if (bytes < 16 * 2 ** 20 || seconds <= 0) return;
    const rate = bytes / seconds;
    this.copyRate = Math.round(this.copyRate * 0.5 + rate * 0.5);
  }

  /**
   * A frozen copy of `bytes` was stopped unfinished at the end of a `budgetSeconds` freeze budget. For
   * the next SLOW_COPY_MEMORY_MS, copies are judged at half the speed that would have fit that budget,
   * so the next attempt at as many bytes is refused before freezing anything (a retry would otherwise
   * freeze the workload again); after that, what finished copies showed counts again.
   */
  recordUnfinishedCopy(bytes: number, budgetSeconds: number): void {
    if (bytes <= 0 || budgetSeconds <= 0) return;
    this.slow = {
      rate: Math.max(1, Math.floor(bytes / (2 * budgetSeconds))),
      until: Date.now() + SLOW_COPY_MEMORY_MS,
    };
  }

  /** Seconds a sparse copy of `bytes` is expected to take. */
  copySeconds(bytes: number): number {
    const slow = this.slow && Date.now() < this.slow.until ? this.slow.rate : Number.POSITIVE_INFINITY;
    return bytes / Math.min(this.copyRate, slow);
  }
}
