/**
 * NodeStageVolume: how a volume is staged on this host.
 *
 *  1. Answer at once when it is already staged as asked (the host's mount table decides; restage.ts).
 *  2. Take this node's lease on the volume: the node-side fence (no other node may hold it).
 *  3. Attach the image as a loop device, or reuse an attachment an interrupted call left.
 *  4. Raw block: done (the lease records the device). Filesystem: decide under the volume's format
 *     lock whether to format (format.ts), check and grow an existing one, mount it at the staging
 *     path, and grow it online where that is how it grows.
 * Every step the call took is undone when a later one fails, or when the caller gives up (cancelled,
 * or past its deadline): the undo runs detached from the caller's cancellation.
 */
import { broken, conflict, invalid } from '../errors.js';
import { checkpoint, CommandError, detached, type Exec } from '../exec/runner.js';
import { failpoint, pausepoint } from '../failpoints.js';
import type { LoopDevice } from '../host/host.js';
import { mountErrorLine } from '../host/mounts.js';
import { type Capability, type FsType, isReaderOnly, type Lease } from '../pool/types.js';
import { sideBySide } from '../pool/fsutil.js';
import type { Initialization } from '../pool/volumes.js';
import { refuseFencedHere } from './fence.js';
import { filesystemOn } from './format.js';
import { refuseNonDirectory } from './places.js';
import { alreadyStaged, stillOpen } from './restage.js';
import { checkAndGrowOffline, growMounted } from './grow.js';
import {
  callerPath,
  checkTargetPlace,
  classifyAt,
  heldReadOnly,
  isDeviceBind,
  isSymlinkPath,
  leaseView,
  refuseDoubtful,
  loopOfMount,
  lookAtHost,
  mustGetVolume,
  type NodeDeps,
  refuseHidingFiles,
  shows,
} from './on-host.js';
import { type Held, holdReused, mountedIsTheVolume, notMarkedToGo } from './held.js';
import { lookBesideNeighbours, untouchable } from './neighbours.js';

export interface StageRequest {
  id: string;
  staging: string;
  cap: Capability;
  /** The pool the controller published from (publish context), when it said. */
  publishPool: string | undefined;
  /** The id of the volume's pool (volume or publish context), when it said. */
  poolId: string | undefined;
  /** The controller published the volume to this node read-only, as the publish context says. */
  publishedReadOnly: boolean | undefined;
}

/** Mount options for a staged filesystem. XFS always gets nouuid, so a clone mounts beside its source. */
export function stageMountOptions(fsType: FsType, readOnly: boolean, userFlags: readonly string[]): string[] {
  const userRo = userFlags.includes('ro');
  const opts = userFlags.filter((f) => f !== 'rw' && f !== 'ro');
  if (readOnly) {
    opts.unshift('ro');
    // A read-only device cannot replay a journal; mount what is on disk.
    if (fsType === 'ext4') opts.push('noload');
    if (fsType === 'xfs') opts.push('norecovery');
  } else if (userRo) {
    // Read-only asked for in the mount options: a read-only mount of a writable device (its journal
    // is replayed, so what is mounted is consistent).
    opts.unshift('ro');
  }
  if (fsType === 'xfs' && !opts.includes('nouuid')) opts.push('nouuid');
  // ext4 keeps writing after it finds an inconsistency unless told otherwise (its default is
  // errors=continue): read-only instead stops the damage, shows in the mount and in the volume's
  // condition, and the next stage checks it. An errors= flag of the StorageClass's own wins.
  if (fsType === 'ext4' && !opts.includes('ro') && !opts.some((o) => o.startsWith('errors=')))
    opts.push('errors=remount-ro');
  return [...new Set(opts)];
}

/** What a stage did so far, undone in reverse order when it fails. */
type Undo = (x: Exec) => Promise<unknown>;

export async function stageVolume(d: NodeDeps, x: Exec, r: StageRequest): Promise<void> {
  if (r.poolId !== undefined && r.poolId !== d.poolId) {
    throw conflict(
      `Volume ${r.id} belongs to pool ${r.poolId}, but the pool at ${d.poolRoot} on this node is ${d.poolId}: is the right filesystem mounted there? Nothing was touched.`,
    );
  }
  const vol = await mustGetVolume(d, r.id);
  if (r.publishPool !== undefined && r.publishPool !== d.poolName) {
    throw conflict(
      `Volume ${r.id} was published from pool ${r.publishPool}, but this node serves ${d.poolName}.`,
    );
  }
  const staging = await callerPath(d, r.staging, 'staging_target_path');
  if (await isSymlinkPath(d, r.staging))
    throw invalid(
      `staging_target_path ${r.staging} is a symbolic link; the driver stages on a path it creates.`,
    );
  // A filesystem published read-only (ControllerPublishVolume readonly) is staged as its access mode
  // says, its journal replayed and checked on a writable device (a read-only one would hide what the
  // journal holds), and its pods get read-only binds (publish.ts). A raw block device is itself
  // read-only: a read-only bind of a writable device node still writes.
  const [published, seen] = await Promise.all([
    heldReadOnly(d, r.id, r.cap.mode, r.publishedReadOnly),
    lookBesideNeighbours(d, x, r.id),
  ]);
  const readOnly = r.cap.accessType === 'block' ? published : isReaderOnly(r.cap.mode);
  // The device this node's lease records stays the volume's after the pool was mounted again here (see
  // leaseView); one that may be it never gets a second device of the image beside it.
  const { on, doubtful } = await leaseView(d, seen);
  refuseDoubtful(r.id, doubtful, 'staged');
  await refuseFencedHere(d, r.id, on.loops);
  const ownLease = await d.volumes.lease(r.id, d.nodeId);
  if (await alreadyStaged(d, x, on, r, staging, { readOnly, published }, ownLease)) return;
  checkTargetPlace(on, staging, { field: 'staging_target_path', kubeletDir: d.kubeletDir });
  // Nothing is mounted at a filesystem's staging path here (alreadyStaged saw to it). A raw block
  // staging mounts nothing there: at a path with a mount (another volume's staging), its unstage
  // would find that mount, not its own, for good.
  if (r.cap.accessType === 'mount') {
    await refuseNonDirectory(d, staging, 'staging_target_path');
    await refuseHidingFiles(d, staging, 'staging_target_path');
  }
  const there = on.mounts.filter((m) => m.mountPoint === staging).at(-1);
  if (there)
    throw conflict(
      `staging_target_path ${staging} has ${there.source} mounted on it, which is not volume ${r.id}; stage it at a path of its own.`,
    );

  // A loop device of this image that nothing uses is a leftover of an interrupted call: reused when it
  // is attached the right way round, detached otherwise. One in use is another staging's.
  const others = await untouchable(d, on);
  const mine = on.loops.filter((l) => !others.has(l.name));
  const inUse = (l: LoopDevice): boolean => on.mounts.some((m) => loopOfMount(m, [l]));
  // One attached the same way and mounted somewhere here (a pod's bind of a staging mount that is
  // gone) is the filesystem in use: it is the one staged again, as a live filesystem (the kernel hands
  // back its superblock; nothing checks or formats it). A second device would mount the same image
  // twice, two filesystems on one disk.
  const sameWay = mine.filter((l) => l.readOnly === readOnly);
  const usable = [...sameWay.filter(inUse), ...sameWay.filter((l) => !inUse(l))];
  if (r.cap.accessType === 'mount' && usable.length > 1 && !usable.some(inUse)) {
    // Several devices and none mounted here: one a filesystem holds (mounted in a namespace this
    // plugin cannot see) is that live filesystem, the one to mount again. Checking and mounting another
    // would run a second filesystem on the same disk.
    const held: LoopDevice[] = [];
    for (const l of usable) if (await d.host.claimed(l.path)) held.push(l);
    if (held.length > 1)
      throw conflict(
        `Volume ${r.id} is held by filesystems on several devices (${held.map((l) => l.path).join(', ')}) with no mount on this host; it is left alone.`,
      );
    if (held[0]) usable.sort((a, b) => Number(b === held[0]) - Number(a === held[0]));
  }
  // Reused live only by a request of the same kind: a raw block stage never gets a device under a
  // filesystem (mounted here, or held in a namespace this plugin cannot see), a filesystem stage never
  // mounts a device a pod uses raw.
  const live = usable.find(inUse);
  if (live) {
    const asFilesystem = on.mounts.some((m) => !isDeviceBind(m) && loopOfMount(m, [live]));
    if (asFilesystem !== (r.cap.accessType === 'mount')) {
      throw conflict(
        `Volume ${r.id} is in use on this node through ${live.path} as ${asFilesystem ? 'a mounted filesystem' : 'a raw block device'}; it cannot be staged as ${asFilesystem ? 'a raw block device' : 'a filesystem'} until that ends.`,
      );
    }
  } else if (r.cap.accessType === 'block') {
    for (const l of usable) {
      if (await d.host.claimed(l.path)) {
        throw conflict(
          `A filesystem of volume ${r.id} is still active on ${l.path} with no mount on this host (left frozen, or mounted in another mount namespace); it cannot be staged as a raw block device.`,
        );
      }
    }
  }
  const stale = mine.filter((l) => l.readOnly !== readOnly);
  const busyOne = stale.find(inUse);
  if (busyOne) {
    throw conflict(
      `Volume ${r.id} is in use on this node ${busyOne.readOnly ? 'read-only' : 'read-write'} (${busyOne.path}); it cannot also be staged ${readOnly ? 'read-only' : 'read-write'}.`,
    );
  }

  // A device the kernel detaches once its last user closes it (an unstage asked while a process held it
  // open) is staged again only as the live filesystem a mount keeps open: a raw block staging does not
  // hold it, so it would go from under the pod, and its number to another volume's image.
  for (const l of usable) {
    if (!l.autoclear || (r.cap.accessType === 'mount' && (inUse(l) || (await d.host.claimed(l.path)))))
      continue;
    throw stillOpen(r.id, l.path);
  }

  // The node-side fence: no other node may hold it.
  const lease: Lease = {
    node: d.nodeId,
    stagingPath: staging,
    accessType: r.cap.accessType,
    mode: r.cap.mode,
    readonly: readOnly,
    since: new Date().toISOString(),
    bootId: d.bootId,
    ...(r.cap.accessType === 'mount' ? { mountFlags: r.cap.mountFlags } : {}),
  };
  const previous = await d.volumes.takeLease(r.id, lease);
  if (previous && previous.stagingPath !== staging) {
    // A lease for another path whose staging is gone (the host rebooted): replaced in one step, so
    // that nothing (a gc) ever sees the volume attached here with no lease.
    await d.volumes.takeLease(r.id, lease, { replaceStaging: true });
  }
  // What this call did, undone in reverse order when a later step fails. Each undo is registered
  // before its step runs: a command killed after the kernel acted (a mount that took effect) is undone
  // too. The lease goes last, and only when nothing of the volume is left attached here.
  const undo: Undo[] = previous ? [] : [(cx) => dropLeaseIfGone(d, cx, r.id)];
  // A raw block volume is attached at the sector size its data was written on (none: never written).
  let recorded: Initialization | undefined;
  let pin: Held | undefined;
  const attach = async (ro: boolean): Promise<LoopDevice> => {
    // Every attached device by name and the backing path sysfs shows (sysfs alone, no losetup): a
    // failed attach detaches only the volume's devices that are not among them. The path is part of the
    // key because a name is reused: another volume's device detached meanwhile can hand its name to
    // this attach.
    const before = new Set((await d.host.loops(x, () => false)).map(attachmentKey));
    try {
      const opts = { readOnly: ro, directIo: d.loopDirectIo, sectorSize: recorded?.sectorSize };
      const loop = await d.host.attach(x, on.image, on.imageId, opts);
      undo.push((cx) => d.host.detach(cx, loop));
      x.log.info({ device: loop.path, readOnly: ro, directIo: loop.directIo }, 'attached loop device');
      if (d.loopDirectIo && !loop.directIo)
        x.log.warn(
          { device: loop.path },
          "direct I/O fell back to buffered: the image's alignment on the pool does not allow it at the sector size its data was written on (on XFS pools, once it shares blocks with a snapshot or clone)",
        );
      return loop;
    } catch (err) {
      // losetup killed or failed after attaching: detach what appeared meanwhile that nothing uses.
      await detachNew(d, detached(x), r.id, before);
      throw err;
    }
  };
  try {
    if (r.cap.accessType === 'block') recorded = await d.volumes.initialization(r.id);
    for (const l of stale) {
      if (await d.host.claimed(l.path)) {
        throw conflict(
          `A filesystem of volume ${r.id} is still active on ${l.path} with no mount on this host (left frozen, or mounted in another mount namespace); it was left alone.`,
        );
      }
      await detachLeftover(d, x, r.id, l);
    }
    let loop = usable[0];
    // A leftover raw block device not at the volume's sector size (a call killed before it was set).
    const want = recorded?.sectorSize;
    if (loop && want && !inUse(loop) && (await d.host.sectorSize(loop)) !== want) {
      await detachLeftover(d, x, r.id, loop);
      loop = undefined;
    }
    if (loop) {
      await pausepoint('stage:reusing');
      const live = async (l: LoopDevice) => inUse(l) || (await d.host.claimed(l.path));
      const device = loop.path;
      ({ loop, pin } = await holdReused(d, on, loop, live, () => stillOpen(r.id, device)));
    }
    const reused = loop !== undefined;
    if (!loop) {
      loop = await attach(readOnly);
      failpoint('stage:attached');
    } else {
      // A reused attachment: one an attach killed before it was given the filesystem's sector size gets
      // it now (no mount would succeed), and it is made to see the image's current size (it may have
      // grown since).
      if (r.cap.accessType === 'mount' && !inUse(loop)) loop = await d.host.fitToImage(x, on.image, loop);
      if ((await d.host.fileSizeOf(on.image)) !== loop.sizeBytes) loop = await d.host.refreshSize(x, loop);
    }
    await pausepoint('stage:attached');
    checkpoint(x);

    // The lease names the device (a hint, checked against /sys/block): for a raw block volume it is
    // the only record of which one is this node's; for a filesystem, the one after it is unmounted.
    const naming = nameDevice(d, r.id, lease, loop);
    if (r.cap.accessType === 'block') {
      await naming;
      if (!recorded)
        await d.volumes.markInitialized(r.id, `node ${d.nodeId} (raw block)`, await d.host.sectorSize(loop));
      if (pin) await notMarkedToGo(d, loop);
      checkpoint(x);
      return;
    }

    // A filesystem's device is looked at (the format lock taken, the probe) while that record is
    // written; nothing is written to the device or the pool (mkfs, the marker) before the record is, and
    // nothing is mounted before both ended: a crash at any point leaves what one between the attach and
    // the record always could (a device the lease does not name, untouched).
    const [, found] = await sideBySide(naming, filesystemOn(d, x, vol, r.cap, loop, reused, attach, naming));
    const { live, fsType } = found;
    // A blank volume staged read-only was formatted through a writable device and attached again.
    if (found.loop.name !== loop.name || found.loop.seq !== loop.seq)
      await nameDevice(d, r.id, lease, found.loop);
    loop = found.loop;
    const growAfterMount =
      found.formatted === false && !readOnly && (await checkAndGrowOffline(d, x, r.id, fsType, loop));
    await pausepoint('stage:formatted');
    checkpoint(x);

    await d.host.makeDir(staging);
    const options = stageMountOptions(fsType, readOnly, r.cap.mountFlags);
    undo.push((cx) => unmountIfOurs(d, cx, r.id, staging));
    try {
      await d.host.mount(x, { fsType, source: loop.path, target: staging, options });
    } catch (err) {
      checkpoint(x); // a mount killed because the caller gave up: say that, not "mount failed"
      // One never started (CallStopped: the deadline left no time for it) is the deadline's answer.
      if (!(err instanceof CommandError)) throw err;
      const flags = r.cap.mountFlags.length > 0 ? ` (mount flags: ${r.cap.mountFlags.join(',')})` : '';
      const why = mountErrorLine(err);
      throw broken(`Mounting volume ${r.id} at ${staging} failed${flags}${why ? `: ${why}` : ''}.`, err);
    }
    await mountedIsTheVolume(d, x, loop, staging);
    failpoint('stage:mounted');
    await pausepoint('stage:mounted');
    if (live && (await d.host.thaw(x, staging))) {
      x.log.warn({ device: loop.path, staging }, 'thawed a filesystem that was left frozen');
    }
    if (growAfterMount && !options.includes('ro')) await growMounted(d, x, fsType, loop, staging);
    checkpoint(x);
    x.log.info({ device: loop.path, staging, fsType, options }, 'staged volume');
  } catch (err) {
    // Let go first: a device a detach marked meanwhile goes now, and the lease with it.
    await pin?.release();
    pin = undefined;
    const cx = detached(x);
    for (const step of undo.reverse()) {
      await step(cx).catch((e: unknown) => {
        x.log.error({ err: e }, 'rollback step failed');
      });
    }
    throw err;
  } finally {
    await pin?.release();
  }
}

/** Names `loop` in this node's lease of volume `id`: the attachment, by name and disk sequence number. */
const nameDevice = (d: NodeDeps, id: string, lease: Lease, loop: LoopDevice) =>
  d.volumes.takeLease(id, {
    ...lease,
    device: loop.name,
    ...(loop.seq !== undefined ? { deviceSeq: loop.seq } : {}),
  });

/** A loop device as attached: its name and the backing file's path as sysfs shows it. */
const attachmentKey = (l: LoopDevice): string => `${l.name}\0${l.backingFile}`;

/**
 * Detaches a leftover device of volume `id` before another one is attached. One the kernel keeps (a
 * process holds it open) refuses the stage: two devices of one image are two writers that do not see
 * each other's cache.
 */
async function detachLeftover(d: NodeDeps, x: Exec, id: string, l: LoopDevice): Promise<void> {
  if (!(await d.host.detach(x, l))) throw stillOpen(id, l.path);
}

/** Detaches the loop devices of volume `id` that are not in `before` and that nothing uses. */
async function detachNew(d: NodeDeps, x: Exec, id: string, before: ReadonlySet<string>): Promise<void> {
  const now = await lookBesideNeighbours(d, x, id);
  const others = await untouchable(d, now);
  for (const l of now.loops) {
    if (before.has(attachmentKey(l)) || others.has(l.name) || now.mounts.some((m) => loopOfMount(m, [l])))
      continue;
    x.log.warn({ device: l.path }, 'detaching a loop device an interrupted attach left');
    await d.host.detach(x, l);
  }
}

/** Unmounts what is mounted at `p` when it is volume `id` (and only then). */
export async function unmountIfOurs(d: NodeDeps, x: Exec, id: string, p: string): Promise<void> {
  const on = await lookAtHost(d, x, id);
  const { ours, foreign } = classifyAt(on, p);
  if (ours.length > 0 && foreign.length === 0) await d.host.unmountAll(x, p, on.mounts, shows(on.loops));
}

/**
 * A rolled-back stage releases its lease only when none of the volume's loop devices is left attached
 * on this host (outside other nodes' stagings): a device the kernel could not let go of (still
 * mounted, or held) means the volume may still be in use here, and another node must not stage it.
 */
async function dropLeaseIfGone(d: NodeDeps, x: Exec, id: string): Promise<void> {
  const on = await lookBesideNeighbours(d, x, id);
  const others = await untouchable(d, on);
  const left = on.loops.filter((l) => !others.has(l.name));
  if (left.length > 0) {
    x.log.error(
      { volumeId: id, devices: left.map((l) => l.path) },
      'a rolled-back stage left the volume attached here; keeping its lease so that no other node stages it',
    );
    return;
  }
  await d.volumes.dropLease(id, d.nodeId);
}
