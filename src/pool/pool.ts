/**
 * A pool directory: its layout version, its cross-process locks, and the trash through which deleted
 * volumes leave (a rename is the single atomic step that deletes; the space is freed after it).
 */
import { randomBytes } from 'node:crypto';
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from 'pino';
import { aborted, errnoCode } from '../errors.js';
import { failpoint } from '../failpoints.js';
import { createExclusive, fsyncDir, isRecord, listDir, readJson } from './fsutil.js';
import { POOL_FORMAT, PoolLayout } from './layout.js';
import { isHeld, LockManager } from './lock.js';

/** How long a call waits for a pool lock another call holds. */
const LOCK_WAIT_MS = 2_000;

export class PoolError extends Error {
  override readonly name = 'PoolError';
}

export class Pool {
  readonly layout: PoolLayout;
  readonly locks: LockManager;

  private constructor(
    readonly root: string,
    readonly name: string,
    readonly log: Logger,
  ) {
    this.layout = new PoolLayout(root);
    this.locks = new LockManager(this.layout.locksDir, log);
  }

  /** Opens the pool at `dir`, creating it (and its format file) when it is new. */
  static async open(dir: string, name: string, log: Logger): Promise<Pool> {
    try {
      return await Pool.openOrCreate(dir, name, log);
    } catch (err) {
      if (err instanceof PoolError) throw err;
      const code = errnoCode(err);
      throw new PoolError(
        `cannot use ${dir} as the pool (${code ?? (err instanceof Error ? err.message : String(err))})`,
        {
          cause: err,
        },
      );
    }
  }

  private static async openOrCreate(dir: string, name: string, log: Logger): Promise<Pool> {
    await fs.mkdir(dir, { recursive: true, mode: 0o750 });
    const root = await fs.realpath(dir);
    const pool = new Pool(root, name, log);
    const { layout } = pool;
    for (const sub of [
      layout.volumesDir,
      layout.snapshotsDir,
      layout.groupsDir,
      layout.nodesDir,
      layout.locksDir,
      layout.trashDir,
    ]) {
      await fs.mkdir(sub, { recursive: true, mode: 0o750 });
    }
    const created = await createExclusive(
      layout.formatFile,
      `${JSON.stringify({ format: POOL_FORMAT, createdAt: new Date().toISOString(), createdBy: os.hostname() }, null, 2)}\n`,
    );
    if (created) log.info({ pool: root }, 'initialized a new pool');
    const problem = await pool.formatProblem();
    if (problem) throw new PoolError(problem);
    await pool.sweepTrash();
    return pool;
  }

  private async formatProblem(): Promise<string | undefined> {
    let info: unknown;
    try {
      info = await readJson(this.layout.formatFile);
    } catch {
      return `${this.layout.formatFile} is not valid JSON`;
    }
    if (!isRecord(info) || typeof info.format !== 'number')
      return `${this.layout.formatFile} is missing or has no format`;
    if (info.format > POOL_FORMAT) {
      return `the pool at ${this.root} has layout format ${info.format}, newer than this driver's ${POOL_FORMAT}; upgrade the driver`;
    }
    if (info.format < 1) return `${this.layout.formatFile} has an unknown format ${info.format}`;
    return undefined;
  }

  /** Why the pool cannot be used right now, or undefined when it can (Probe and /healthz ask this). */
  async checkUsable(): Promise<string | undefined> {
    try {
      const st = await fs.stat(this.root);
      if (!st.isDirectory()) return `the pool path ${this.root} is not a directory`;
      await fs.access(this.root, constants.R_OK | constants.W_OK | constants.X_OK);
      await fs.access(this.layout.volumesDir, constants.W_OK);
    } catch (err) {
      return `the pool directory ${this.root} is not usable (${errnoCode(err) ?? String(err)})`;
    }
    return this.formatProblem();
  }

  /**
   * Runs `fn` holding the cross-process lock `key`. Pool locks guard short steps, so a busy lock is
   * waited for (up to `waitMs`) before the call gives up with ABORTED.
   */
  async withLock<T>(key: string, purpose: string, fn: () => Promise<T>, waitMs = LOCK_WAIT_MS): Promise<T> {
    const deadline = Date.now() + waitMs;
    let got = await this.locks.tryAcquire(key, purpose);
    for (let pause = 2; !isHeld(got) && Date.now() < deadline; pause = Math.min(pause * 2, 50)) {
      await new Promise((r) => setTimeout(r, pause + Math.random() * pause));
      got = await this.locks.tryAcquire(key, purpose);
    }
    if (!isHeld(got)) throw aborted(`${key} is being changed by ${got.holder}; retry later.`);
    try {
      return await fn();
    } finally {
      await got.release();
    }
  }

  /** Deletes a directory tree: renamed into the trash first (atomic), then removed. */
  async discard(dir: string): Promise<void> {
    const target = path.join(this.layout.trashDir, `${path.basename(dir)}.${randomBytes(6).toString('hex')}`);
    try {
      await fs.rename(dir, target);
    } catch (err) {
      if (errnoCode(err) === 'ENOENT') return;
      throw err;
    }
    await fsyncDir(path.dirname(dir));
    failpoint('discard:moved');
    await fs.rm(target, { recursive: true, force: true });
  }

  /** Removes what an interrupted delete left in the trash. */
  async sweepTrash(): Promise<void> {
    for (const entry of await listDir(this.layout.trashDir)) {
      await fs
        .rm(path.join(this.layout.trashDir, entry), { recursive: true, force: true })
        .catch((err: unknown) => {
          this.log.warn({ entry, err }, 'could not empty a trash entry');
        });
    }
  }
}
