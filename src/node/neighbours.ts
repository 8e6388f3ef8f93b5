/**
 * Other node plugins on this host. Only several node plugins sharing one host ever see each other's
 * loop devices of a volume (DESIGN's shared pool on one machine: a test rig, or a pool tried out before
 * a cluster), and only of a volume several nodes may stage at once (MULTI_NODE_READER_ONLY, attached
 * read-only), or one taken from a node while it held it. A device of theirs is never reused, and never
 * detached, by this node.
 */
import type { Exec } from '../exec/runner.js';
import type { LoopDevice } from '../host/host.js';
import type { Lease } from '../pool/types.js';
import { lookAtHost, loopOfMount, namedLoop, type NodeDeps, type OnHost, stagingLoop } from './on-host.js';

/**
 * The host as lookAtHost sees it, with the volume's leases read just before. untouchable() reads them
 * again after the look and judges by both: a neighbour's device in the look belongs to a lease one of
 * the two readings shows. Read only after, a neighbour that unstaged meanwhile (its device detached,
 * its lease released) would leave a device that looks like nobody's, to be reused while it goes;
 * read only before, a stage that began meanwhile (its lease taken, its device attached) would.
 */
export async function lookBesideNeighbours(d: NodeDeps, x: Exec, id: string): Promise<OnHost> {
  const leasesBefore = await d.volumes.leases(id);
  return { ...(await lookAtHost(d, x, id)), leasesBefore };
}

/** The other nodes' leases of the volume that may name devices here, and what their stagings show. */
async function neighbours(
  d: NodeDeps,
  on: OnHost,
): Promise<{ own?: Lease; theirs: Set<string>; underWay: Lease[] }> {
  const theirs = new Set<string>();
  const underWay: Lease[] = [];
  if (on.loops.length === 0) return { theirs, underWay };
  const now = await d.volumes.leases(on.id);
  const own = now.find((l) => l.node === d.nodeId);
  for (const l of neighbourLeases(d, [...now, ...(on.leasesBefore ?? [])])) {
    // A raw block lease that names no device yet is a stage under way: which device it attached is not
    // guessed (any of the volume's would do, this node's own too).
    const shown =
      l.accessType === 'block' && l.device === undefined
        ? undefined
        : stagingLoop(on.loops, l, on.mounts, d.bootId);
    if (shown) theirs.add(shown.name);
    else if (l.revokedAt === undefined) underWay.push(l);
  }
  return { ...(own ? { own } : {}), theirs, underWay };
}

/**
 * The leases in `leases` that other node plugins on this host may hold. A lease taken on another host
 * (a node force-detached and gone, whose revoked lease lingers, or another reader) names nothing here.
 * Kubelet's staging path is the same on every node, so reading it against this host's mount table
 * would take this node's own staging for that node's; a path this node's own lease names is this
 * node's whatever the boot ids say (they may be unreadable).
 */
function neighbourLeases(d: NodeDeps, leases: readonly Lease[]): Lease[] {
  const ownPaths = new Set(leases.filter((l) => l.node === d.nodeId).map((l) => l.stagingPath));
  return leases.filter(
    (l) =>
      l.node !== d.nodeId &&
      !ownPaths.has(l.stagingPath) &&
      (l.bootId === undefined || l.bootId === d.bootId),
  );
}

/**
 * Whether another node plugin on this host holds a lease on the volume, before the look or now: one
 * taken in this boot, or, not revoked, by a release that recorded no boot (a revoked one of those may
 * be a node gone for good).
 */
export async function neighbourLeased(d: NodeDeps, on: OnHost): Promise<boolean> {
  const leases = neighbourLeases(d, [...(on.leasesBefore ?? []), ...(await d.volumes.leases(on.id))]);
  return leases.some((l) => l.bootId !== undefined || l.revokedAt === undefined);
}

/** Loop devices of the volume that other nodes' stagings on this host show: not this node's to judge. */
export async function othersLoops(d: NodeDeps, on: OnHost): Promise<Set<string>> {
  return (await neighbours(d, on)).theirs;
}

/**
 * Loop devices of the volume this node must neither reuse nor detach: those other nodes' stagings show
 * (othersLoops), and, while another node's stage on this host is under way (its lease taken, its
 * device not yet named in it or not yet mounted at its staging path), every device of the volume that
 * no mount here uses, except this node's own raw block device (ownBlockDevice). Such a
 * device may be the one that stage has just attached (read-only, or read-write to format a blank
 * volume) and is about to format or mount: detached, its number could go to another image, which the
 * stage would then format (mkfs.ext4 overwrites a filesystem it finds when no terminal is there to ask)
 * or mount for its pods; reused, two nodes' stagings would share one device, and each would take the
 * other's mount for a stranger's. What this leaves of this node's own (an interrupted call's device)
 * goes once that stage has ended.
 */
export async function untouchable(d: NodeDeps, on: OnHost): Promise<Set<string>> {
  const { own, theirs, underWay } = await neighbours(d, on);
  if (underWay.length === 0) return theirs;
  const unused = (l: LoopDevice): boolean => !on.mounts.some((m) => loopOfMount(m, [l]));
  const result = new Set(theirs);
  for (const l of on.loops) if (!ownBlockDevice(d, own, l) && unused(l)) result.add(l.name);
  return result;
}

/**
 * Whether `l` is the device this node's raw block staging attached: the one its lease names, as that
 * attachment (namedLoop: this boot, and the disk sequence number it had then where the kernel has one).
 * A filesystem staging's device is in use by its mount; an unused one (a failed mount's, say) is left
 * to the next call once that stage has ended, since a name the lease kept may have gone to another node's
 * device since.
 */
function ownBlockDevice(d: NodeDeps, own: Lease | undefined, l: LoopDevice): boolean {
  return own?.accessType === 'block' && namedLoop([l], own, d.bootId) !== undefined;
}
