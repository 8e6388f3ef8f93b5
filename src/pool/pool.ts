/**
 * A pool directory: its layout version, its cross-process locks, and the trash through which deleted
 * volumes leave (a rename is the single atomic step that deletes; the space is freed after it).
 */
import { randomBytes, randomUUID } from 'node:crypto';
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from 'pino';
import { busy, DomainError, errnoCode, unavailable, unsafe } from '../errors.js';
import { bindExec, type Exec, type Runner } from '../exec/runner.js';
import { failpoint } from '../failpoints.js';
import { telemetry } from '../telemetry.js';
import {
  createExclusive,
  exists,
  fsyncDir,
  isRecord,
  listDir,
  readJson,
  type RecordRead,
  writeFileAtomic,
} from './fsutil.js';
import { PoolFilesystem } from './filesystem.js';
import { isTrashEntry, layoutProblem, POOL_FORMAT, PoolLayout } from './layout.js';
import { type HeldLock, isHeld, LockManager, type LockOptions } from './lock.js';

/** How long a call waits for a pool lock another call holds. */
const LOCK_WAIT_MS = 2_000;
/** The note a quarantined directory carries. */
export const QUARANTINE_NOTE = 'QUARANTINE.json';

const capitalize = (s: string): string => s.charAt(0).toUpperCase() + s.slice(1);

/** The error for a record that cannot be read (`quarantinedAt`: where its directory went, if it was moved). */
export function damagedRecord(what: string, reason: string, quarantinedAt?: string) {
  return unsafe(
    quarantinedAt
      ? `The record of ${what} cannot be read (${reason}); its directory was moved to ${quarantinedAt} for an operator, and nothing was deleted.`
      : `The record of ${what} cannot be read (${reason}); nothing was changed, and an operator must repair it.`,
  );
}

export class PoolError extends Error {
  override readonly name = 'PoolError';
}

/** No pool at the path, and this process may not create one (--create-pool=false). */
export class PoolMissing extends PoolError {}

export interface OpenOptions {
  /** Create a pool when there is none (default true). */
  create?: boolean;
  lock?: LockOptions;
  /**
   * Open an existing pool only to look at it and act as an operator would (the `loopvol` commands):
   * nothing is created, no id is given, and the trash is not swept (it is reported instead).
   */
  inspect?: boolean;
  /** Runs removeTreeSafely for what goes out through the trash (fs.rm walks by path); else fs.rm. */
  runner?: Runner;
}

/**
 * Removes the tree at `p` as GNU rm does: by file descriptor, never following a symlink (even one
 * swapped in while it walks), and never into another filesystem mounted inside it.
 */
export async function removeTreeSafely(x: Exec, p: string): Promise<void> {
  await x.run('rm', ['-rf', '--one-file-system', '--', p], { timeoutMs: 30 * 60_000 });
}

async function formatProblem(layout: PoolLayout): Promise<string | undefined> {
  let info: unknown;
  try {
    info = await readJson(layout.formatFile);
  } catch {
    return `${layout.formatFile} is not valid JSON`;
  }
  if (!isRecord(info) || typeof info.format !== 'number')
    return `${layout.formatFile} is missing or has no format`;
  if (info.format > POOL_FORMAT) {
    return `the pool at ${layout.root} has layout format ${info.format}, newer than this driver's ${POOL_FORMAT}; upgrade the driver`;
  }
  if (info.format < 1) return `${layout.formatFile} has an unknown format ${info.format}`;
  return undefined;
}

/**
 * The pool's id, from pool.json. A pool made before pools had ids gets one, once: under a lock, so
 * that processes opening it together agree, and never changed afterwards.
 */
async function ensureId(layout: PoolLayout, log: Logger): Promise<string> {
  const read = async (): Promise<Record<string, unknown>> => {
    const info = await readJson(layout.formatFile);
    return isRecord(info) ? info : {};
  };
  const first = await read();
  if (typeof first.id === 'string' && first.id !== '') return first.id;
  const locks = new LockManager(layout.locksDir, log);
  for (let attempt = 0; attempt < 100; attempt++) {
    const got = await locks.tryAcquire('pool-id', 'give the pool an id');
    if (isHeld(got)) {
      try {
        const info = await read();
        if (typeof info.id === 'string' && info.id !== '') return info.id;
        const id = randomUUID();
        await writeFileAtomic(layout.formatFile, `${JSON.stringify({ ...info, id }, null, 2)}\n`);
        log.info({ pool: layout.root, id }, 'gave a pool made by an older release its id');
        return id;
      } finally {
        await got.release();
      }
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new PoolError(`could not give the pool at ${layout.root} an id (its pool-id lock stays busy)`);
}

export class Pool {
  readonly layout: PoolLayout;
  readonly locks: LockManager;

  /** What the pool's filesystem can do: reflink, the largest file, how fast it copies. */
  readonly fs: PoolFilesystem;

  private readonly removeTree: (p: string) => Promise<void>;

  private constructor(
    readonly root: string,
    readonly id: string,
    readonly name: string,
    readonly log: Logger,
    lockOptions: LockOptions,
    runner?: Runner,
  ) {
    const x = runner && bindExec(runner, { log });
    this.removeTree = x ? (p) => removeTreeSafely(x, p) : (p) => fs.rm(p, { recursive: true, force: true });
    this.layout = new PoolLayout(root);
    this.locks = new LockManager(this.layout.locksDir, log, lockOptions);
    this.fs = new PoolFilesystem(this.layout, () => this.assertPresent());
  }

  /**
   * Opens the pool at `dir`. With `create`, a directory without a pool gets a new one (its pool.json,
   * written once, with an id that never changes); without, a missing pool is a PoolMissing error and
   * nothing is made: a shared filesystem that is not mounted must never become a second, empty pool.
   */
  static async open(dir: string, name: string, log: Logger, options: OpenOptions = {}): Promise<Pool> {
    try {
      return await Pool.openOrCreate(dir, name, log, options);
    } catch (err) {
      if (err instanceof PoolError) throw err;
      const code = errnoCode(err);
      throw new PoolError(
        `cannot use ${dir} as the pool (${code ?? (err instanceof Error ? err.message : String(err))})`,
        { cause: err },
      );
    }
  }

  private static async openOrCreate(
    dir: string,
    name: string,
    log: Logger,
    options: OpenOptions,
  ): Promise<Pool> {
    const layout0 = new PoolLayout(dir);
    if (options.create === false || options.inspect === true) {
      if (!(await exists(layout0.formatFile))) {
        throw new PoolMissing(
          `There is no pool at ${dir} (no pool.json): is the shared filesystem mounted there? Create a pool once with: loopvol create-pool --pool-dir=${dir}`,
        );
      }
    } else {
      await fs.mkdir(dir, { recursive: true, mode: 0o750 });
    }
    const root = await fs.realpath(dir);
    const layout = new PoolLayout(root);
    if (options.inspect === true) {
      const problem = (await formatProblem(layout)) ?? (await layoutProblem(layout));
      if (problem) throw new PoolError(problem);
      const info = await readJson(layout.formatFile);
      const id = isRecord(info) && typeof info.id === 'string' ? info.id : '';
      return new Pool(root, id, name, log, options.lock ?? {});
    }
    if (options.create !== false && !(await exists(layout.formatFile))) {
      // The format file first (link(2): one creator names the pool); its temp file needs room to spare.
      const created = await createExclusive(
        layout.formatFile,
        `${JSON.stringify({ format: POOL_FORMAT, id: randomUUID(), createdAt: new Date().toISOString(), createdBy: os.hostname() }, null, 2)}\n`,
      );
      if (created) log.info({ pool: root }, 'created a new pool');
    }
    for (const sub of layout.ownDirs) {
      // One that is not a directory (a symlink planted there) is reported by sweepTrash and check.
      await fs.mkdir(sub, { recursive: true, mode: 0o750 }).catch((err: unknown) => {
        if (errnoCode(err) !== 'EEXIST') throw err;
      });
    }
    const problem = await formatProblem(layout);
    if (problem) throw new PoolError(problem);
    const id = await ensureId(layout, log);
    const pool = new Pool(root, id, name, log, options.lock ?? {}, options.runner);
    await pool.sweepTrash();
    return pool;
  }

  /**
   * Throws unless this pool is still there: its pool.json present and naming the same id. A shared
   * filesystem unmounted under a running driver leaves an empty directory at the pool's path, where
   * a listing would answer "nothing" and a delete "done".
   */
  async assertPresent(): Promise<void> {
    let info: unknown;
    try {
      info = await readJson(this.layout.formatFile);
    } catch (err) {
      throw unavailable(`The pool at ${this.root} cannot be read (${errnoCode(err) ?? String(err)}).`, err);
    }
    if (info === undefined) {
      throw unavailable(`The pool at ${this.root} is gone (no pool.json): is its filesystem still mounted?`);
    }
    if (!isRecord(info) || info.id !== this.id) {
      throw unavailable(
        `The pool at ${this.root} is another pool now (id ${isRecord(info) ? String(info.id) : '?'}, not ${this.id}).`,
      );
    }
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
    const problem = await formatProblem(this.layout);
    if (problem) return problem;
    try {
      await this.assertPresent();
    } catch (err) {
      return err instanceof Error ? err.message.replace(/\.$/, '') : String(err);
    }
    return undefined;
  }

  /**
   * Runs `fn` holding the cross-process lock `key`. Pool locks guard short steps, so a busy lock is
   * waited for (up to `waitMs`) before the call gives up with ABORTED. `fn` gets the lock, to check
   * (`assertHeld`) before a step that commits that this process still holds it.
   */
  async withLock<T>(
    key: string,
    purpose: string,
    fn: (lock: HeldLock) => Promise<T>,
    waitMs = LOCK_WAIT_MS,
  ): Promise<T> {
    const started = performance.now();
    const deadline = Date.now() + waitMs;
    let got = await this.locks.tryAcquire(key, purpose).catch(async (err: unknown) => {
      // No locks/ directory: the pool itself may be gone (an unmounted shared filesystem). Say so.
      if (errnoCode(err) === 'ENOENT') await this.assertPresent();
      throw err;
    });
    for (let pause = 2; !isHeld(got) && Date.now() < deadline; pause = Math.min(pause * 2, 50)) {
      await new Promise((r) => setTimeout(r, pause + Math.random() * pause));
      got = await this.locks.tryAcquire(key, purpose);
    }
    telemetry.lockWaited((performance.now() - started) / 1000, isHeld(got));
    if (!isHeld(got)) throw busy(`${key} is being changed by ${got.holder}; retry later.`);
    try {
      return await fn(got);
    } finally {
      await got.release();
    }
  }

  /**
   * Runs `fn` holding `key`'s lock if nobody holds it now, without waiting; undefined when it is held
   * (someone is at work on it: a look over the whole pool leaves it for later).
   */
  async withLockIfFree<T>(
    key: string,
    purpose: string,
    fn: (lock: HeldLock) => Promise<T>,
  ): Promise<T | undefined> {
    try {
      return await this.withLock(key, purpose, fn, 0);
    } catch (err) {
      if (err instanceof DomainError && err.kind === 'busy') return undefined;
      throw err;
    }
  }

  /**
   * Moves a directory whose record cannot be read out of the way, into quarantine/, with a note of why
   * and when. Nothing in quarantine is ever deleted by the driver: an operator decides. Returns where it went.
   */
  async quarantine(dir: string, why: string, ...held: HeldLock[]): Promise<string> {
    const stamp = new Date().toISOString().replace(/[:.]/g, '-');
    const target = path.join(this.layout.quarantineDir, `${path.basename(dir)}.${stamp}`);
    await fs.mkdir(this.layout.quarantineDir, { recursive: true, mode: 0o750 });
    for (const lock of held) lock.assertHeld(); // another holder may have made it sound again
    await fs.rename(dir, target);
    await fsyncDir(path.dirname(dir));
    await fsyncDir(this.layout.quarantineDir);
    const note = {
      why,
      from: dir,
      at: new Date().toISOString(),
      by: `${os.hostname()} pid ${process.pid}`,
      what: 'loopvol moved this here instead of deleting it. Nothing here is removed automatically: restore it (move it back and repair its record) or delete it.',
    };
    await writeFileAtomic(path.join(target, QUARANTINE_NOTE), `${JSON.stringify(note, null, 2)}\n`);
    this.log.error({ from: dir, to: target, why }, 'quarantined a pool record that cannot be read');
    return target;
  }

  /**
   * Clears the way for a record about to be (re)made in `dir`, which holds no sound finished record: an
   * unfinished creation of ours (a "creating" record, or no record and no image) is discarded; what may
   * hold data (a damaged record, an image without a record) is quarantined and the error names where it
   * went. Nothing is moved once a lock of `held` (under which `record` was read) is lost.
   */
  async clearLeftover(
    what: string,
    dir: string,
    record: RecordRead<unknown>,
    image: string,
    ...held: HeldLock[]
  ): Promise<void> {
    if (!(await exists(dir))) return;
    const orphanImage = record.state === 'absent' && (await exists(image));
    if (record.state === 'damaged' || orphanImage) {
      const reason = record.state === 'damaged' ? record.reason : `${path.basename(image)} has no record`;
      const to = await this.quarantine(dir, reason, ...held);
      throw damagedRecord(what, reason, to);
    }
    this.log.warn({ dir }, `discarding an interrupted creation of ${what} before retrying it`);
    await this.discard(dir, ...held);
  }

  /** Refuses to make `what` (id `id`) again while an earlier one waits in quarantine for an operator. */
  async refuseQuarantined(what: string, id: string): Promise<void> {
    const q = (await this.quarantined())
      .filter((e) => e.startsWith(`${id}.`))
      .map((e) => path.join(this.layout.quarantineDir, e));
    if (q.length > 0) {
      throw unsafe(
        `${capitalize(what)} was quarantined at ${q.join(', ')} because its record could not be read; an operator must restore or remove it before it is made again.`,
      );
    }
  }

  /** Entries in quarantine/ (each a directory named <id>.<when>). */
  async quarantined(): Promise<string[]> {
    return (await listDir(this.layout.quarantineDir)).sort();
  }

  /** Deletes a directory tree: renamed into the trash first (atomic), then removed. */
  async discard(dir: string, ...held: HeldLock[]): Promise<void> {
    // Never into a trash that is a symlink (renamed into a place someone chose, then removed there).
    const problem = await layoutProblem(this.layout);
    if (problem) throw unsafe(`Nothing was deleted: ${problem}`);
    for (const lock of held) lock.assertHeld(); // the locks it is done under, right before the rename
    const target = path.join(this.layout.trashDir, `${path.basename(dir)}.${randomBytes(6).toString('hex')}`);
    try {
      await fs.rename(dir, target);
    } catch (err) {
      // Gone already is done; a trash that is missing is not (made again at the next start).
      if (errnoCode(err) === 'ENOENT' && !(await exists(dir))) return;
      throw err;
    }
    await fsyncDir(path.dirname(dir));
    failpoint('discard:moved');
    await this.removeTree(target);
  }

  /**
   * Removes what an interrupted delete left in the trash (only what Pool.discard puts there). Not
   * while a directory of the pool is a symlink (see layoutProblem): the driver still serves then, so
   * that pods keep their volumes and nodes can let go of them, but empties nothing.
   */
  async sweepTrash(): Promise<void> {
    const problem = await layoutProblem(this.layout);
    if (problem) {
      this.log.error({ problem }, 'the trash is not swept');
      return;
    }
    for (const entry of (await listDir(this.layout.trashDir)).filter(isTrashEntry)) {
      await this.removeTree(path.join(this.layout.trashDir, entry)).catch((err: unknown) => {
        this.log.warn({ entry, err }, 'could not empty a trash entry');
      });
    }
  }
}
