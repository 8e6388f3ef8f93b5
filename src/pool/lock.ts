/**
 * Cross-process locks for a pool that several driver processes share (a controller and its standby
 * during a failover, node plugins on every host of an NFS-like pool).
 *
 * A lock is a file created with link(2), so it appears complete or not at all, even over NFS. It names
 * its owner. A lock whose owner is gone is broken and taken over:
 *  - an owner on this host (same boot id and pid namespace) is gone when its process is, which makes a
 *    kill -9 recoverable at once;
 *  - an owner elsewhere refreshes the lock's mtime while it holds it; one silent for LEASE_MS is gone.
 * The in-process in-flight set is the first line (it answers ABORTED); this one keeps processes apart.
 */
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { Logger } from 'pino';
import { errnoCode } from '../errors.js';
import { createExclusive, isRecord, readJson, removeFile } from './fsutil.js';

const LEASE_MS = 60_000;
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

function parseOwner(v: unknown): LockOwner | undefined {
  if (!isRecord(v)) return undefined;
  const { host, bootId, pidNs, pid, start, token, purpose, since } = v;
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
  };
}

export interface HeldLock {
  release(): Promise<void>;
}

export interface LockBusy {
  holder: string;
}

export class LockManager {
  constructor(
    private readonly dir: string,
    private readonly log: Logger,
  ) {}

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
    };
    const body = JSON.stringify(owner);
    for (let attempt = 0; attempt < 3; attempt++) {
      if (await createExclusive(file, body, false)) return this.held(file, owner);
      const current = await this.inspect(file);
      if (current === 'gone') continue;
      if (current.live) return { holder: describe(current.owner) };
      if (!(await this.breakStale(file, current.owner))) {
        return { holder: current.owner ? describe(current.owner) : 'another process' };
      }
      this.log.warn(
        { lock: key, previous: current.owner },
        'took over a lock left by a process that is gone',
      );
    }
    return { holder: 'another process (lock contended)' };
  }

  private async inspect(file: string): Promise<'gone' | { live: boolean; owner: LockOwner | undefined }> {
    let stat;
    try {
      stat = await fs.stat(file);
    } catch (err) {
      if (errnoCode(err) === 'ENOENT') return 'gone';
      throw err;
    }
    let owner: LockOwner | undefined;
    try {
      owner = parseOwner(await readJson(file));
    } catch {
      owner = undefined; // unreadable: judged by age alone
    }
    const me = await identity();
    if (owner && owner.bootId === me.bootId && owner.pidNs === me.pidNs) {
      if (owner.pid === me.pid) return { live: owner.start === me.start, owner };
      return { live: await isAlive(owner.pid, owner.start), owner };
    }
    return { live: Date.now() - stat.mtimeMs < LEASE_MS, owner };
  }

  /** Moves the stale lock aside; only one breaker can win the rename, and it checks what it took. */
  private async breakStale(file: string, seen: LockOwner | undefined): Promise<boolean> {
    const aside = `${file}.stale-${randomBytes(6).toString('hex')}`;
    try {
      await fs.rename(file, aside);
    } catch (err) {
      if (errnoCode(err) === 'ENOENT') return true; // someone else broke it; try again
      throw err;
    }
    let taken: LockOwner | undefined;
    try {
      taken = parseOwner(await readJson(aside));
    } catch {
      taken = undefined;
    }
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
    const timer = setInterval(() => {
      const now = new Date();
      fs.utimes(file, now, now).catch(() => undefined);
    }, HEARTBEAT_MS);
    timer.unref();
    let released = false;
    return {
      release: async () => {
        if (released) return;
        released = true;
        clearInterval(timer);
        let current: LockOwner | undefined;
        try {
          current = parseOwner(await readJson(file));
        } catch {
          current = undefined;
        }
        if (current?.token !== owner.token) {
          this.log.error({ lock: file }, 'a lock this process held was taken over by another process');
          return;
        }
        await removeFile(file);
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
