/**
 * The node's side of freeze requests (pool/quiesce.ts): a loop that reads this node's requests a few
 * times a second, freezes the filesystem of a volume staged here when a controller asks, answers, and
 * thaws when the request is withdrawn or its time is up (by this node's clock), whichever comes first.
 *
 * A freeze holds the volume's node key (the one NodeUnpublish and NodeUnstage take, and fencing), so
 * a pod that goes away during a snapshot waits for the thaw (its calls get ABORTED and are retried)
 * instead of unmounting a frozen filesystem, which would leave its superblock frozen for good. A
 * filesystem fenced by this node (node/fence.ts) is frozen for good already: it is never thawed here.
 */
import { errnoCode } from '../errors.js';
import { bindExec, CommandError, detached, type Exec, type Runner } from '../exec/runner.js';
import type { Logger } from '../log.js';
import type { LoopDevice } from '../host/host.js';
import type { AnswerState, QuiesceAnswer, QuiesceBoard, QuiesceRequest } from '../pool/quiesce.js';
import { telemetry } from '../telemetry.js';
import { type FenceGuard, type KeyLocks, nodeKey } from './fence.js';
import { isDeviceBind, leaseView, loopOfMount, lookAtHost, type NodeDeps, stagingLoop } from './on-host.js';
import { othersLoops } from './neighbours.js';

const POLL_MS = 200;
/** How long an expiry waits to write "expired" before it thaws anyway. */
const EXPIRE_WRITE_MS = 1_000;

interface Frozen {
  request: QuiesceRequest;
  release: () => void;
  loop: LoopDevice;
  device: string;
  mountPoint: string;
  /** performance.now() at the freeze. */
  at: number;
}

export class QuiesceAgent {
  private readonly frozen = new Map<string, Frozen>();
  /** Requests being frozen right now (a freeze runs beside the loop, which keeps thawing meanwhile). */
  private readonly acting = new Set<string>();
  private readonly inFlight = new Set<Promise<void>>();
  /**
   * Filesystems that may be frozen although their freeze failed or their thaw did: thawed again every
   * round, their volume's key held (no unmount) until that succeeds.
   */
  private readonly stuck = new Map<string, Frozen>();
  private answers = new Map<string, QuiesceAnswer>();
  /** Bumped by every change of `answers`; `written` is the version the pool holds. */
  private version = 0;
  private written = 0;
  private timer: NodeJS.Timeout | undefined;
  private watchdog: NodeJS.Timeout | undefined;
  /** Expiries under way (the loop and the watchdog both start them); stop() waits for them. */
  private readonly expiries = new Set<Promise<void>>();
  /** The answers' writes, one after the other: the pool never ends up with an older map. */
  private writes: Promise<void> = Promise.resolve();
  private running: Promise<void> | undefined;
  private stopped = false;
  private readonly x: Exec;

  constructor(
    private readonly d: NodeDeps,
    private readonly board: QuiesceBoard,
    private readonly keys: KeyLocks,
    private readonly guard: FenceGuard,
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
    // Expiries by the clock alone, beside the loop: a round that hangs on the pool (a hard mount whose
    // server went away) must not keep a pod frozen past its time.
    this.watchdog = setInterval(() => {
      for (const f of [...this.frozen.values()]) if (this.due(f)) void this.expireOnce(f);
    }, POLL_MS);
    this.watchdog.unref();
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
    // A round that hangs on the pool is not waited for long; the watchdog keeps expiring meanwhile.
    await Promise.race([this.running, new Promise((r) => setTimeout(r, EXPIRE_WRITE_MS).unref())]);
    await Promise.allSettled([...this.inFlight]); // freezes started beside the loop
    // Said before the thaw, as an expiry is: a controller still copying under one of these must learn
    // that its copy is no longer frozen before anything can write the volume.
    for (const f of this.frozen.values()) this.sayExpired(f, 'the node plugin stopped; the freeze ended');
    if (!(await this.flushWithin(EXPIRE_WRITE_MS))) {
      // Not said: the controller would take a copy made after the thaw for frozen. Its own clock
      // discards copies that end past a freeze's time, so the thaw waits for that time (seconds).
      const until = Math.max(0, ...[...this.frozen.values()].map((f) => f.at + f.request.ttlMs));
      const wait = until - performance.now();
      if (wait > 0) await new Promise((r) => setTimeout(r, wait));
    }
    if (this.watchdog) clearInterval(this.watchdog);
    await Promise.allSettled([...this.expiries]);
    for (const f of [...this.frozen.values(), ...this.stuck.values()]) await this.thaw(f, 'thawed');
    if (this.answers.size > 0)
      await this.board.writeAnswers(this.d.nodeId, this.answers).catch(() => undefined);
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
      for (const f of [...this.frozen.values()]) if (this.due(f)) await this.expireOnce(f);
      return;
    }
    for (const f of [...this.frozen.values()]) {
      const standing = requests.get(f.request.volumeId);
      if (standing?.requestId !== f.request.requestId) await this.thaw(f, 'thawed');
      else if (this.due(f)) await this.expireOnce(f);
    }
    for (const r of requests.values()) {
      if (this.answers.has(r.requestId) || this.acting.has(r.requestId)) continue;
      this.acting.add(r.requestId);
      const work = this.act(r)
        .then((answer) => {
          if (answer) {
            this.answers.set(r.requestId, answer);
            this.version++;
          }
        })
        .finally(() => {
          this.acting.delete(r.requestId);
          this.inFlight.delete(work);
        });
      this.inFlight.add(work);
    }
    // Answers to requests that no longer stand are no longer read by anyone.
    const standingIds = new Set([...requests.values()].map((r) => r.requestId));
    for (const id of [...this.answers.keys()]) {
      if (!standingIds.has(id) && !this.frozen.has(id)) {
        this.answers.delete(id);
        this.version++;
      }
    }
    await this.flush();
  }

  private due(f: Frozen): boolean {
    return performance.now() - f.at > f.request.ttlMs;
  }

  private async expireOnce(f: Frozen): Promise<void> {
    // Taken out of `frozen` at once, before any wait: nothing else (a round that sees the request
    // withdrawn, the watchdog again) thaws it meanwhile, so no later freeze of the volume, under a new
    // request, is ever thawed by this one. Its key is held until its thaw, so none starts before.
    if (!this.frozen.delete(f.request.requestId)) return;
    const work = this.expire(f);
    this.expiries.add(work);
    try {
      await work;
    } finally {
      this.expiries.delete(work);
    }
  }

  /**
   * Thaws a freeze whose time is up. It says so first (a controller still copying must learn its copy
   * is no longer frozen), waiting at most EXPIRE_WRITE_MS for a pool that hangs: the controller
   * discards a copy that ended past this time by its own clock, whatever the answer says, and a pod
   * must not stay frozen.
   */
  private async expire(f: Frozen): Promise<void> {
    this.sayExpired(f, 'thawed when its time was up');
    await this.flushWithin(EXPIRE_WRITE_MS);
    await this.thaw(f, 'expired');
    this.log.warn(
      { volumeId: f.request.volumeId, by: f.request.by },
      'a freeze ran out of time and was thawed',
    );
  }

  private sayExpired(f: Frozen, message: string): void {
    this.answers.set(f.request.requestId, { volumeId: f.request.volumeId, state: 'expired', message });
    this.version++;
  }

  /** Whether the answers as they are now reached the pool within `ms`. */
  private async flushWithin(ms: number): Promise<boolean> {
    const version = this.version;
    await Promise.race([this.flush(), new Promise((r) => setTimeout(r, ms).unref())]);
    return this.written >= version;
  }

  private flush(): Promise<void> {
    const next = this.writes.then(() => this.write());
    this.writes = next;
    return next;
  }

  private async write(): Promise<void> {
    if (this.version === this.written) return;
    // An answer an in-flight freeze adds while this writes is a later version: written next time,
    // never taken for written (the map is serialized when the write starts).
    const version = this.version;
    try {
      await this.board.writeAnswers(this.d.nodeId, this.answers);
      this.written = version;
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
      // The device the lease records at its staging path is frozen even when the image's identity no
      // longer shows it (the pool was mounted again here); one that may be the volume fails the copy.
      const { on, doubtful } = await leaseView(this.d, await lookAtHost(this.d, this.x, r.volumeId));
      const loop = lease ? stagingLoop(on.loops, lease, on.mounts, this.d.bootId) : undefined;
      // Judged by what is mounted here, not by the lease alone: a writable mount of the volume on this
      // host is frozen whatever the records say.
      // Only this node's devices (another node plugin on a shared host has its own).
      const others = await othersLoops(this.d, on);
      const mine = on.loops.filter((l) => !others.has(l.name));
      const writable = on.mounts.find(
        (m) => !isDeviceBind(m) && !m.superOptions.includes('ro') && loopOfMount(m, mine),
      );
      if (doubtful.length > 0) {
        return answer(
          'failed',
          `${doubtful.map((l) => l.path).join(', ')}, which this node's lease of the volume names, may be the volume (its backing file cannot be told apart from the image); it cannot be frozen`,
        );
      }
      if (!writable) {
        if (lease?.accessType === 'block' && loop && !loop.readOnly) {
          return answer('not-freezable', 'staged as a raw block device: no filesystem to freeze');
        }
        // A filesystem holding a device of the volume with no mount this plugin can see (mounted in a
        // mount namespace that outlived the host's mounts) may be written, and cannot be frozen.
        for (const l of mine) {
          if (
            l.readOnly ||
            this.guard.isRecordedFence(l, r.volumeId) ||
            on.mounts.some((m) => loopOfMount(m, [l]))
          )
            continue;
          if (await this.d.host.claimed(l.path)) {
            return answer(
              'failed',
              `a filesystem of the volume is active on ${l.path} with no mount this node plugin can see (another mount namespace); it cannot be frozen`,
            );
          }
        }
        return answer('not-staged', 'not mounted for writing on this node');
      }
      const wloop = mine.find((l) => l.path === writable.source);
      if (!wloop) return answer('not-staged', 'not mounted for writing on this node');
      // Fenced: frozen for good already, which is frozen enough for any copy (and never thawed).
      if (this.guard.isRecordedFence(wloop, r.volumeId)) return answer('frozen', 'frozen for good (fenced)');
      // A fence is never thawed, so nothing is frozen for a copy that might be one.
      if (!this.guard.knowsFences) {
        return answer(
          'failed',
          "this node's record of fenced filesystems cannot be read, so it cannot tell whether this filesystem is fenced; nothing is frozen for a copy until the record is repaired",
        );
      }
      const frozen: Frozen = {
        request: r,
        release: got,
        loop: wloop,
        device: writable.source,
        mountPoint: writable.mountPoint,
        at: performance.now(),
      };
      keep = true;
      try {
        await this.d.host.freeze(this.x, writable.mountPoint);
      } catch (err) {
        // Frozen by someone else (EBUSY): not ours to thaw. Otherwise (a timeout, a kill) fsfreeze may
        // have frozen it before it ended: thaw it before letting go of the volume (or keep trying).
        const notOurs = err instanceof CommandError && err.reason === 'exit' && /busy/i.test(err.stderr);
        if (notOurs) got();
        else await this.thaw(frozen, 'failed');
        return answer(
          'failed',
          notOurs
            ? 'the filesystem is frozen by someone else'
            : err instanceof Error
              ? err.message
              : String(err),
        );
      }
      this.frozen.set(r.requestId, frozen);
      telemetry.froze('copy');
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
    if (this.guard.isFenced(f.loop, f.request.volumeId)) {
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
    if (state !== 'failed') telemetry.thawed((performance.now() - f.at) / 1000);
    if (state === 'thawed') {
      this.answers.set(f.request.requestId, { volumeId: f.request.volumeId, state, message: 'thawed' });
      this.version++;
    }
    if (state !== 'failed')
      this.log.info({ volumeId: f.request.volumeId, state }, 'thawed a filesystem frozen for a copy');
  }
}
