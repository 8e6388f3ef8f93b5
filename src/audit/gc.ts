/**
 * `loopvol gc`: removes what `check` proved safe to remove, and nothing else. Never an image, never a
 * record, never a lease, never anything in quarantine, never a fenced or frozen filesystem.
 *
 *  - Leaked mounts and loop devices on this host: under the pool locks of their volumes (the lock every
 *    lease change takes), looked at again, and only what is still leaked is unmounted (a plain umount,
 *    which the kernel refuses while anything uses the mount) or detached (only a device nothing holds).
 *    The locks are then kept a little longer than a pool call waits for one, so that a NodeStageVolume
 *    that looked at the host before the detach is ABORTED (and retried, seeing the host as it is now)
 *    instead of going on with a device that is gone.
 *  - Locks whose holder is provably gone: taken over and released by the pool's own LockManager, by
 *    exactly the rules the driver uses.
 *  - Old trash: removed, as the driver would have done had its removal not been interrupted.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { errnoCode } from '../errors.js';
import { CommandError, type Exec } from '../exec/runner.js';
import type { Host } from '../host/host.js';
import { exists } from '../pool/fsutil.js';
import { isTrashEntry, layoutProblem } from '../pool/layout.js';
import { isHeld, type HeldLock } from '../pool/lock.js';
import { type Pool, removeTreeSafely } from '../pool/pool.js';
import type { Finding, GcStep } from './findings.js';
import type { HostCheck } from './host-check.js';

/** Longer than a pool call waits for a busy lock (2 s): see above. */
export const GC_GRACE_MS = 2_500;

export interface GcOutcome {
  finding: Finding;
  /** removed; skipped: nothing to remove any more (gone, or no longer leaked); failed: still there. */
  result: 'removed' | 'skipped' | 'failed';
  message: string;
}

export interface GcDeps {
  pool: Pool;
  host: Host;
  x: Exec;
  /** Looks at this host again (under the locks), as check does. */
  recheckHost: () => Promise<HostCheck>;
  trashAgeSeconds: number;
  graceMs?: number;
}

const sameStep = (a: GcStep, b: GcStep | undefined): boolean => JSON.stringify(a) === JSON.stringify(b);

/** Holds the pool locks of `ids` (sorted, as the driver takes several) while `fn` runs. */
async function holding<T>(pool: Pool, ids: readonly string[], fn: () => Promise<T>): Promise<T> {
  const held: HeldLock[] = [];
  try {
    for (const id of [...ids].sort()) {
      const deadline = Date.now() + 10_000;
      let got = await pool.locks.tryAcquire(id, 'loopvol gc');
      while (!isHeld(got) && Date.now() < deadline) {
        await new Promise((r) => setTimeout(r, 50));
        got = await pool.locks.tryAcquire(id, 'loopvol gc');
      }
      if (!isHeld(got)) throw new Error(`volume ${id} stays locked by ${got.holder}; try again later`);
      held.push(got);
    }
    return await fn();
  } finally {
    for (const l of held.reverse()) await l.release();
  }
}

async function hostSteps(d: GcDeps, planned: readonly Finding[]): Promise<GcOutcome[]> {
  const out: GcOutcome[] = [];
  if (planned.length === 0) return out;
  const volumeIds = new Set<string>();
  for (const f of planned) {
    const step = f.gc;
    if ((step?.action === 'detach' || step?.action === 'unmount') && step.volumeId !== undefined) {
      if (await exists(d.pool.layout.volumeDir(step.volumeId))) volumeIds.add(step.volumeId);
    }
  }
  await holding(d.pool, [...volumeIds], async () => {
    await actOnHost(d, planned, volumeIds, out);
  }).catch((err: unknown) => {
    // The locks could not be had, or the host could not be looked at: whatever was not done stays.
    const why = err instanceof Error ? err.message : String(err);
    for (const f of planned) {
      if (!out.some((o) => o.finding === f)) out.push({ finding: f, result: 'failed', message: why });
    }
  });
  return out;
}

async function actOnHost(
  d: GcDeps,
  planned: readonly Finding[],
  volumeIds: ReadonlySet<string>,
  out: GcOutcome[],
): Promise<void> {
  let now = await d.recheckHost();
  let changedVolume = false;
  const stillPlanned = (f: Finding): boolean => now.findings.some((g) => sameStep(f.gc as GcStep, g.gc));
  for (const f of planned) {
    if (f.gc?.action !== 'unmount') continue;
    const { mountPoint, device, volumeId } = f.gc;
    if (!stillPlanned(f)) {
      out.push({
        finding: f,
        result: 'skipped',
        message: 'no longer leaked when looked at again; left alone',
      });
      continue;
    }
    const top = now.view.mounts.filter((m) => m.mountPoint === mountPoint).at(-1);
    if (top?.source !== device && top?.root !== `/${path.basename(device)}`) {
      out.push({
        finding: f,
        result: 'failed',
        message: `something else is mounted on top of ${mountPoint}; left alone`,
      });
      continue;
    }
    try {
      await d.x.run('umount', [mountPoint], { timeoutMs: 60_000 });
      if (volumeId !== undefined && volumeIds.has(volumeId)) changedVolume = true;
      out.push({ finding: f, result: 'removed', message: `unmounted ${mountPoint}` });
    } catch (err) {
      const why = err instanceof CommandError ? err.lastStderrLine : String(err);
      out.push({ finding: f, result: 'failed', message: `could not unmount ${mountPoint}: ${why}` });
    }
  }
  now = await d.recheckHost();
  for (const f of planned) {
    if (f.gc?.action !== 'detach') continue;
    const { device, volumeId } = f.gc;
    const p = now.view.loops.find((l) => l.loop.path === device);
    if (!p || !stillPlanned(f)) {
      out.push({
        finding: f,
        result: 'skipped',
        message: p ? 'no longer leaked when looked at again; left alone' : `${device} is gone already`,
      });
      continue;
    }
    if (p.mounts.length > 0 || (await d.host.claimed(device))) {
      out.push({
        finding: f,
        result: 'failed',
        message: `${device} is still mounted or held; left attached`,
      });
      continue;
    }
    try {
      const gone = await d.host.detach(d.x, p.loop);
      if (volumeId !== undefined && volumeIds.has(volumeId)) changedVolume = true;
      out.push({
        finding: f,
        result: 'removed',
        message: gone
          ? `detached ${device}`
          : `${device} is open somewhere; the kernel detaches it when it is closed`,
      });
    } catch (err) {
      const why = err instanceof CommandError ? err.lastStderrLine : String(err);
      out.push({ finding: f, result: 'failed', message: `could not detach ${device}: ${why}` });
    }
  }
  if (changedVolume) await new Promise((r) => setTimeout(r, d.graceMs ?? GC_GRACE_MS));
}

async function removeTrash(d: GcDeps, f: Finding, entry: string): Promise<GcOutcome> {
  const p = path.join(d.pool.layout.trashDir, entry);
  // Only what the driver puts in the trash, in a trash that is the pool's own directory.
  const problem = await layoutProblem(d.pool.layout);
  if (problem || !isTrashEntry(entry))
    return { finding: f, result: 'failed', message: problem ?? `${p} is not the driver's; left alone` };
  try {
    const st = await fs.lstat(p);
    const age = (Date.now() - Math.max(st.mtimeMs, st.ctimeMs)) / 1000;
    if (age <= d.trashAgeSeconds)
      return { finding: f, result: 'skipped', message: 'not old any more; left alone' };
    await removeTreeSafely(d.x, p);
    return { finding: f, result: 'removed', message: `removed ${p}` };
  } catch (err) {
    if (errnoCode(err) === 'ENOENT')
      return { finding: f, result: 'skipped', message: `${p} is gone already` };
    return {
      finding: f,
      result: 'failed',
      message: `could not remove ${p}: ${errnoCode(err) ?? String(err)}`,
    };
  }
}

async function removeLock(d: GcDeps, f: Finding, key: string): Promise<GcOutcome> {
  // The driver's own rules: a lock whose holder is provably gone is taken over at once; any other is busy.
  const got = await d.pool.locks.tryAcquire(key, 'loopvol gc: remove an abandoned lock');
  if (!isHeld(got))
    return { finding: f, result: 'skipped', message: `lock ${key} is held by ${got.holder} now; left alone` };
  await got.release();
  return { finding: f, result: 'removed', message: `removed lock ${key}` };
}

/** Carries out the gc steps of `planned` (findings of a check just made); returns what happened to each. */
export async function collectGarbage(d: GcDeps, planned: readonly Finding[]): Promise<GcOutcome[]> {
  const steps = planned.filter((f) => f.gc !== undefined);
  const out = await hostSteps(
    d,
    steps.filter((f) => f.gc?.action === 'unmount' || f.gc?.action === 'detach'),
  );
  for (const f of steps) {
    if (f.gc?.action === 'remove-trash') out.push(await removeTrash(d, f, f.gc.entry));
    else if (f.gc?.action === 'remove-lock') out.push(await removeLock(d, f, f.gc.key));
  }
  return out;
}
