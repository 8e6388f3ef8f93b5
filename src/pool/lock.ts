/**
 * Cross-process locks for a pool that several driver processes share (a controller and its standby
 * during a failover, node plugins on every host of an NFS-like pool).
 *
 * A lock is a file created with link(2), so it appears complete or not at all, even over NFS. It names
 * its owner. A lock whose owner is gone is broken and taken over:
 *  - an owner on this host (same boot id and pid namespace) is gone when its process is, which makes a
 *    kill -9 recoverable at once; one naming this very process is gone unless it holds that lock now
 *    (a release whose removal failed, the pool not answering, left it);
 *  - the owner's successor (a node plugin restarted in a new container on the same host, which names
 *    itself by the same role) knows its predecessor is gone, and takes over at once;
 *  - an owner elsewhere refreshes the lock file (its mtime, and so its ctime) while it holds it. Clocks
 *    of other hosts are never compared with ours: a lock is stale when this process has watched it and
 *    seen no change for `leaseMs` by its own clock.
 * An owner that cannot renew its lock (the file was taken over, or the pool does not answer) for half
 * the lease stops acting under it: its `signal` aborts, and work checks it before each step that commits.
 * The in-process in-flight set is the first line (it answers ABORTED); this one keeps processes apart.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from 'pino';
import { busy, errnoCode } from '../errors.js';
import { createExclusive, isRecord, readJson, removeFile } from './fsutil.js';

export const LEASE_MS = 60_000;
const HEARTBEAT_MS = 15_000;

interface LockOwner {
  host: string;
  bootId: string;
  pidNs: string;
  pid: number;
  start: string;
  token: string;
  purpose: string;
  since: string;
  /** Who the owner is across restarts on one host (e.g. "node:worker-1"), when it has such a name. */
  role?: string;
}

interface Identity {
  host: string;
  bootId: string;
  pidNs: string;
  pid: number;
  start: string;
}

async function readOr(file: string, fallback: string): Promise<string> {
  try {
    return (await fs.readFile(file, 'utf8')).trim();
  } catch {
    return fallback;
  }
}

/** Field 22 of /proc/<pid>/stat: when the process started, which tells a reused pid apart. */
async function processStart(pid: number | 'self'): Promise<string | undefined> {
  try {
    const stat = await fs.readFile(`/proc/${pid}/stat`, 'utf8');
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return fields[19];
  } catch {
    return undefined;
  }
}

let selfIdentity: Promise<Identity> | undefined;
function identity(): Promise<Identity> {
  selfIdentity ??= (async () => ({
    host: os.hostname(),
    bootId: await readOr('/proc/sys/kernel/random/boot_id', 'unknown-boot'),
    pidNs: await fs.readlink('/proc/self/ns/pid').catch(() => 'unknown-ns'),
    pid: process.pid,
    start: (await processStart('self')) ?? 'unknown',
  }))();
  return selfIdentity;
}

/** The owner a lock file names; undefined when it cannot be read or parsed. */
async function readOwner(file: string): Promise<LockOwner | undefined> {
  try {
    return parseOwner(await readJson(file));
  } catch {
    return undefined;
  }
}

function parseOwner(v: unknown): LockOwner | undefined {
  if (!isRecord(v)) return undefined;
  const { host, bootId, pidNs, pid, start, token, purpose, since, role } = v;
  if (
    typeof host !== 'string' ||
    typeof bootId !== 'string' ||
    typeof pidNs !== 'string' ||
    typeof pid !== 'number' ||
    typeof start !== 'string' ||
    typeof token !== 'string'
  ) {
    return undefined;
  }
  return {
    host,
    bootId,
    pidNs,
    pid,
    start,
    token,
    purpose: typeof purpose === 'string' ? purpose : '',
    since: typeof since === 'string' ? since : '',
    ...(typeof role === 'string' ? { role } : {}),
  };
}

export interface HeldLock {
  /** Aborts when this process can no longer be sure it holds the lock. */
  readonly signal: AbortSignal;
  /** Throws ABORTED when the lock was lost: call it before a step that commits. */
  assertHeld(): void;
  release(): Promise<void>;
}

export interface LockBusy {
  holder: string;
}

export interface LockOptions {
  /** How long a lock of another host must be seen unchanged before it counts as abandoned. */
  leaseMs?: number;
  /** How often a held lock is renewed. */
  heartbeatMs?: number;
  /**
   * This process's lasting name on its host ("node:<id>@<presence socket>"): its successor, which waited
   * for it to exit, takes over its locks at once.
   */
  role?: string;
}

interface Sighting {
  fingerprint: string;
  /** performance.now() when this fingerprint was first seen. */
  since: number;
}

/**
 * The tokens of the locks this process holds, or is creating, whichever manager took them: a lock file
 * naming this very process but none of these is one it left behind (its removal failed while the pool
 * did not answer), not one it holds.
 */
const holding = new Set<string>();

const ASIDE = '.stale-';
/** Whether `name` is one a stale lock gets when it is moved aside to be broken. */
export const isAsideName = (name: string): boolean => /^.+\.lock\.stale-[0-9a-f]{12}$/.test(name);

export class LockManager {
  private readonly leaseMs: number;
  private readonly heartbeatMs: number;
  private readonly role: string | undefined;
  /** What this process saw of other hosts' locks, and since when (its own monotonic clock). */
  private readonly sightings = new Map<string, Sighting>();

  constructor(
    private readonly dir: string,
    private readonly log: Logger,
    options: LockOptions = {},
  ) {
    this.leaseMs = options.leaseMs ?? LEASE_MS;
    this.heartbeatMs = options.heartbeatMs ?? HEARTBEAT_MS;
    this.role = options.role;
  }

  private file(key: string): string {
    if (!/^[A-Za-z0-9._-]+$/.test(key)) throw new Error(`bad lock key ${key}`);
    return path.join(this.dir, `${key}.lock`);
  }

  /** Takes the lock, or reports who holds it. Never waits. */
  async tryAcquire(key: string, purpose: string): Promise<HeldLock | LockBusy> {
    const file = this.file(key);
    const me = await identity();
    const owner: LockOwner = {
      ...me,
      token: randomBytes(12).toString('hex'),
      purpose,
      since: new Date().toISOString(),
      ...(this.role ? { role: this.role } : {}),
    };
    const body = JSON.stringify(owner);
    for (let attempt = 0; attempt < 3; attempt++) {
      // Counted as held from before its file can appear: another call of this process looking at it
      // meanwhile must not take it for one this process left behind.
      holding.add(owner.token);
      let created = false;
      try {
        created = await createExclusive(file, body, false);
      } finally {
        if (!created) holding.delete(owner.token);
      }
      if (created) {
        this.sightings.delete(file);
        return this.held(file, owner);
      }
      const current = await this.inspect(file);
      if (current === 'gone') continue;
      if (current.live) return { holder: describe(current.owner) };
      if (!(await this.breakStale(file, current.owner))) {
        return { holder: current.owner ? describe(current.owner) : 'another process' };
      }
      this.sightings.delete(file);
      this.log.warn(
        { lock: key, previous: current.owner, why: current.why },
        'took over a lock left by a process that is gone',
      );
    }
    return { holder: 'another process (lock contended)' };
  }

  private async inspect(
    file: string,
  ): Promise<'gone' | { live: boolean; owner: LockOwner | undefined; why?: string }> {
    let stat;
    try {
      stat = await fs.stat(file, { bigint: true });
    } catch (err) {
      if (errnoCode(err) === 'ENOENT') {
        this.sightings.delete(file);
        return 'gone';
      }
      throw err;
    }
    const owner = await readOwner(file); // unreadable: judged by whether it changes
    const me = await identity();
    if (owner && owner.bootId === me.bootId) {
      if (owner.pidNs === me.pidNs) {
        if (owner.pid === me.pid) {
          if (owner.start !== me.start) return { live: false, owner, why: 'an earlier run of this process' };
          return { live: holding.has(owner.token), owner, why: 'this process, which could not remove it' };
        }
        return { live: await isAlive(owner.pid, owner.start), owner, why: 'its process exited' };
      }
      if (this.role !== undefined && owner.role === this.role) {
        // Our predecessor on this host (the container we replaced): it is gone, or we would not run.
        return { live: false, owner, why: 'the previous container of this node plugin' };
      }
    }
    // Another host (or another container on this one): alive as long as its lock keeps changing.
    const fingerprint = `${owner?.token ?? '?'}|${stat.mtimeNs}|${stat.ctimeNs}|${stat.size}`;
    const now = performance.now();
    const seen = this.sightings.get(file);
    if (!seen || seen.fingerprint !== fingerprint) {
      this.sightings.set(file, { fingerprint, since: now });
      return { live: true, owner };
    }
    if (now - seen.since < this.leaseMs) return { live: true, owner };
    return { live: false, owner, why: `unchanged for ${Math.round((now - seen.since) / 1000)} s` };
  }

  /** Moves the stale lock aside; only one breaker can win the rename, and it checks what it took. */
  private async breakStale(file: string, seen: LockOwner | undefined): Promise<boolean> {
    const aside = `${file}${ASIDE}${randomBytes(6).toString('hex')}`;
    try {
      await fs.rename(file, aside);
    } catch (err) {
      if (errnoCode(err) === 'ENOENT') return true; // someone else broke it; try again
      throw err;
    }
    const taken = await readOwner(aside);
    if (seen && taken?.token !== seen.token) {
      // A fresh lock replaced the stale one between our look and the rename: give it back.
      await fs.link(aside, file).catch(() => undefined);
      await removeFile(aside);
      return false;
    }
    await removeFile(aside);
    return true;
  }

  private held(file: string, owner: LockOwner): HeldLock {
    const controller = new AbortController();
    let lastRenewed = performance.now();
    let released = false;
    const lose = (why: string): void => {
      if (controller.signal.aborted) return;
      controller.abort(new Error(why));
      this.log.error({ lock: file, why }, 'lost a pool lock; stopping the work done under it');
    };
    const renew = async (): Promise<void> => {
      const current = await readOwner(file);
      if (released) return;
      if (current?.token !== owner.token) {
        lose('another process took the lock over');
        return;
      }
      const now = new Date();
      await fs.utimes(file, now, now);
      lastRenewed = performance.now();
    };
    let renewing = false;
    const timer = setInterval(() => {
      // Others declare it abandoned after a full lease without change: stop well before that, also
      // when a renewal never answers (a hard-mounted pool whose server went away hangs, not fails).
      if (performance.now() - lastRenewed > this.leaseMs / 2) lose('the lock could not be renewed');
      if (renewing) return; // one at a time: hung ones would fill libuv's thread pool
      renewing = true;
      renew()
        .catch((err: unknown) => {
          this.log.warn({ lock: file, err }, 'could not renew a pool lock');
          if (performance.now() - lastRenewed > this.leaseMs / 2) lose('the lock could not be renewed');
        })
        .finally(() => {
          renewing = false;
        });
    }, this.heartbeatMs);
    timer.unref();
    return {
      signal: controller.signal,
      assertHeld: () => {
        // By the clock too: a process stalled (stopped, swapped out) past half a lease resumes before
        // its renewal timer has run, while another may have taken the lock over.
        if (performance.now() - lastRenewed > this.leaseMs / 2) lose('the lock could not be renewed');
        if (controller.signal.aborted) {
          throw busy(`This process lost its lock on ${path.basename(file, '.lock')} while working; retry.`);
        }
      },
      release: async () => {
        if (released) return;
        released = true;
        clearInterval(timer);
        const removeIfOurs = async (): Promise<void> => {
          let current;
          try {
            current = parseOwner(await readJson(file));
          } catch (err) {
            this.log.warn(
              { lock: file, err },
              'could not read a pool lock to remove it; the next call of this process that needs it takes it over',
            );
            return;
          }
          if (current?.token !== owner.token) {
            this.log.error({ lock: file }, 'a lock this process held was taken over by another process');
            return;
          }
          await removeFile(file);
        };
        // Held until the removal ended, then not: a file it failed to remove (the pool did not answer) is
        // one this process left behind, which the next call that needs it takes over.
        const removing = removeIfOurs().finally(() => holding.delete(owner.token));
        // Lost: the pool may not answer, and reading the file could hang the call that releases it.
        // The file is removed when the pool answers (if it is still ours), without waiting for that.
        if (controller.signal.aborted) {
          removing.catch((err: unknown) => {
            this.log.warn({ lock: file, err }, 'could not remove a lost pool lock');
          });
          return;
        }
        await removing;
      },
    };
  }
}

function describe(owner: LockOwner | undefined): string {
  return owner ? `process ${owner.pid} on ${owner.host} (${owner.purpose})` : 'another process';
}

async function isAlive(pid: number, start: string): Promise<boolean> {
  try {
    process.kill(pid, 0);
  } catch (err) {
    if (errnoCode(err) === 'ESRCH') return false;
  }
  const actual = await processStart(pid);
  return actual === undefined ? false : actual === start;
}

export const isHeld = (r: HeldLock | LockBusy): r is HeldLock => 'release' in r;
