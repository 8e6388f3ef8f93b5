/**
 * The node's agent, a loop beside the CSI calls:
 *
 * Freeze requests (pool/quiesce.ts): it reads this node's requests a few times a second, freezes the
 * filesystem of a volume staged here when a controller asks, answers, and thaws when the request is
 * withdrawn or its time is up (by this node's clock), whichever comes first. A freeze holds the
 * volume's node key (the one NodeUnpublish and NodeUnstage take), so a pod that goes away during a
 * snapshot waits for the thaw (its calls get ABORTED and are retried) instead of unmounting a frozen
 * filesystem, which would leave its superblock frozen for good.
 *
 * Fencing: every few seconds it rewrites this node's heartbeat, and looks for a filesystem mounted
 * for writing here whose volume this node no longer holds (the CO detached it: a force-detach after a
 * partition). It freezes that filesystem for good, so the old pod's writes never reach the volume
 * another node may now use, records it (nodes/<node>.fenced, for this boot), and tells the pool (the
 * revoked lease is released). A fenced filesystem is never thawed; a reboot ends it.
 */
import { errnoCode } from '../errors.js';
import { bindExec, CommandError, detached, type Exec, type Runner } from '../exec/runner.js';
import type { Logger } from '../log.js';
import type { LoopDevice, MountEntry } from '../host/host.js';
import { backingName } from '../host/loop.js';
import { IMAGE_FILE } from '../pool/layout.js';
import type { AnswerState, QuiesceAnswer, QuiesceBoard, QuiesceRequest } from '../pool/quiesce.js';
import { type FencedEntry, HEARTBEAT_MS } from '../pool/nodes.js';
import {
  isDeviceBind,
  isThisPoolsVolume,
  loopOfMount,
  lookAtHost,
  type NodeDeps,
  othersLoops,
  stagingLoop,
} from './on-host.js';

/** The volume id the sysfs path of a loop device's backing file names, if it names one. */
function volumeIdShown(l: LoopDevice): string | undefined {
  return /\/(vol-[0-9a-f]{32})(\.[^/]*)?\/disk\.img( \(deleted\))?$/.exec(l.backingFile)?.[1];
}

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
  /** Requests being frozen right now (a freeze runs beside the loop, which keeps thawing meanwhile). */
  private readonly acting = new Set<string>();
  /**
   * Filesystems that may be frozen although their freeze failed or their thaw did: thawed again every
   * round, their volume's key held (no unmount) until that succeeds.
   */
  private readonly stuck = new Map<string, Frozen>();
  private answers = new Map<string, QuiesceAnswer>();
  private dirty = false;
  /** Devices frozen for good (fenced); never thawed. */
  private fenced: FencedEntry[] = [];
  private lastGuard = Number.NEGATIVE_INFINITY;
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
   * Ends a predecessor's freezes, before anything is thawed: requests standing now were its to answer,
   * and are answered "expired" (a controller still copying under one discards its copy) and never
   * frozen again. The caller thaws the pool's filesystems next (thawLeftovers), then calls run().
   */
  async prepare(): Promise<void> {
    this.fenced = await this.d.nodes.fenced(this.d.nodeId, this.d.bootId);
    await this.d.nodes.setFenced(this.d.nodeId, this.fenced); // an earlier boot's entries are gone
    await this.d.nodes.heartbeat(this.d.nodeId);
    await this.board.prepare(this.d.nodeId);
    for (const r of (await this.board.requests(this.d.nodeId)).values()) {
      this.answers.set(r.requestId, {
        volumeId: r.volumeId,
        state: 'expired',
        message: 'the node plugin restarted; the freeze ended',
      });
    }
    await this.board.writeAnswers(this.d.nodeId, this.answers);
  }

  /** Starts answering requests. */
  run(): void {
    this.schedule();
  }

  private schedule(): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => {
      this.running = this.tick().finally(() => {
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
    for (const f of [...this.frozen.values(), ...this.stuck.values()]) await this.thaw(f, 'thawed');
    if (this.answers.size > 0)
      await this.board.writeAnswers(this.d.nodeId, this.answers).catch(() => undefined);
  }

  private isFenced(device: string): boolean {
    return this.fenced.some((e) => e.device === device);
  }

  /**
   * Heartbeat, then fence what this node no longer holds: a writable filesystem of a pool volume
   * mounted here that no live lease of this node (nor of another node plugin on this host) explains.
   */
  async guard(): Promise<void> {
    await this.d.nodes.heartbeat(this.d.nodeId);
    const loops = await this.d.host.loops(this.x, (l) => backingName(l) === IMAGE_FILE);
    const mounts = await this.d.host.mounts();
    for (const m of mounts) {
      if (isDeviceBind(m) || m.superOptions.includes('ro') || this.isFenced(m.source)) continue;
      const loop = loops.find((l) => l.path === m.source);
      const id = loop ? volumeIdShown(loop) : undefined;
      if (!loop || !id || !(await isThisPoolsVolume(this.d, loop, id))) continue;
      if (await this.d.volumes.lease(id, this.d.nodeId)) continue;
      const on = await lookAtHost(this.d, this.x, id);
      if ((await othersLoops(this.d, on)).has(loop.name)) continue; // another node plugin on this host
      await this.fence(id, m);
    }
  }

  /** Freezes for good a filesystem of a volume taken from this node, records it, and tells the pool. */
  private async fence(id: string, m: MountEntry): Promise<void> {
    const frozenForCopy = [...this.frozen.values()].some((f) => f.device === m.source);
    if (!frozenForCopy) {
      try {
        await this.d.host.freeze(this.x, m.mountPoint);
      } catch (err) {
        const busy = err instanceof CommandError && /busy/i.test(err.stderr); // frozen already
        if (!busy) {
          this.log.error(
            { volumeId: id, mountPoint: m.mountPoint, err },
            'could not fence a volume taken from this node; trying again',
          );
          return;
        }
      }
    }
    const at = new Date().toISOString();
    this.fenced = [...this.fenced, { volumeId: id, device: m.source, bootId: this.d.bootId, at }];
    await this.d.nodes.setFenced(this.d.nodeId, this.fenced);
    await this.d.volumes.markFenced(id, this.d.nodeId, at);
    this.log.error(
      { volumeId: id, device: m.source, mountPoint: m.mountPoint },
      'a volume was taken from this node while mounted for writing: froze its filesystem for good (reboot the node to release it)',
    );
  }

  /** One round: thaw what was withdrawn, expired or stuck, then start freezes for new requests. */
  async tick(): Promise<void> {
    for (const f of [...this.stuck.values()]) await this.thaw(f, 'thawed');
    let requests: Map<string, QuiesceRequest>;
    try {
      requests = await this.board.requests(this.d.nodeId);
    } catch (err) {
      // Nobody can be asked to withdraw now, so time is what ends a freeze: expire what is due.
      this.log.warn({ err: errnoCode(err) ?? String(err) }, 'reading freeze requests failed; trying again');
      for (const f of [...this.frozen.values()]) if (this.due(f)) await this.expire(f);
      return;
    }
    for (const f of [...this.frozen.values()]) {
      const standing = requests.get(f.request.volumeId);
      if (standing?.requestId !== f.request.requestId) await this.thaw(f, 'thawed');
      else if (this.due(f)) await this.expire(f);
    }
    for (const r of requests.values()) {
      if (this.answers.has(r.requestId) || this.acting.has(r.requestId)) continue;
      this.acting.add(r.requestId);
      void this.act(r)
        .then((answer) => {
          if (answer) {
            this.answers.set(r.requestId, answer);
            this.dirty = true;
          }
        })
        .finally(() => this.acting.delete(r.requestId));
    }
    // Answers to requests that no longer stand are no longer read by anyone.
    const standingIds = new Set([...requests.values()].map((r) => r.requestId));
    for (const id of [...this.answers.keys()]) {
      if (!standingIds.has(id) && !this.frozen.has(id)) {
        this.answers.delete(id);
        this.dirty = true;
      }
    }
    await this.flush();
    if (performance.now() - this.lastGuard >= HEARTBEAT_MS) {
      this.lastGuard = performance.now();
      await this.guard().catch((err: unknown) => {
        this.log.warn(
          { err: errnoCode(err) ?? String(err) },
          'the heartbeat or the fence check failed; trying again',
        );
      });
    }
  }

  private due(f: Frozen): boolean {
    return performance.now() - f.at > f.request.ttlMs;
  }

  /**
   * Thaws a freeze whose time is up. It says so first (a controller still copying must learn its copy
   * is no longer frozen); if that cannot be written (a full or failing pool), it thaws all the same:
   * the controller stops copying before this time by its own clock, and a pod must not stay frozen.
   */
  private async expire(f: Frozen): Promise<void> {
    this.answers.set(f.request.requestId, {
      volumeId: f.request.volumeId,
      state: 'expired',
      message: 'thawed when its time was up',
    });
    this.dirty = true;
    await this.flush();
    await this.thaw(f, 'expired');
    this.log.warn(
      { volumeId: f.request.volumeId, by: f.request.by },
      'a freeze ran out of time and was thawed',
    );
  }

  private async flush(): Promise<void> {
    if (!this.dirty) return;
    try {
      await this.board.writeAnswers(this.d.nodeId, this.answers);
      this.dirty = false;
    } catch (err) {
      this.log.warn(
        { err: errnoCode(err) ?? String(err) },
        'writing the answers to freeze requests failed; trying again',
      );
    }
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
      const on = await lookAtHost(this.d, this.x, r.volumeId);
      const loop = lease ? stagingLoop(on.loops, lease, on.mounts) : undefined;
      // Judged by what is mounted here, not by the lease alone: a writable mount of the volume on this
      // host is frozen whatever the records say.
      // Only this node's devices (another node plugin on a shared host has its own).
      const others = await othersLoops(this.d, on);
      const mine = on.loops.filter((l) => !others.has(l.name));
      const writable = on.mounts.find(
        (m) => !isDeviceBind(m) && !m.superOptions.includes('ro') && loopOfMount(m, mine),
      );
      if (!writable) {
        if (lease?.accessType === 'block' && loop && !loop.readOnly) {
          return answer('not-freezable', 'staged as a raw block device: no filesystem to freeze');
        }
        return answer('not-staged', 'not mounted for writing on this node');
      }
      // Fenced: frozen for good already, which is frozen enough for any copy (and never thawed).
      if (this.isFenced(writable.source)) return answer('frozen', 'frozen for good (fenced)');
      const frozen: Frozen = {
        request: r,
        release: got,
        device: writable.source,
        mountPoint: writable.mountPoint,
        at: performance.now(),
      };
      keep = true;
      try {
        await this.d.host.freeze(this.x, writable.mountPoint);
      } catch (err) {
        // fsfreeze is killed only once FIFREEZE returned: the filesystem may be frozen. Thaw it before
        // letting go of the volume (or keep trying, holding it).
        await this.thaw(frozen, 'failed');
        return answer('failed', err instanceof Error ? err.message : String(err));
      }
      this.frozen.set(r.requestId, frozen);
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

  /** Thaws; a thaw that fails keeps the volume's key and is tried again every round. */
  private async thaw(f: Frozen, state: 'thawed' | 'expired' | 'failed'): Promise<void> {
    this.frozen.delete(f.request.requestId);
    if (this.isFenced(f.device)) {
      // Fenced while frozen for the copy: it stays frozen.
      this.stuck.delete(f.device);
      f.release();
      return;
    }
    try {
      // Through any mount of the superblock: the staging mount is there (unmounts wait for the key).
      const thawed = await this.d.host.thawDevice(detached(this.x), f.device);
      if (thawed === undefined) {
        this.log.error({ device: f.device }, 'no mount of a frozen filesystem is left to thaw it through');
      }
    } catch (err) {
      this.stuck.set(f.device, f);
      this.log.error(
        { device: f.device, mountPoint: f.mountPoint, err },
        'could not thaw a filesystem; trying again (fsfreeze --unfreeze by hand would end it too)',
      );
      return;
    }
    this.stuck.delete(f.device);
    f.release();
    if (state === 'thawed') {
      this.answers.set(f.request.requestId, { volumeId: f.request.volumeId, state, message: 'thawed' });
      this.dirty = true;
    }
    if (state !== 'failed')
      this.log.info({ volumeId: f.request.volumeId, state }, 'thawed a filesystem frozen for a copy');
  }
}

/**
 * Thaws every filesystem of this pool mounted on this host. A plugin killed while it held a freeze
 * would leave applications blocked forever; the next start ends that. Thawing what is not frozen is
 * harmless (fsfreeze says so, and that is ignored).
 */
export async function thawLeftovers(d: NodeDeps, x: Exec): Promise<number> {
  const fenced = new Set((await d.nodes.fenced(d.nodeId, d.bootId)).map((e) => e.device));
  const loops = (await d.host.loops(x, (l) => backingName(l) === IMAGE_FILE)).filter(
    (l) => !fenced.has(l.path),
  );
  const mounts = await d.host.mounts();
  let thawed = 0;
  for (const loop of loops) {
    // Only this pool's volumes: the id the path names, and (when it can be read) the same file.
    const id = volumeIdShown(loop);
    if (!id || !(await isThisPoolsVolume(d, loop, id))) continue;
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
