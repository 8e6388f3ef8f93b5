/**
 * Fencing, the node's side: what this node does when a volume is taken from it while it may still
 * write it (the CO detached it, a force-detach: Kubernetes does it when a node stops answering).
 *
 * The controller revokes the node's lease and lists the volume in the node's revocations
 * (nodes/<node>.revoked). Every few seconds this guard rewrites the node's heartbeat, reads that list,
 * and settles each volume: a filesystem of it mounted for writing here is frozen for good (the old
 * pod's writes hang instead of reaching a volume another node may now use), recorded for this boot
 * (nodes/<node>.fenced), and confirmed to the pool (the revoked lease gets fencedAt), which lets another
 * node stage it. With nothing writable here, it confirms at once. A raw block device in use cannot be
 * frozen: it is not confirmed until the node unstages it.
 *
 * A fenced filesystem is never thawed by the driver (not at start, unstage, restage, nor after a
 * snapshot): a reboot ends it. Only this node's own freezes count: a filesystem someone else froze
 * (EBUSY) is frozen again by this node once they thaw it, before anything is confirmed.
 */
import { conflict } from '../errors.js';
import { CommandError, detached, type Exec, bindExec, type Runner } from '../exec/runner.js';
import type { LoopDevice } from '../host/host.js';
import { backingName } from '../host/loop.js';
import type { Logger } from '../log.js';
import { IMAGE_FILE } from '../pool/layout.js';
import { type FencedEntry, HEARTBEAT_MS } from '../pool/nodes.js';
import type { Pool } from '../pool/pool.js';
import { telemetry } from '../telemetry.js';
import {
  fencedError,
  isDeviceBind,
  isFencedIn,
  isThisPoolsVolume,
  leaseView,
  loopOfMount,
  lookAtHost,
  type NodeDeps,
  stagingLoop,
} from './on-host.js';
import { othersLoops } from './neighbours.js';

/** The in-process keys calls hold (the server's in-flight set). */
export interface KeyLocks {
  tryAcquire(keys: readonly string[], holder: string): (() => void) | { heldBy: string; key: string };
}

/** The key node calls on a volume hold (and freezes, and fencing). */
export const nodeKey = (volumeId: string): string => `node:${volumeId}`;

/**
 * Refuses to stage volume `id` on this node when a device of it was frozen for good here in this boot:
 * attached still, or released since (its filesystem thawed by hand). The guard would take the device
 * the next attach of the image gets (the same number and file) for the fence it recorded, and confirm
 * a fence without freezing anything. A record that cannot be read may hold such a device: refused too.
 */
export async function refuseFencedHere(d: NodeDeps, id: string, loops: readonly LoopDevice[]): Promise<void> {
  const entries = await d.nodes.fenced(d.nodeId, d.bootId);
  if (entries === 'unreadable') {
    throw conflict(
      `This node's record of the filesystems it froze for good (nodes/${d.nodeId}.fenced in the pool) cannot be read, so volume ${id} is not staged here until it is repaired.`,
    );
  }
  const mine = entries.filter((e) => e.volumeId === id);
  const fenced = loops.find((l) => isFencedIn(mine, l))?.path ?? mine[0]?.device;
  if (fenced) throw fencedError(id, fenced);
}

export class FenceGuard {
  private fenced: FencedEntry[] | 'unreadable' = [];
  private timer: NodeJS.Timeout | undefined;
  private beat: NodeJS.Timeout | undefined;
  private running: Promise<void> | undefined;
  private stopped = false;
  private readonly x: Exec;
  private readonly warned = new Set<string>();
  /** Filesystems this guard froze whose record could not be written yet, by "<volume> <device>". */
  private readonly unsaved = new Map<string, FencedEntry>();

  constructor(
    private readonly d: NodeDeps,
    private readonly pool: Pool,
    private readonly keys: KeyLocks,
    runner: Runner,
    private readonly log: Logger,
  ) {
    this.x = bindExec(runner, { log: log.child({ component: 'fence' }) });
  }

  /** Loads this boot's fences (never rewriting an unreadable record) and writes a first heartbeat. */
  async prepare(): Promise<void> {
    this.fenced = await this.d.nodes.fenced(this.d.nodeId, this.d.bootId);
    if (this.fenced === 'unreadable') {
      this.log.error(
        { file: this.pool.layout.nodeFenced(this.d.nodeId) },
        'the record of fenced filesystems cannot be read: no filesystem of this pool is thawed on this node until it is repaired',
      );
    } else {
      await this.d.nodes.setFenced(this.d.nodeId, this.fenced); // an earlier boot's entries are gone
    }
    await this.d.nodes.heartbeat(this.d.nodeId);
  }

  /** Whether this node's record of fences could be read: when not, any device may be a fence. */
  get knowsFences(): boolean {
    return this.fenced !== 'unreadable';
  }

  /**
   * Whether `loop` is known to be a fence of volume `volumeId` (frozen for good already, so neither
   * frozen again nor taken for a filesystem someone may write): an unreadable record proves nothing.
   */
  isRecordedFence(loop: LoopDevice, volumeId: string): boolean {
    return this.knowsFences && this.isFenced(loop, volumeId);
  }

  /**
   * Whether `loop` is a fence this node recorded: of volume `volumeId` when given (to skip freezing it,
   * so a device number another volume's fence once had never counts), of any volume otherwise (to
   * never thaw it).
   */
  isFenced(loop: LoopDevice, volumeId?: string): boolean {
    const f = this.fenced;
    return isFencedIn(f === 'unreadable' || !volumeId ? f : f.filter((e) => e.volumeId === volumeId), loop);
  }

  run(): void {
    if (this.stopped) return;
    // The heartbeat has its own timer: a round busy fencing (fsfreeze flushing a lot to a slow pool,
    // a lock wait, many volumes) must not look like a node that stopped (release-node, and
    // --node-fence-seconds, let go of a node whose heartbeat does not change).
    if (!this.beat) {
      let writing = false;
      this.beat = setInterval(() => {
        if (writing) return; // a write hung on the pool: the heartbeat stops changing, as it should
        writing = true;
        this.d.nodes
          .heartbeat(this.d.nodeId)
          .catch((err: unknown) => {
            this.log.warn({ err }, 'could not write the heartbeat; trying again');
          })
          .finally(() => {
            writing = false;
          });
      }, HEARTBEAT_MS);
      this.beat.unref();
    }
    this.timer = setTimeout(() => {
      this.running = this.round()
        .catch((err: unknown) => {
          this.log.warn({ err }, 'the fence round failed; trying again');
        })
        .finally(() => {
          this.running = undefined;
          this.run();
        });
    }, HEARTBEAT_MS);
    this.timer.unref();
  }

  async stop(): Promise<void> {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    if (this.beat) clearInterval(this.beat);
    await this.running;
  }

  /** Settles every volume taken from this node (the heartbeat has a timer of its own, see run). */
  async round(): Promise<void> {
    // Repaired since it could not be read: this boot's fences are known again.
    if (this.fenced === 'unreadable') this.fenced = await this.d.nodes.fenced(this.d.nodeId, this.d.bootId);
    for (const id of await this.d.nodes.revocations(this.d.nodeId)) {
      await this.settle(id).catch((err: unknown) => {
        this.log.error({ volumeId: id, err }, 'could not settle a volume taken from this node; trying again');
      });
    }
  }

  /** Settled: a freeze of it this guard could not record is no longer one to record (see settle). */
  private forgetUnsaved(id: string): void {
    for (const key of this.unsaved.keys()) if (key.startsWith(`${id} `)) this.unsaved.delete(key);
  }

  /** Fences (or confirms at once) one volume taken from this node, holding its key meanwhile. */
  async settle(id: string): Promise<void> {
    const release = this.keys.tryAcquire([nodeKey(id)], 'fence');
    if (typeof release !== 'function') return; // a call or a freeze is at work on it: next round
    try {
      const mine = (await this.d.volumes.leases(id)).find((l) => l.node === this.d.nodeId);
      if (mine?.revokedAt === undefined) {
        await this.d.nodes.changeRevocation(this.pool, this.d.nodeId, id, false); // settled already
        this.forgetUnsaved(id);
        return;
      }
      // Released without this node's word (seen silent, or an operator's release-node) is no reason
      // to keep writing: a node that was only cut off, or not dead after all, still freezes what it has.
      const releasedByOthers = mine.fencedAt !== undefined;
      // What the lease names counts too: a device the image's identity no longer shows (the pool was
      // mounted again here) may still be written, and is frozen like any other of the volume's.
      const { on, doubtful } = await leaseView(this.d, await lookAtHost(this.d, this.x, id), () =>
        Promise.resolve(mine),
      );
      const others = await othersLoops(this.d, on);
      const loops = on.loops.filter((l) => !others.has(l.name));
      const unsure = doubtful.filter((l) => !others.has(l.name));
      if (!mine.readonly && mine.accessType === 'block' && loops.some((l) => !l.readOnly)) {
        if (!this.warned.has(id)) {
          this.warned.add(id);
          this.log.error(
            { volumeId: id },
            'a raw block volume was taken from this node while attached for writing; it cannot be frozen, so it stays held until this node unstages it',
          );
        }
        return;
      }
      // Fenced by this node's own record: an unreadable record proves nothing here (every filesystem
      // writable is frozen again, and nothing is confirmed until the record is repaired).
      let froze = 0;
      let hidden: LoopDevice | undefined;
      for (const loop of loops) {
        if (this.isRecordedFence(loop, id)) continue;
        const writable = on.mounts.find(
          (m) => !isDeviceBind(m) && !m.superOptions.includes('ro') && loopOfMount(m, [loop]),
        );
        if (!writable) {
          // A filesystem holds the device with no mount of it here (mounted in a mount namespace this
          // plugin cannot see, such as a container's that outlived the host's mounts): it may write, and
          // cannot be reached to freeze. Nothing is confirmed while it lasts.
          const seen = on.mounts.some((m) => loopOfMount(m, [loop]));
          if (!loop.readOnly && !seen && (await this.d.host.claimed(loop.path))) hidden = loop;
          continue;
        }
        // Our own freeze, or none: a filesystem frozen by someone else says busy, and is frozen by
        // this node once they thaw it. One this guard froze but could not record says busy too: taken
        // as still frozen, and recorded now (a freeze cannot tell whose it is: a thaw by hand followed
        // by someone else's freeze before this round would be taken for ours).
        const key = `${id} ${loop.path}`;
        const backingDev = loop.backing?.dev ?? '';
        const backingIno = loop.backing?.ino ?? '';
        const saved = this.unsaved.get(key);
        // The same attachment only (a device detached since and attached again is another one).
        const pending =
          saved?.backingDev === backingDev && saved.backingIno === backingIno ? saved : undefined;
        await this.d.host.freeze(this.x, writable.mountPoint).catch((err: unknown) => {
          if (!pending || !(err instanceof CommandError && err.reason === 'exit' && /busy/i.test(err.stderr)))
            throw err;
        });
        const entry: FencedEntry = pending ?? {
          volumeId: id,
          device: loop.path,
          backingDev,
          backingIno,
          bootId: this.d.bootId,
          at: new Date().toISOString(),
        };
        if (!pending) telemetry.froze('fence');
        this.unsaved.set(key, entry);
        if (this.fenced === 'unreadable') throw new Error('the record of fenced filesystems cannot be read');
        // Counted as a fence only once written: what confirms it is the file a stage here reads.
        const next = [...this.fenced, entry];
        await this.d.nodes.setFenced(this.d.nodeId, next);
        this.fenced = next;
        this.unsaved.delete(key);
        froze++;
        this.log.error(
          { volumeId: id, device: loop.path, mountPoint: writable.mountPoint },
          'a volume was taken from this node while mounted for writing: froze its filesystem for good (reboot the node to release it)',
        );
      }
      if (unsure.length > 0) {
        if (!this.warned.has(id)) {
          this.warned.add(id);
          this.log.error(
            { volumeId: id, devices: unsure.map((l) => l.path), stagingPath: mine.stagingPath },
            "a volume was taken from this node while a loop device its lease names (its device, or one mounted at its staging path) may still be it: its backing file cannot be told apart from the volume's image, so nothing is confirmed; it stays held until that device is gone (unmount and detach it by hand if it is not the volume)",
          );
        }
        return;
      }
      if (hidden) {
        if (!this.warned.has(id)) {
          this.warned.add(id);
          this.log.error(
            { volumeId: id, device: hidden.path },
            'a volume was taken from this node while a filesystem of it is still active here with no mount this plugin can see (another mount namespace); it stays held until that ends',
          );
        }
        return;
      }
      const how =
        froze > 0 || loops.some((l) => this.isRecordedFence(l, id))
          ? 'froze its filesystem for good'
          : 'nothing of it was writable here';
      if (!releasedByOthers)
        await this.d.volumes.markFenced(id, this.d.nodeId, `node ${this.d.nodeId} ${how}`);
      await this.d.nodes.changeRevocation(this.pool, this.d.nodeId, id, false);
      this.forgetUnsaved(id);
    } finally {
      release();
    }
  }
}

/**
 * Thaws the filesystems of this node's own volumes (a lease of this node not yet confirmed as fenced,
 * its staging device) mounted on this host. A plugin killed while it held a freeze for a copy would leave applications
 * blocked forever; the next start ends that. Fences, other nodes' devices, other pools' volumes and
 * anything when the fence record cannot be read are left alone.
 */
export async function thawLeftovers(d: NodeDeps, x: Exec, guard: FenceGuard): Promise<number> {
  const loops = await d.host.loops(x, (l) => backingName(l) === IMAGE_FILE);
  const mounts = await d.host.mounts();
  let thawed = 0;
  for (const loop of loops) {
    const id = volumeIdShown(loop);
    if (!id || guard.isFenced(loop, id) || !(await isThisPoolsVolume(d, loop, id))) continue;
    // This node's lease, revoked or not: a volume taken from this node is not fenced until the guard
    // freezes it, which it cannot do to a filesystem still frozen by a predecessor (EBUSY). One it has
    // confirmed is never thawed (another node may use it now).
    const lease = (await d.volumes.leases(id)).find((l) => l.node === d.nodeId);
    if (
      !lease ||
      lease.fencedAt !== undefined ||
      stagingLoop(
        loops.filter((l) => l.name === loop.name),
        lease,
        mounts,
        d.bootId,
      )?.name !== loop.name
    )
      continue;
    try {
      if (await d.host.thawDevice(detached(x), loop.path, mounts)) {
        thawed++;
        x.log.warn({ device: loop.path }, 'thawed a filesystem left frozen by an earlier run');
      }
    } catch (err) {
      x.log.error({ device: loop.path, err }, 'could not thaw a filesystem at start');
    }
  }
  return thawed;
}

/** The volume id the sysfs path of a loop device's backing file names, if it names one. */
export function volumeIdShown(l: LoopDevice): string | undefined {
  return /\/(vol-[0-9a-f]{32})(\.[^/]*)?\/disk\.img( \(deleted\))?$/.exec(l.backingFile)?.[1];
}
