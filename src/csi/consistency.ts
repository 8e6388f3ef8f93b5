/**
 * Point-in-time copies of volumes (snapshots, clones, group snapshots): a copy is never a fuzzy one.
 *
 * The sources' pool locks are held for the whole copy (no expand, delete, stage or second copy meanwhile,
 * in any process). Then:
 *  - The pool can reflink: a clone is atomic. Every filesystem that a node has staged for writing is
 *    frozen by that node (a request through the pool, pool/quiesce.ts) for the instant of the clones,
 *    so the copies hold clean filesystems; a raw block volume in use is cloned as it is, like the disk
 *    after a power cut, at one instant.
 *  - The pool cannot reflink: a byte copy takes time, so it runs only while nothing can write the
 *    source: no node has it staged for writing, or its filesystems stay frozen for the whole copy and
 *    the copy fits the freeze budget (judged from the allocated bytes and the copy speed seen so far).
 *    Otherwise FAILED_PRECONDITION says why and what to do.
 * Every source of a group is frozen before the first clone and thawed after the last.
 */
import { busy, conflict, missing } from '../errors.js';
import { CommandError, detached } from '../exec/runner.js';
import { isNodeId } from '../pool/ids.js';
import { type CopyResult, allocatedBytes, copyImage } from '../pool/images.js';
import type { HeldLock } from '../pool/lock.js';
import type { Capacity } from '../pool/capacity.js';
import type { Pool } from '../pool/pool.js';
import type { QuiesceAnswer, QuiesceBoard, QuiesceRequest } from '../pool/quiesce.js';
import type { Lease, VolumeMeta } from '../pool/types.js';
import type { VolumeStore } from '../pool/volumes.js';
import type { CallContext } from '../server/call.js';

export interface CopyDeps {
  pool: Pool;
  volumes: VolumeStore;
  /** Admits each copy against the pool's space (capacity.ts). */
  capacity: Capacity;
  board: QuiesceBoard;
  /** How long a filesystem may be kept frozen for a byte copy. */
  freezeBudgetMs: number;
  /** How long to wait for a node to answer a freeze request. */
  freezeWaitMs: number;
  /** Who asks (for the node's log). */
  requester: string;
}

/** How long a node keeps a filesystem frozen for a reflink clone at most (the clone takes milliseconds). */
const CLONE_FREEZE_MS = 5_000;
/** Slack between a node's freeze ending and the copy's own deadline. */
const FREEZE_SLACK_MS = 2_000;
const ANSWER_POLL_MS = 50;
/** How long a copy waits, after withdrawing its freeze requests, for the nodes to thaw. */
const THAW_WAIT_MS = 3_000;

interface Writer {
  volumeId: string;
  lease: Lease;
}

interface Hold {
  writer: Writer;
  request: QuiesceRequest;
  answer: QuiesceAnswer;
}

/**
 * A source as it stands while its lock is held: what a copy records about it (its size, whether a node
 * has initialized it) is read here, never before the lock, when a first stage may still change it.
 */
export interface HeldSource {
  meta: VolumeMeta;
  initialized: boolean;
  /** The sector size its data was written on, when recorded. */
  sectorSize?: number;
}

/** The copies made inside `withConsistentSources`: each runs as the plan allows. */
export interface CopyPlan {
  readonly takenAt: Date;
  /** One of the sources, read under its lock. */
  source(volumeId: string): HeldSource;
  copy(volumeId: string, dst: string): Promise<CopyResult>;
}

export async function withConsistentSources<T>(
  ctx: CallContext,
  d: CopyDeps,
  volumeIds: readonly string[],
  fn: (plan: CopyPlan) => Promise<T>,
): Promise<T> {
  const ids = [...new Set(volumeIds)].sort();
  const locks: HeldLock[] = [];
  const hold = async (i: number): Promise<T> => {
    const id = ids[i];
    if (id === undefined) return copyHeld(ctx, d, ids, locks, fn);
    return d.pool.withLock(id, 'snapshot copy', (lock) => {
      locks.push(lock);
      return hold(i + 1);
    });
  };
  return hold(0);
}

async function copyHeld<T>(
  ctx: CallContext,
  d: CopyDeps,
  ids: readonly string[],
  locks: readonly HeldLock[],
  fn: (plan: CopyPlan) => Promise<T>,
): Promise<T> {
  // Checked before the locks are taken too, but a DeleteVolume may have finished while they were waited
  // for, and a first NodeStageVolume may have initialized a source.
  const sources = new Map<string, HeldSource>();
  for (const volumeId of ids) {
    const meta = await d.volumes.get(volumeId);
    if (!meta) throw missing(`Volume ${volumeId} does not exist.`);
    const init = await d.volumes.initialization(volumeId);
    sources.set(volumeId, { meta, initialized: init !== undefined, sectorSize: init?.sectorSize });
  }
  const writers: Writer[] = [];
  for (const volumeId of ids) {
    for (const lease of await d.volumes.leases(volumeId)) {
      // An unreadable fence record names no node that could be asked to freeze: a writer may hold it.
      if (!isNodeId(lease.node))
        throw conflict(
          `The fence record of volume ${volumeId} cannot be read, so whoever writes it cannot be asked to freeze; nothing was copied. See loopvol check.`,
        );
      // A fenced node froze the filesystem for good: it writes no more.
      if (!lease.readonly && lease.fencedAt === undefined) writers.push({ volumeId, lease });
    }
  }
  // A raw block device in use cannot be frozen: only an atomic clone will do, and only of one, since
  // two clones one after the other would be of two instants (a torn group). Refused before anything
  // is frozen.
  const blockWriters = [
    ...new Set(writers.filter((w) => w.lease.accessType === 'block').map((w) => w.volumeId)),
  ];
  if (blockWriters.length > 1) throw tornGroup(blockWriters);
  const reflink = await d.pool.fs.canReflink();
  let ttlMs = CLONE_FREEZE_MS;
  if (!reflink && writers.length > 0) {
    const block = writers.find((w) => w.lease.accessType === 'block');
    if (block) {
      throw conflict(
        `Volume ${block.volumeId} is in use as a raw block device on node ${block.lease.node}, and this pool cannot reflink, so a copy would not stand for one instant; stop the workload, or use a pool on xfs or btrfs.`,
      );
    }
    let bytes = 0;
    for (const id of ids) bytes += await allocatedBytes(d.volumes.imagePath(id));
    const seconds = d.pool.fs.copySeconds(bytes);
    if (seconds * 1000 > d.freezeBudgetMs) {
      const w = writers[0];
      throw conflict(
        `Volume ${w?.volumeId ?? ids[0] ?? ''} is in use on node ${w?.lease.node ?? '?'} and this pool cannot reflink: copying its ${formatMiB(bytes)} would keep it frozen about ${Math.ceil(seconds)} s, more than the ${Math.round(d.freezeBudgetMs / 1000)} s freeze budget. Stop the workload (scale it to zero) and retry, or use a pool on xfs or btrfs.`,
      );
    }
    // Never frozen longer than the budget: a copy that has not finished by then is stopped.
    ttlMs = d.freezeBudgetMs + FREEZE_SLACK_MS;
  }

  // The pool's count is read now, not while something is frozen (each copy is admitted under its freeze).
  await d.capacity.report();
  const asked = performance.now();
  const holds = await freezeAll(ctx, d, writers, ttlMs);
  const signal = AbortSignal.any(locks.map((l) => l.signal));
  try {
    const frozenOnes = new Set(
      holds.filter((h) => h.answer.state === 'frozen').map((h) => h.writer.volumeId),
    );
    // Written right now without a freeze (a raw block device): only an atomic clone will do. The
    // leases said at most one such (above); the nodes' answers are the backstop (a lease unreadable
    // as such, say).
    const unfrozenWriters = new Set(
      holds.filter((h) => h.answer.state === 'not-freezable').map((h) => h.writer.volumeId),
    );
    if (unfrozenWriters.size > 1) throw tornGroup([...unfrozenWriters]);
    let copiesEnded = 0;
    const plan: CopyPlan = {
      takenAt: new Date(),
      source: (volumeId) => {
        const held = sources.get(volumeId);
        if (!held) throw new Error(`volume ${volumeId} is not a source of this copy`);
        return held;
      },
      copy: async (volumeId, dst) => {
        // A byte copy is safe when nothing writes the source, or it stays frozen until the copy ends.
        const allowCopy = !unfrozenWriters.has(volumeId);
        const frozen = frozenOnes.has(volumeId);
        const purpose = ctx.method === 'CreateVolume' ? 'clone' : 'snapshot';
        // Admitted here, under the source's lock and freeze: what it holds now is what gets shared.
        let settleSharing = await d.capacity.reserveSharing(volumeId, `a ${purpose} of volume ${volumeId}`);
        let settleBlocks: (() => void) | undefined;
        const left = asked + ttlMs - FREEZE_SLACK_MS - performance.now();
        if (frozen && left <= 0) {
          settleSharing();
          throw conflict(`The freeze of volume ${volumeId} ran out before its copy began; retry.`);
        }
        let started = performance.now();
        try {
          const result = await copyImage(ctx, d.volumes.imagePath(volumeId), dst, {
            allowCopy,
            signal,
            purpose,
            ...(frozen ? { timeoutMs: left } : {}),
            admitByteCopy: async (bytes) => {
              // A byte copy shares nothing; a snapshot's takes its blocks now (a clone's are in its own
              // reservation).
              settleSharing();
              settleSharing = () => undefined;
              if (purpose === 'snapshot')
                settleBlocks = await d.capacity.reserveBlocks(bytes, `a snapshot of volume ${volumeId}`);
              started = performance.now();
            },
          }).catch(async (err: unknown) => {
            if (!(frozen && err instanceof CommandError && err.reason === 'timeout')) throw err;
            const bytes = await allocatedBytes(d.volumes.imagePath(volumeId)).catch(() => 0);
            // The pool copies slower than it was judged to: remembered, so that the next attempt is
            // refused before anything is frozen (a retry would otherwise freeze the workload again). Not
            // when the freeze itself took most of the budget: that says nothing of the pool.
            if (performance.now() - started >= d.freezeBudgetMs / 2)
              d.pool.fs.recordUnfinishedCopy(bytes, d.freezeBudgetMs / 1000);
            throw conflict(
              `Copying volume ${volumeId} (${formatMiB(bytes)}) did not finish within its ${Math.round(d.freezeBudgetMs / 1000)} s freeze budget, so it was stopped and the volume thawed. Stop the workload (scale it to zero) and retry, or use a pool on xfs or btrfs.`,
              err,
            );
          });
          copiesEnded = Math.max(copiesEnded, performance.now());
          // A first NodeStageVolume takes no lock of the pool's to mark a volume initialized: one that
          // did so during the copy may have put data, or half a filesystem (a read-only stage formats
          // unfrozen), in it. Neither "blank" nor "initialized" would be true of the copy: the retry
          // decides again.
          if (sources.get(volumeId)?.initialized === false && (await d.volumes.initialization(volumeId)))
            throw busy(`Volume ${volumeId} was staged for the first time while it was copied; retry.`);
          if (result.method === 'sparse-copy') d.pool.fs.recordCopy(result.bytes, result.seconds);
          // What the copy shares with the source must be copied when the source rewrites it (capacity.ts).
          if (result.method === 'reflink') await d.volumes.markShared(volumeId, await allocatedBytes(dst));
          ctx.log.info(
            { source: volumeId, how: result.method, bytes: result.bytes, frozen },
            'copied volume image',
          );
          return result;
        } finally {
          settleSharing();
          settleBlocks?.();
        }
      },
    };
    const out = await fn(plan);
    // By this process's clock first: a node thaws when the time is up even if it cannot say so (a
    // pool that hangs), and its answer would still read "frozen". Its clock started after `asked`.
    // What counts is when the last copy ended, not the records written after.
    if (frozenOnes.size > 0 && copiesEnded > asked + ttlMs - FREEZE_SLACK_MS) {
      throw conflict(
        `The freezes ran out (${Math.round(ttlMs / 1000)} s) before the copies ended; the copies were discarded, retry.`,
      );
    }
    // The copies count only if every freeze held until now.
    for (const h of holds) {
      if (h.answer.state !== 'frozen') continue;
      const now = await d.board.answer(h.writer.lease.node, h.request);
      if (now?.state !== 'frozen') {
        throw conflict(
          `The freeze of volume ${h.writer.volumeId} on node ${h.writer.lease.node} ended before the copy did (${now?.state ?? 'no answer'}); the copy was discarded, retry.`,
        );
      }
    }
    for (const l of locks) l.assertHeld();
    return out;
  } finally {
    await releaseAll(ctx, d, holds);
  }
}

const tornGroup = (ids: readonly string[]) =>
  conflict(
    `Volumes ${ids.join(', ')} are raw block devices in use on nodes, which cannot be frozen, so their copies would be of different instants. Stop the workloads using all but one of them and retry.`,
  );

/** Asks every writer's node to freeze, and waits for all answers; any refusal releases the rest. */
async function freezeAll(
  ctx: CallContext,
  d: CopyDeps,
  writers: readonly Writer[],
  ttlMs: number,
): Promise<Hold[]> {
  const posted: { writer: Writer; request: QuiesceRequest }[] = [];
  try {
    for (const writer of writers) {
      const request = await d.board.post(
        writer.lease.node,
        writer.volumeId,
        ttlMs,
        d.requester,
        `copy of ${writer.volumeId}`,
      );
      posted.push({ writer, request });
    }
    const holds: Hold[] = [];
    const deadline = performance.now() + d.freezeWaitMs;
    for (const p of posted) {
      let answer = await d.board.answer(p.writer.lease.node, p.request);
      while (!answer && performance.now() < deadline) {
        await new Promise((r) => setTimeout(r, ANSWER_POLL_MS));
        answer = await d.board.answer(p.writer.lease.node, p.request);
      }
      if (!answer) {
        throw conflict(
          `Node ${p.writer.lease.node} did not answer a request to freeze volume ${p.writer.volumeId} within ${Math.round(d.freezeWaitMs / 1000)} s (is its node plugin running, or its freeze stuck on a slow filesystem?); no copy was made.`,
        );
      }
      if (answer.state === 'failed' || answer.state === 'expired' || answer.state === 'thawed') {
        throw conflict(
          `Node ${p.writer.lease.node} could not freeze volume ${p.writer.volumeId}: ${answer.message}; no copy was made.`,
        );
      }
      holds.push({ ...p, answer });
    }
    if (holds.some((h) => h.answer.state === 'frozen')) {
      ctx.log.info(
        {
          frozen: holds
            .filter((h) => h.answer.state === 'frozen')
            .map((h) => `${h.writer.volumeId}@${h.writer.lease.node}`),
        },
        'froze filesystems for a consistent copy',
      );
    }
    return holds;
  } catch (err) {
    await releaseAll(
      ctx,
      d,
      posted.map((p) => ({ ...p, answer: { volumeId: p.writer.volumeId, state: 'frozen', message: '' } })),
    );
    throw err;
  }
}

/**
 * Withdraws the requests, then waits (briefly) until their nodes have thawed, so that when the copy's
 * call returns, the pods write again and their volumes' node calls are no longer held up by the freeze.
 */
async function releaseAll(ctx: CallContext, d: CopyDeps, holds: readonly Hold[]): Promise<void> {
  const cx = detached(ctx);
  const withdrawn: Hold[] = [];
  for (const h of holds) {
    try {
      await d.board.withdraw(h.writer.lease.node, h.request);
      if (h.answer.state === 'frozen') withdrawn.push(h);
    } catch (err) {
      cx.log.error({ err }, 'could not withdraw a freeze request');
    }
  }
  const deadline = performance.now() + THAW_WAIT_MS;
  for (const h of withdrawn) {
    while ((await d.board.answer(h.writer.lease.node, h.request))?.state === 'frozen') {
      if (performance.now() > deadline) {
        cx.log.warn(
          { node: h.writer.lease.node, volumeId: h.writer.volumeId },
          'a node has not thawed yet; it will at its next look',
        );
        return;
      }
      await new Promise((r) => setTimeout(r, ANSWER_POLL_MS));
    }
  }
}

const formatMiB = (bytes: number): string => `${Math.round(bytes / 2 ** 20)} MiB`;
