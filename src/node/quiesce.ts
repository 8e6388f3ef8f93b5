/**
 * The node's side of freeze requests (pool/quiesce.ts): a loop that reads this node's requests a few
 * times a second, freezes the filesystem of a volume staged here when a controller asks, answers, and
 * thaws when the request is withdrawn or its time is up (by this node's clock), whichever comes first.
 *
 * A freeze holds the volume's node key (the one NodeUnpublish and NodeUnstage take), so a pod that
 * goes away during a snapshot waits for the thaw (its calls get ABORTED and are retried) instead of
 * unmounting a frozen filesystem, which would leave its superblock frozen for good.
 */
import { errnoCode } from '../errors.js';
import { bindExec, type Exec, type Runner } from '../exec/runner.js';
import type { Logger } from '../log.js';
import { backingName } from '../host/loop.js';
import { IMAGE_FILE } from '../pool/layout.js';
import type { AnswerState, QuiesceAnswer, QuiesceBoard, QuiesceRequest } from '../pool/quiesce.js';
import { lookAtHost, type NodeDeps, stagingLoop } from './on-host.js';

/** The in-process keys calls hold (the server's in-flight set). */
export interface KeyLocks {
  tryAcquire(keys: readonly string[], holder: string): (() => void) | { heldBy: string; key: string };
}

/** The key node calls on a volume hold. */
export const nodeKey = (volumeId: string): string => `node:${volumeId}`;

const POLL_MS = 200;

interface Frozen {
  request: QuiesceRequest;
  release: () => void;
  device: string;
  mountPoint: string;
  /** performance.now() at the freeze. */
  at: number;
}

export class QuiesceAgent {
  private readonly frozen = new Map<string, Frozen>();
  private answers = new Map<string, QuiesceAnswer>();
  private timer: NodeJS.Timeout | undefined;
  private running: Promise<void> | undefined;
  private stopped = false;
  private readonly x: Exec;

  constructor(
    private readonly d: NodeDeps,
    private readonly board: QuiesceBoard,
    private readonly keys: KeyLocks,
    runner: Runner,
    private readonly log: Logger,
  ) {
    this.x = bindExec(runner, { log: log.child({ component: 'quiesce' }) });
  }

  /**
   * Starts answering. Requests standing now were a predecessor's to answer: whatever it froze was
   * thawed when this plugin started, so they are answered "expired" (a controller still copying under
   * one of them discards its copy) and never frozen again.
   */
  async start(): Promise<void> {
    await this.board.prepare(this.d.nodeId);
    for (const r of (await this.board.requests(this.d.nodeId)).values()) {
      this.answers.set(r.requestId, {
        volumeId: r.volumeId,
        state: 'expired',
        message: 'the node plugin restarted; the freeze ended',
      });
    }
    await this.board.writeAnswers(this.d.nodeId, this.answers);
    this.schedule();
  }

  private schedule(): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      this.running = this.tick()
        .catch((err: unknown) => {
          this.log.warn(
            { err: errnoCode(err) ?? String(err) },
            'reading freeze requests failed; trying again',
          );
        })
        .finally(() => {
          this.running = undefined;
          this.schedule();
        });
    }, POLL_MS);
    this.timer.unref();
  }

  /** Stops the loop and thaws whatever it holds frozen. */
  async stop(): Promise<void> {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    await this.running;
    for (const f of [...this.frozen.values()]) await this.thaw(f, 'thawed');
    if (this.answers.size > 0)
      await this.board.writeAnswers(this.d.nodeId, this.answers).catch(() => undefined);
  }

  /** One round: thaw what was withdrawn or expired, then act on new requests. */
  async tick(): Promise<void> {
    const requests = await this.board.requests(this.d.nodeId);
    let changed = false;
    for (const f of [...this.frozen.values()]) {
      const standing = requests.get(f.request.volumeId);
      if (standing?.requestId !== f.request.requestId) {
        await this.thaw(f, 'thawed');
        changed = true;
      } else if (performance.now() - f.at > f.request.ttlMs) {
        // Say so first: a controller still copying must learn that its copy is no longer frozen.
        this.answers.set(f.request.requestId, {
          volumeId: f.request.volumeId,
          state: 'expired',
          message: 'thawed when its time was up',
        });
        await this.board.writeAnswers(this.d.nodeId, this.answers);
        await this.thaw(f, 'expired');
        this.log.warn(
          { volumeId: f.request.volumeId, by: f.request.by },
          'a freeze ran out of time and was thawed',
        );
        changed = true;
      }
    }
    for (const r of requests.values()) {
      if (this.answers.has(r.requestId)) continue;
      const answer = await this.act(r);
      if (answer) {
        this.answers.set(r.requestId, answer);
        changed = true;
      }
    }
    // Answers to requests that no longer stand are no longer read by anyone.
    const standingIds = new Set([...requests.values()].map((r) => r.requestId));
    for (const id of [...this.answers.keys()]) {
      if (!standingIds.has(id) && !this.frozen.has(id)) {
        this.answers.delete(id);
        changed = true;
      }
    }
    if (changed) await this.board.writeAnswers(this.d.nodeId, this.answers);
  }

  /** Freezes for `r`; undefined when the volume is busy with a node call (asked again next round). */
  private async act(r: QuiesceRequest): Promise<QuiesceAnswer | undefined> {
    const answer = (state: AnswerState, message: string): QuiesceAnswer => ({
      volumeId: r.volumeId,
      state,
      message,
    });
    const got = this.keys.tryAcquire([nodeKey(r.volumeId)], 'freeze for a copy');
    if (typeof got !== 'function') return undefined;
    let keep = false;
    try {
      const lease = await this.d.volumes.lease(r.volumeId, this.d.nodeId);
      if (!lease || lease.readonly) return answer('not-staged', 'not staged for writing on this node');
      if (lease.accessType === 'block')
        return answer('not-freezable', 'staged as a raw block device: no filesystem to freeze');
      const on = await lookAtHost(this.d, this.x, r.volumeId);
      const loop = stagingLoop(on.loops, lease, on.mounts);
      if (!loop) return answer('not-staged', 'not mounted on this node');
      await this.d.host.freeze(this.x, lease.stagingPath);
      this.frozen.set(r.requestId, {
        request: r,
        release: got,
        device: loop.path,
        mountPoint: lease.stagingPath,
        at: performance.now(),
      });
      keep = true;
      this.log.info(
        { volumeId: r.volumeId, by: r.by, purpose: r.purpose, ttlMs: r.ttlMs },
        'froze a filesystem for a copy',
      );
      return answer('frozen', `frozen for at most ${Math.ceil(r.ttlMs / 1000)} s`);
    } catch (err) {
      return answer('failed', err instanceof Error ? err.message : String(err));
    } finally {
      if (!keep) got();
    }
  }

  private async thaw(f: Frozen, state: 'thawed' | 'expired'): Promise<void> {
    try {
      // Through any mount of the superblock: the staging mount is there (unmounts wait for the key).
      const thawed = await this.d.host.thawDevice(this.x, f.device);
      if (thawed === undefined)
        this.log.error({ device: f.device }, 'no mount of a frozen filesystem is left to thaw it through');
    } catch (err) {
      this.log.error(
        { device: f.device, mountPoint: f.mountPoint, err },
        'could not thaw a filesystem; run fsfreeze --unfreeze on it',
      );
    } finally {
      this.frozen.delete(f.request.requestId);
      f.release();
      if (state === 'thawed') {
        this.answers.set(f.request.requestId, { volumeId: f.request.volumeId, state, message: 'thawed' });
      }
      this.log.info({ volumeId: f.request.volumeId, state }, 'thawed a filesystem frozen for a copy');
    }
  }
}

/**
 * Thaws every filesystem of this pool mounted on this host. A plugin killed while it held a freeze
 * would leave applications blocked forever; the next start ends that. Thawing what is not frozen is
 * harmless (fsfreeze says so, and that is ignored).
 */
export async function thawLeftovers(d: NodeDeps, x: Exec): Promise<number> {
  const poolDev = (await d.host.fileId(d.poolRoot))?.dev;
  const loops = await d.host.loops(x, (l) => backingName(l) === IMAGE_FILE);
  const ofPool = loops.filter(
    (l) =>
      (l.backing !== undefined && l.backing.dev === poolDev) || l.backingFile.startsWith(`${d.poolRoot}/`),
  );
  const mounts = await d.host.mounts();
  let thawed = 0;
  for (const loop of ofPool) {
    try {
      if (await d.host.thawDevice(x, loop.path, mounts)) {
        thawed++;
        x.log.warn({ device: loop.path }, 'thawed a filesystem left frozen by an earlier run');
      }
    } catch (err) {
      x.log.error({ device: loop.path, err }, 'could not thaw a filesystem at start');
    }
  }
  return thawed;
}
