/**
 * Who and where this process is (boot id, pid namespace, host name), and whether a process of this
 * host is gone: what a lock's owner and a fenced filesystem are judged by. The same rules as the
 * pool's LockManager (pool/lock.ts), which takes such a lock over at once.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import { errnoCode } from '../errors.js';

export interface SelfIdentity {
  host: string;
  bootId: string;
  pidNs: string;
}

let cached: Promise<SelfIdentity> | undefined;

export function selfIdentity(): Promise<SelfIdentity> {
  cached ??= (async () => ({
    host: os.hostname(),
    bootId: (await fs.readFile('/proc/sys/kernel/random/boot_id', 'utf8').catch(() => 'unknown-boot')).trim(),
    pidNs: await fs.readlink('/proc/self/ns/pid').catch(() => 'unknown-ns'),
  }))();
  return cached;
}

/** Field 22 of /proc/<pid>/stat: when the process started, which tells a reused pid apart. */
async function processStart(pid: number): Promise<string | undefined> {
  try {
    const stat = await fs.readFile(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19];
  } catch {
    return undefined;
  }
}

/** True when process `pid` of this pid namespace, started at `start`, no longer runs. */
export async function processGone(pid: number, start: string): Promise<boolean> {
  try {
    process.kill(pid, 0);
  } catch (err) {
    if (errnoCode(err) === 'ESRCH') return true;
  }
  const actual = await processStart(pid);
  return actual === undefined || actual !== start;
}
