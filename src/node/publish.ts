/**
 * NodePublishVolume and NodeUnpublishVolume: a bind mount of the staged filesystem at the pod's target
 * (block: of the loop device node onto a file), and undoing exactly that.
 *
 * A publish keeps the staging mount's security flags (nosuid, nodev, noexec) and adds its own
 * per-mount flags; a read-only publish is checked in the mount table (the kernel must show it). An
 * unpublish unmounts only this volume's mounts and removes only what a publish creates: an empty
 * directory, or the empty file a block volume is bound onto.
 */
import path from 'node:path';
import { broken, conflict, invalid, mismatch, missing } from '../errors.js';
import { checkpoint, CommandError, detached, type Exec } from '../exec/runner.js';
import type { MountEntry } from '../host/host.js';
import { isReadOnlyMount, mountErrorLine } from '../host/mounts.js';
import { pausepoint } from '../failpoints.js';
import { isVolumeId } from '../pool/ids.js';
import type { AccessMode, Capability } from '../pool/types.js';
import { refuseDeadFilesystem } from './fs-state.js';
import {
  callerPath,
  checkTargetPlace,
  classifyAt,
  foreignMountError,
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
  refuseWritableBinds,
  shows,
  stagingLoop,
} from './on-host.js';
import { othersLoops, untouchable } from './neighbours.js';
import { refuseNonDirectory } from './places.js';
import { unmountIfOurs } from './stage.js';
import { detachUnused } from './unstage.js';

/** Access modes that allow the volume at more than one target on this node (spec NodePublishVolume table). */
const manyTargets = (mode: AccessMode): boolean =>
  mode === 'SINGLE_NODE_MULTI_WRITER' || mode === 'MULTI_NODE_READER_ONLY';

/** Per-mount flags: what a bind mount can carry (the rest of a filesystem's options belong to the stage). */
const PER_MOUNT_FLAGS = new Set([
  'nosuid',
  'nodev',
  'noexec',
  'noatime',
  'nodiratime',
  'relatime',
  'strictatime',
  'nosymfollow',
]);
/** Flags a publish inherits from its staging mount: dropping one would loosen what the stage promised. */
const SECURITY_FLAGS = ['nosuid', 'nodev', 'noexec'];

/**
 * The options of a publish's bind mount: read-only when asked, the staging mount's security flags,
 * and the publish's own per-mount flags.
 */
export function bindOptions(
  readOnly: boolean,
  staged: MountEntry | undefined,
  publishFlags: readonly string[],
): string[] {
  const opts: string[] = [];
  if (readOnly || publishFlags.includes('ro')) opts.push('ro');
  for (const f of SECURITY_FLAGS) if (staged?.options.includes(f)) opts.push(f);
  for (const f of publishFlags) if (PER_MOUNT_FLAGS.has(f)) opts.push(f);
  return [...new Set(opts)];
}

export interface PublishRequest {
  id: string;
  staging: string;
  target: string;
  cap: Capability;
  readonly: boolean;
  /** The controller published the volume to this node read-only, as the publish context says (if it does). */
  publishedReadOnly: boolean | undefined;
}

type Undo = (x: Exec) => Promise<unknown>;

export async function publishVolume(d: NodeDeps, x: Exec, r: PublishRequest): Promise<void> {
  await mustGetVolume(d, r.id);
  const staging = await callerPath(d, r.staging, 'staging_target_path');
  const target = await callerPath(d, r.target, 'target_path');
  if (await isSymlinkPath(d, r.target))
    throw invalid(`target_path ${r.target} is a symbolic link; the driver publishes on a path it creates.`);
  // After the pool was mounted again here, the staging's device is known by this node's lease (see
  // leaseView); one that may be the volume is never published beside.
  const { on, doubtful } = await leaseView(d, await lookAtHost(d, x, r.id));
  refuseDoubtful(r.id, doubtful, 'published');
  const lease = await d.volumes.lease(r.id, d.nodeId);
  const staged = stagingLoop(on.loops, lease, on.mounts, d.bootId);
  if (!lease || lease.stagingPath !== staging || !staged) {
    throw conflict(`Volume ${r.id} is not staged at ${staging} on this node; call NodeStageVolume first.`);
  }
  if (lease.accessType !== r.cap.accessType) {
    throw conflict(`Volume ${r.id} is staged for ${lease.accessType} access, not ${r.cap.accessType}.`);
  }
  const isBlock = r.cap.accessType === 'block';
  if (isBlock && staged.autoclear) {
    // An unstage asked while a process held the device: it goes when that process closes it.
    throw conflict(
      `Volume ${r.id} is being detached from ${staged.path} (a process or another loop device on this node still holds it open); stage it again once it is gone.`,
    );
  }
  const published = await heldReadOnly(d, r.id, r.cap.mode, r.publishedReadOnly);
  if (published && isBlock && !staged.readOnly) {
    // NodeStageVolume stages such a device read-only; this staging predates the read-only publish.
    throw conflict(
      `Volume ${r.id} was published to this node read-only, but its device is staged at ${staging} read-write; unstage it and stage it again.`,
    );
  }
  const stagedMount = isBlock ? undefined : on.mounts.filter((m) => m.mountPoint === staging).at(-1);
  if (stagedMount) await refuseDeadFilesystem(d, r.id, stagedMount);
  if (published && stagedMount)
    refuseWritableBinds(on, r.id, { source: stagedMount.source, staging, target }, conflict);
  // Published read-only (a reader's access mode too, or staged on a read-only device): the pod's bind
  // is read-only whatever this call's own readonly says.
  const readOnly =
    r.readonly ||
    published ||
    staged.readOnly ||
    r.cap.mountFlags.includes('ro') ||
    (stagedMount !== undefined && isReadOnlyMount(stagedMount));
  // The filesystem is the one staged: another fs_type at a target already published is an incompatible
  // repeat (ALREADY_EXISTS), at a new target a capability the staged volume does not have.
  const otherFs =
    stagedMount !== undefined && r.cap.fsType !== '' && r.cap.fsType !== stagedMount.fsType
      ? stagedMount.fsType
      : undefined;
  const options = bindOptions(readOnly, stagedMount, r.cap.mountFlags);
  checkTargetPlace(on, target, { staging, kubeletDir: d.kubeletDir });

  // Already published at this target?
  const existing = on.mounts.filter((m) => m.mountPoint === target).at(-1);
  if (existing) {
    const loop = loopOfMount(existing, on.loops);
    if (!loop || isDeviceBind(existing) !== isBlock) {
      throw conflict(`${target} already has a mount of ${existing.source} that is not volume ${r.id}.`);
    }
    if (otherFs !== undefined) {
      throw mismatch(`Volume ${r.id} is already published at ${target} as ${otherFs}, not ${r.cap.fsType}.`);
    }
    if (isReadOnlyMount(existing) !== readOnly) {
      throw mismatch(
        `Volume ${r.id} is already published at ${target} ${isReadOnlyMount(existing) ? 'read-only' : 'read-write'}.`,
      );
    }
    // A publish cut short between the bind and its remount (see checkBindFlags) left the pod's promises
    // unkept: the retry keeps them before answering OK.
    if (options.some((o) => SECURITY_FLAGS.includes(o) && !existing.options.includes(o)))
      await checkBindFlags(d, x, r.id, target, options);
    return;
  }
  if (isBlock) await refuseNonDirectory(d, path.dirname(target), "target_path's directory");
  else await refuseNonDirectory(d, target, 'target_path');
  if (otherFs !== undefined) {
    throw conflict(
      `Volume ${r.id} is staged at ${staging} as ${otherFs}; it cannot be published as ${r.cap.fsType}.`,
    );
  }
  if (!manyTargets(r.cap.mode)) {
    // This node's other publications (not another node plugin's stagings on a shared host).
    const others = await othersLoops(d, on);
    const mine = on.loops.filter((l) => !others.has(l.name));
    const other = on.mounts.find(
      (m) => m.mountPoint !== staging && m.mountPoint !== target && loopOfMount(m, mine),
    );
    if (other)
      throw conflict(
        `Volume ${r.id} (${r.cap.mode}) is already published at ${other.mountPoint} on this node.`,
      );
  }

  const undo: Undo[] = [];
  try {
    await d.host.makeDir(path.dirname(target));
    let source = staging;
    if (isBlock) {
      if (await d.host.createFile(target)) undo.push(() => d.host.removeCreated(target));
      else {
        const kind = await d.host.pathKind(target);
        if (kind === 'directory')
          throw conflict(`${target} is a directory; a block volume is published on a file.`);
        if (kind !== 'empty-file')
          throw conflict(
            `${target} is not an empty file; a block volume is published on an empty file the driver creates.`,
          );
      }
      // Every publish on this node binds the staged device itself: readers and writers share its page
      // cache, so a reader sees what a writer wrote (a second loop device would keep its own, stale,
      // cache). A read-only bind of a device node does not stop writes by itself; the container runtime
      // does, with a read-only device rule (the kubelet gives read-only volumes "r"), and a volume
      // staged read-only is on a read-only device.
      source = staged.path;
    } else if ((await d.host.pathKind(target)) === 'absent') {
      await d.host.makeDir(target);
      undo.push(() => d.host.removeCreated(target));
    } else {
      await refuseHidingFiles(d, target, 'target_path');
    }
    await pausepoint('publish:prepared');
    undo.push((cx) => unmountIfOurs(d, cx, r.id, target));
    await d.host.bind(x, source, target, options);
    await pausepoint('publish:mounted');
    await checkBindFlags(d, x, r.id, target, options);
    checkpoint(x);
    x.log.info({ target, readOnly, block: isBlock, options }, 'published volume');
  } catch (err) {
    const cx = detached(x);
    for (const step of undo.reverse()) {
      await step(cx).catch((e: unknown) => {
        x.log.error({ err: e }, 'rollback step failed');
      });
    }
    checkpoint(x); // a command killed because the caller gave up: say that, not "mount failed"
    if (err instanceof CommandError) {
      const why = mountErrorLine(err);
      throw broken(`Bind-mounting volume ${r.id} at ${target} failed${why ? `: ${why}` : ''}.`, err);
    }
    throw err;
  }
}

/**
 * Read-only and the security flags are promises to the pod: check the kernel kept them (older
 * util-linux drops flags a bind mount does not repeat), and remount the bind with all of them if not.
 */
async function checkBindFlags(
  d: NodeDeps,
  x: Exec,
  id: string,
  target: string,
  options: readonly string[],
): Promise<void> {
  const wanted = options.filter((o) => o === 'ro' || SECURITY_FLAGS.includes(o));
  if (wanted.length === 0) return;
  const shown = (await d.host.mounts()).filter((m) => m.mountPoint === target).at(-1);
  if (!shown) throw broken(`The bind mount of volume ${id} at ${target} did not appear in the mount table.`);
  if (wanted.every((o) => shown.options.includes(o))) return;
  await d.host.remountBind(x, target, options);
  const again = (await d.host.mounts()).filter((m) => m.mountPoint === target).at(-1);
  const lacking = wanted.filter((o) => !again?.options.includes(o));
  if (lacking.length > 0)
    throw broken(
      `The kernel did not keep ${lacking.join(',')} on the bind mount of volume ${id} at ${target}.`,
    );
}

export interface UnpublishRequest {
  id: string;
  target: string;
}

export async function unpublishVolume(d: NodeDeps, x: Exec, r: UnpublishRequest): Promise<void> {
  if (!isVolumeId(r.id)) throw missing(`Volume ${r.id} does not exist.`);
  const target = await callerPath(d, r.target, 'target_path');
  const symlink = await isSymlinkPath(d, r.target);
  const seen = await lookAtHost(d, x, r.id);
  const known = (await d.volumes.inspect(r.id)).state !== 'absent';
  const lease = await d.volumes.lease(r.id, d.nodeId);
  // A bind of the device this node's lease records at its staging path is the volume's, even when the
  // image's identity no longer shows it (the pool was mounted again here).
  const { on } = await leaseView(d, seen);
  checkTargetPlace(on, target, { staging: lease?.stagingPath, kubeletDir: d.kubeletDir });
  const { ours, foreign } = symlink ? { ours: [], foreign: [] } : classifyAt(on, target);
  if (foreign.length > 0) throw foreignMountError(on, target, 'target_path', foreign);
  let table = on.mounts;
  if (ours.length > 0) {
    table = await d.host.unmountAll(x, target, on.mounts, shows(on.loops));
    if (table.some((m) => m.mountPoint === target))
      throw broken(`Volume ${r.id} is still mounted at ${target} after unmounting it.`);
  }
  const present = ours.length > 0 || (await d.host.pathKind(path.normalize(r.target))) !== 'absent';
  // An empty directory left at the path (a node that went down with it mounted, its volume deleted
  // meanwhile) is removed and OK: the kubelet removes a pod's directory only after an OK.
  if (!known && !present) {
    await d.volumes.assertPoolPresent(); // not there is not "does not exist"
    throw missing(`Volume ${r.id} does not exist.`);
  }
  if (symlink)
    throw conflict(
      `target_path ${r.target} is a symbolic link, which the driver never creates; it was left in place.`,
    );
  await d.host.removeCreated(target);
  if (ours.some(isDeviceBind)) {
    // A read-only loop device attached only for this block publish goes with it.
    const staged = stagingLoop(on.loops, lease, table, d.bootId);
    const others = await untouchable(d, on);
    if (staged)
      await detachUnused(
        d,
        x,
        on.loops.filter((l) => !others.has(l.name)),
        table,
        staged,
      );
  }
  if (ours.length > 0) x.log.info({ target }, 'unpublished volume');
}
