/**
 * What the node algorithms share: their dependencies, and how a volume is found on this host.
 *
 * The host is the truth: every call looks at the mount table and the loop devices, so a restarted
 * plugin answers correctly and can tear down what its predecessor set up. A loop device belongs to a
 * volume when it is backed by the volume's image, judged by device and inode; the path the kernel
 * shows for the backing file is only a hint (it is the attaching process's view, which a replaced
 * container no longer shares), used alone only when the identity cannot be read.
 */
import path from 'node:path';
import { conflict, invalid, missing } from '../errors.js';
import type { Exec } from '../exec/runner.js';
import { type FileId, type Host, type LoopDevice, type MountEntry } from '../host/host.js';
import { backingName } from '../host/loop.js';
import { normalPath, sameFile } from '../host/paths.js';
import { isReadOnlyMount } from '../host/mounts.js';
import { isVolumeId } from '../pool/ids.js';
import { IMAGE_FILE } from '../pool/layout.js';
import type { FencedEntry, NodeRegistry } from '../pool/nodes.js';
import { type AccessMode, isReaderOnly, type Lease, type VolumeMeta } from '../pool/types.js';
import type { VolumeStore } from '../pool/volumes.js';

export interface NodeDeps {
  nodeId: string;
  poolName: string;
  /** The id of the pool this node serves (pool.json): a volume of another pool is refused. */
  poolId: string;
  maxVolumesPerNode: number;
  loopDirectIo: boolean;
  volumes: VolumeStore;
  nodes: NodeRegistry;
  host: Host;
  /** The pool's real path: no staging or target path may lie inside it. */
  poolRoot: string;
  /** This host's boot id: what the node froze for good is remembered per boot. */
  bootId: string;
  /** The kubelet's root directory (--kubelet-dir), when known: mounts at or above it are the host's. */
  kubeletDir?: string;
}

/**
 * The loop devices of volume `id` on this host that this node froze for good after the volume was
 * taken from it (see node/quiesce.ts). They are never thawed: writes waiting on them belong to a pod
 * that lost the volume, and another node may be writing it now. Only a reboot ends them.
 */
export async function fencedDevices(
  d: NodeDeps,
  id: string,
  loops: readonly LoopDevice[],
): Promise<Set<string>> {
  const entries = await d.nodes.fenced(d.nodeId, d.bootId);
  const mine = entries === 'unreadable' ? entries : entries.filter((e) => e.volumeId === id);
  return new Set(loops.filter((l) => isFencedIn(mine, l)).map((l) => l.path));
}

/**
 * Whether `entries` (or an unreadable record: anything) says `loop` is a fence. By identity where both
 * sides know it, else by path: a fence recorded while losetup could not be read has none.
 */
export function isFencedIn(entries: readonly FencedEntry[] | 'unreadable', loop: LoopDevice): boolean {
  if (entries === 'unreadable') return true;
  return entries.some(
    (e) =>
      e.device === loop.path &&
      (loop.backing === undefined ||
        e.backingDev === '' ||
        sameFile(loop.backing, { dev: e.backingDev, ino: e.backingIno })),
  );
}

export function fencedError(id: string, device: string) {
  return conflict(
    `Volume ${id} was taken from this node while mounted (a force-detach), so its filesystem on ${device} was frozen for good: writes the old pod left pending must never reach the volume. Reboot the node to release it.`,
  );
}

/** A volume as this host has it: its image, the loop devices backed by it, and the mount table. */
export interface OnHost {
  id: string;
  image: string;
  /** The image's identity; undefined when the image is not there (deleted, or the pool is not mounted). */
  imageId: FileId | undefined;
  loops: LoopDevice[];
  /** Every attached loop device of this host, of any volume or none (the same reading). */
  allLoops: LoopDevice[];
  mounts: MountEntry[];
  /** The volume's leases as read just before this look, when the caller asked (lookBesideNeighbours). */
  leasesBefore?: Lease[];
}

/**
 * True when the sysfs path of `l`'s backing file names volume `id`'s image, from whatever root: in
 * volumes/, or on its way out (trash/, quarantine/) while still attached.
 */
function pathNames(l: LoopDevice, id: string): boolean {
  const shown = l.backingFile.replace(/ \(deleted\)$/, '');
  const dir = path.basename(path.dirname(shown));
  const parent = path.basename(path.dirname(path.dirname(shown)));
  if (path.basename(shown) !== IMAGE_FILE) return false;
  return (
    (parent === 'volumes' && dir === id) ||
    ((parent === 'trash' || parent === 'quarantine') && dir.startsWith(`${id}.`))
  );
}

export function isBackedBy(l: LoopDevice, id: string, imageId: FileId | undefined): boolean {
  if (imageId !== undefined && l.backing !== undefined) return sameFile(l.backing, imageId);
  return pathNames(l, id);
}

/**
 * Whether loop device `l` is backed by this pool's image of volume `id`, proven: by identity when the
 * device's can be read, else by a path inside this pool's root. A path that only names the id (from
 * another root) is not proof here: another pool on this host may hold a volume of the same id.
 */
export async function isThisPoolsVolume(d: NodeDeps, l: LoopDevice, id: string): Promise<boolean> {
  if (l.backing !== undefined) return sameFile(l.backing, await d.host.fileId(d.volumes.imagePath(id)));
  return l.backingFile.replace(/ \(deleted\)$/, '') === d.volumes.imagePath(id);
}

export async function lookAtHost(d: NodeDeps, x: Exec, id: string): Promise<OnHost> {
  const image = d.volumes.imagePath(id);
  const [imageId, loops, mounts] = await Promise.all([
    d.host.fileId(image),
    d.host.loops(x, (l) => backingName(l) === IMAGE_FILE),
    d.host.mounts(),
  ]);
  return {
    id,
    image,
    imageId,
    loops: loops.filter((l) => isBackedBy(l, id, imageId)),
    allLoops: loops,
    mounts,
  };
}

/**
 * This node's own staging as its lease records it, for when the image's identity no longer shows it.
 * The pool's filesystem mounted again on this host (a network mount that went away and came back)
 * gives the image another device and inode, while the loop device keeps the file it opened through
 * the old connection: lookAtHost no longer counts it as the volume's, yet it is, and it may be
 * written. So a device this node's lease names (revoked or not: a revoked one still records what the
 * node staged) is judged by the lease too; only a lease taken in this boot names devices and mounts of
 * this host:
 *  - `on` gains the device mounted at the lease's staging path that the lease names (when it records
 *    one) and whose backing path names the volume's image: the volume's, to freeze, unmount and detach;
 *  - `doubtful` holds any other device the lease names or its staging path shows, unless its backing
 *    identity was read, is not the image's, and its path names another file (then it is another's).
 *    It may be the volume: nothing may be confirmed as not writable while one is there, and nothing
 *    is done to it.
 * The lease is read (`lease`) only when a device of the host could be either: in the ordinary case
 * (every device of an image known by its identity) `on` is returned as it was, and nothing is read.
 */
export async function leaseView(
  d: NodeDeps,
  on: OnHost,
  lease: () => Promise<Lease | undefined> = () => ownLease(d, on.id),
): Promise<{ on: OnHost; doubtful: LoopDevice[] }> {
  const known = new Set(on.loops.map((l) => l.name));
  const unknown = on.allLoops.filter(
    (l) => !known.has(l.name) && (l.backing === undefined || pathNames(l, on.id)),
  );
  if (unknown.length === 0) return { on, doubtful: [] };
  const mine = await lease();
  if (!mine || (mine.bootId !== undefined && mine.bootId !== d.bootId)) return { on, doubtful: [] };
  const atStaging = on.mounts.filter((m) => m.mountPoint === mine.stagingPath);
  const staged: LoopDevice[] = [];
  const doubtful: LoopDevice[] = [];
  for (const l of unknown) {
    const mounted = atStaging.some((m) => loopOfMount(m, [l]));
    if (!mounted && l.name !== mine.device) continue;
    // Its image in volumes/ (not one in the trash or quarantine, which no staging should use).
    const image =
      pathNames(l, on.id) && path.basename(path.dirname(path.dirname(l.backingFile))) === 'volumes';
    if (image && mounted && (mine.device === undefined || l.name === mine.device)) staged.push(l);
    else doubtful.push(l);
  }
  return { on: staged.length > 0 ? { ...on, loops: [...on.loops, ...staged] } : on, doubtful };
}

/**
 * Refuses (FAILED_PRECONDITION) to `what` while a device this node's lease names may be the volume
 * (leaseView's `doubtful`): nothing is attached, mounted or bound beside it.
 */
export function refuseDoubtful(id: string, doubtful: readonly LoopDevice[], what: string): void {
  if (doubtful.length === 0) return;
  throw conflict(
    `Volume ${id} may still be attached here as ${doubtful.map((l) => l.path).join(', ')}, which this node's lease names but cannot be told apart from another file (the pool's filesystem was mounted again); it was not ${what}: unstage it, or detach that device by hand.`,
  );
}

/** This node's lease on volume `id`, revoked or not. */
export async function ownLease(d: NodeDeps, id: string): Promise<Lease | undefined> {
  return (await d.volumes.leases(id)).find((l) => l.node === d.nodeId);
}

/** The loop device a mount shows: a filesystem on /dev/loopN, or a bind of the device node itself. */
export function loopOfMount(m: MountEntry, loops: readonly LoopDevice[]): LoopDevice | undefined {
  if (/^\/dev\/loop\d+$/.test(m.source)) return loops.find((l) => l.path === m.source);
  if (/^\/loop\d+$/.test(m.root)) return loops.find((l) => l.name === m.root.slice(1));
  return undefined;
}

export const isDeviceBind = (m: MountEntry): boolean => /^\/loop\d+$/.test(m.root);

export const isLoopMount = (m: MountEntry): boolean => /^\/dev\/loop\d+$/.test(m.source) || isDeviceBind(m);

export const mountsOf = (table: readonly MountEntry[], loops: readonly LoopDevice[]): MountEntry[] =>
  table.filter((m) => loopOfMount(m, loops) !== undefined);

/**
 * The loop device staged for a volume: the one its staging mount shows, or (block) the one the lease
 * names (namedLoop); `bootId` is this host's.
 */
export function stagingLoop(
  loops: readonly LoopDevice[],
  lease: Lease | undefined,
  mounts: readonly MountEntry[],
  bootId: string,
): LoopDevice | undefined {
  if (!lease) return undefined;
  if (lease.accessType === 'mount') {
    const top = mounts.filter((m) => m.mountPoint === lease.stagingPath).at(-1);
    if (top) return loops.find((l) => l.path === top.source);
    // Unmounted but still attached (a fenced filesystem whose frozen superblock holds its device).
    // The name is only a hint (a device is reused once free): a mounted device is someone's staging.
    if (lease.revokedAt === undefined) return undefined;
    const named = namedLoop(loops, lease, bootId);
    return named && !mounts.some((m) => m.source === named.path) ? named : undefined;
  }
  if (lease.device !== undefined) return namedLoop(loops, lease, bootId);
  return loops.find((l) => l.readOnly === lease.readonly);
}

/**
 * The device a lease names, while it is still that attachment: named in this boot (`bootId`; a lease of
 * an older release says none) and, where the kernel numbers every attach (diskseq), with that number.
 * A name alone is reused as soon as the device is free, by any image.
 */
export function namedLoop(
  loops: readonly LoopDevice[],
  lease: Lease,
  bootId: string,
): LoopDevice | undefined {
  if (lease.device === undefined || (lease.bootId !== undefined && lease.bootId !== bootId)) return undefined;
  const sameSeq = (l: LoopDevice): boolean =>
    lease.deviceSeq === undefined || l.seq === undefined || l.seq === lease.deviceSeq;
  return loops.find((l) => l.name === lease.device && sameSeq(l));
}

/**
 * Whether pods on this node get the volume read-only: its access mode is a reader's, or the controller
 * published it to this node read-only (ControllerPublishVolume `readonly`). The publish context says
 * the latter (the controller wrote it from the same record); without one, the pool's attachment
 * record is read.
 */
export async function heldReadOnly(
  d: NodeDeps,
  id: string,
  mode: AccessMode,
  publishedReadOnly: boolean | undefined,
): Promise<boolean> {
  if (isReaderOnly(mode)) return true;
  if (publishedReadOnly !== undefined) return publishedReadOnly;
  return (await d.volumes.attachments(id)).some((a) => a.node === d.nodeId && a.readonly);
}

/**
 * Refuses a read-only publication of the filesystem staged at `staging` (device `source`) while a pod
 * still has a read-write bind of it (the volume was published read-write before), with the error `as`
 * makes (a stage's ALREADY_EXISTS, a publish's FAILED_PRECONDITION); `target`: the publish's own
 * target, judged by the publish itself.
 */
export function refuseWritableBinds(
  on: OnHost,
  id: string,
  { source, staging, target }: { source: string; staging: string; target?: string },
  as: (message: string) => Error,
): void {
  const writable = on.mounts.find(
    (m) => m.mountPoint !== staging && m.mountPoint !== target && m.source === source && !isReadOnlyMount(m),
  );
  if (writable) {
    throw as(
      `Volume ${id} is published read-only to this node, but ${writable.mountPoint} still has it read-write; unpublish it there first.`,
    );
  }
}

/** Whether `p` is `dir` or lies beneath it. */
const within = (p: string, dir: string): boolean => p === dir || p.startsWith(dir === '/' ? '/' : `${dir}/`);

/**
 * The canonical form of a staging or target path the CO gave. Refused (INVALID_ARGUMENT) when it is
 * the root, lies in the pool, or holds the pool: a mount there would hand a pod the pool's own files,
 * and an unmount or removal there could take them away.
 */
export async function callerPath(d: NodeDeps, p: string, field: string): Promise<string> {
  const real = await d.host.canonicalPath(p);
  const root = d.poolRoot;
  if (within(real, root) || within(root, real)) {
    throw invalid(
      `${field} ${p} is the root, the pool, or a directory holding the pool; the driver never mounts or removes anything there.`,
    );
  }
  return real;
}

/**
 * Refuses a target (or staging) path inside a mounted volume (a staging, or a pod's bind of one) or
 * holding one beneath it, or a target that is the volume's own staging path: mounting there would hide
 * another volume's files or expose this one's in another volume's tree (where its pod could swap the
 * path for a symlink), and unmounting would unmount or remove what is not the pod's. Volumes of any pool count (loop devices backed by an image file of ours), known by the
 * mount's device number or its source (btrfs shows an anonymous device number, not the loop's). A
 * mount at or above the kubelet's directory is the host's, not a volume staged here (a kubelet whose
 * root is itself on such a volume, as in a cluster nested in a pod).
 */
export function checkTargetPlace(
  on: OnHost,
  target: string,
  {
    field = 'target_path',
    staging,
    kubeletDir,
  }: { field?: string; staging?: string | undefined; kubeletDir?: string | undefined },
): void {
  if (target === staging)
    throw invalid(`${field} ${target} is the volume's staging path; a pod's path is another one.`);
  const volumeLoops = on.allLoops.filter((l) => backingName(l) === IMAGE_FILE);
  const numbers = new Set(volumeLoops.map((l) => l.majorMinor));
  const sources = new Set(volumeLoops.map((l) => l.path));
  const isVolume = (m: MountEntry): boolean =>
    (numbers.has(m.majorMinor) || sources.has(m.source)) &&
    !(kubeletDir !== undefined && within(kubeletDir, m.mountPoint));
  const parent = path.dirname(target);
  // The mount that holds the target's directory: the longest mount point above it, the last mounted
  // of those stacked on one point (the one visible).
  const holding = on.mounts
    .filter((m) => within(parent, m.mountPoint))
    .reduce<MountEntry | undefined>(
      (a, m) => (a && a.mountPoint.length > m.mountPoint.length ? a : m),
      undefined,
    );
  if (holding && isVolume(holding))
    throw invalid(`${field} ${target} lies inside a mounted volume (at ${holding.mountPoint}).`);
  const beneath = on.mounts.find(
    (m) => m.mountPoint !== target && within(m.mountPoint, target) && isVolume(m),
  );
  if (beneath)
    throw invalid(`${field} ${target} holds a mounted volume beneath it (at ${beneath.mountPoint}).`);
}

/**
 * Whether the last component of the path the CO gave is a symlink: such a path is never the driver's
 * (it creates directories and empty files), and removing what it resolves to would remove another file.
 */
export async function isSymlinkPath(d: NodeDeps, p: string): Promise<boolean> {
  return (await d.host.pathKind(normalPath(p))) === 'symlink';
}

export async function mustGetVolume(d: NodeDeps, id: string): Promise<VolumeMeta> {
  const meta = isVolumeId(id) ? await d.volumes.get(id) : undefined;
  if (!meta) throw missing(`Volume ${id} does not exist.`);
  return meta;
}

/**
 * Splits the mounts at `p` into this volume's and others'. Something else mounted where the CO says
 * this volume is (a foreign filesystem, or a loop device of another image) is never unmounted, and
 * never answered with success either: the caller reports it.
 */
export function classifyAt(on: OnHost, p: string, loops: readonly LoopDevice[] = on.loops) {
  const here = on.mounts.filter((m) => m.mountPoint === p);
  const ours = here.filter(shows(loops));
  const foreign = here.filter((m) => !shows(loops)(m));
  return { here, ours, foreign };
}

/** Whether a mount shows one of `loops` (a filesystem on it, or a bind of its device node). */
export const shows =
  (loops: readonly LoopDevice[]) =>
  (m: MountEntry): boolean =>
    loopOfMount(m, loops) !== undefined;

/** Refuses to mount over a directory holding files: they would be hidden, and are not the driver's. */
export async function refuseHidingFiles(d: NodeDeps, p: string, field: string): Promise<void> {
  if (await d.host.holdsEntries(p))
    throw conflict(`${field} ${p} holds files; a volume is never mounted over them (they would be hidden).`);
}

export function foreignMountError(on: OnHost, p: string, field: string, foreign: readonly MountEntry[]) {
  const what = foreign.map((m) => `${m.source} (${m.fsType})`).join(', ');
  return conflict(
    `${field} ${p} holds a mount of ${what}, which is not volume ${on.id}; it was left in place. Unmount it by hand if it is a leftover.`,
  );
}
