/**
 * NodeUnstageVolume: undo a stage. Refused while the volume is still published on this node; the
 * staging mount is unmounted only when it is this volume's (judged by the loop device's backing file,
 * not its path), and a mount of anything else there is reported, never answered with success. The
 * volume's loop devices that nothing uses any more are detached, and the lease goes last.
 */
import { broken, conflict, missing } from '../errors.js';
import type { Exec } from '../exec/runner.js';
import type { LoopDevice, MountEntry } from '../host/host.js';
import { isVolumeId } from '../pool/ids.js';
import {
  callerPath,
  classifyAt,
  fencedDevices,
  fencedError,
  foreignMountError,
  isDeviceBind,
  isSymlinkPath,
  leaseView,
  loopOfMount,
  type NodeDeps,
  shows,
  stagingLoop,
} from './on-host.js';
import { lookBesideNeighbours, untouchable } from './neighbours.js';

export interface UnstageRequest {
  id: string;
  staging: string;
}

export async function unstageVolume(d: NodeDeps, x: Exec, r: UnstageRequest): Promise<void> {
  if (!isVolumeId(r.id)) throw missing(`Volume ${r.id} does not exist.`);
  const staging = await callerPath(d, r.staging, 'staging_target_path');
  if (await isSymlinkPath(d, r.staging))
    throw conflict(
      `staging_target_path ${r.staging} is a symbolic link, which the driver never creates; it was left in place.`,
    );
  const seen = await lookBesideNeighbours(d, x, r.id);
  const known = (await d.volumes.inspect(r.id)).state !== 'absent';
  // A volume the pool does not show, on a pool that is not there: nothing here is touched, since its
  // lease could not be let go afterwards (UNAVAILABLE; the kubelet retries once the pool is back).
  if (!known) await d.volumes.assertPoolPresent();
  const lease = await d.volumes.lease(r.id, d.nodeId);
  // The device this node's lease records, at the staging path it records, is the volume's even when
  // the image's identity no longer shows it (the pool was mounted again here): it is released too.
  const { on } = await leaseView(d, seen);
  const atStaging = on.mounts.filter((m) => m.mountPoint === staging);
  if (!known && atStaging.length === 0 && on.loops.length === 0 && !lease)
    throw missing(`Volume ${r.id} does not exist.`);
  if (lease && lease.stagingPath !== staging && stagingLoop(on.loops, lease, on.mounts, d.bootId)) {
    // Staged, and live, at the path its lease names: not staged at this one, which the spec answers
    // OK. What is here (a pod's bind of it, say) and the staging are left alone.
    x.log.info({ staging, stagedAt: lease.stagingPath }, 'not staged at this path; nothing to undo');
    return;
  }

  // Loop devices of other nodes' stagings (several node plugins on one host) are not ours to judge or
  // detach, nor one a stage of theirs under way may have just attached.
  const others = await untouchable(d, on);
  const ours = on.loops.filter((l) => !others.has(l.name));
  const published = on.mounts.filter((m) => m.mountPoint !== staging && loopOfMount(m, ours));
  if (published.length > 0) {
    throw conflict(
      `Volume ${r.id} is still published at ${published.map((m) => m.mountPoint).join(', ')}; unpublish it first.`,
    );
  }
  const { ours: oursAt, foreign } = classifyAt(on, staging, ours);
  if (foreign.length > 0) throw foreignMountError(on, staging, 'staging_target_path', foreign);

  const fenced = await fencedDevices(d, r.id, on.loops);
  let table = on.mounts;
  if (oursAt.length > 0) {
    // A frozen filesystem that is unmounted stays frozen, holding its device: thaw it first, unless it
    // is this node's fence (the volume was taken from it), which is never thawed.
    const thawable = lease !== undefined && !oursAt.some((m) => fenced.has(m.source));
    // One the kernel shut down after I/O errors cannot even be opened to ask: it is unmounted as it is.
    const thawed = async (): Promise<boolean> =>
      d.host.thaw(x, staging).catch(async (err: unknown) => {
        if ((await d.host.pathKind(staging)) === 'unreachable') return false;
        throw err;
      });
    if (thawable && !oursAt.every(isDeviceBind) && (await thawed())) {
      x.log.warn({ staging }, 'thawed a frozen filesystem before unmounting it');
    }
    table = await d.host.unmountAll(x, staging, on.mounts, shows(ours));
    if (table.some((m) => m.mountPoint === staging)) {
      throw broken(`Volume ${r.id} is still mounted at ${staging} after unmounting it.`);
    }
    x.log.info({ staging }, 'unmounted staging path');
  }
  const held = ours.find((l) => fenced.has(l.path));
  if (held) {
    // Unmounted; its frozen superblock keeps the device until the node reboots, unless someone thawed
    // it by hand: then the device is gone as well, and nothing of the volume is left here to refuse for.
    const released = await detachUnused(d, x, ours, table).then(
      () => true,
      () => false,
    );
    if (!released) throw fencedError(r.id, held.path);
    x.log.warn(
      { device: held.path },
      'a device this node froze for good was released (its filesystem thawed by hand); it is detached',
    );
  } else await detachUnused(d, x, ours, table);
  const spared = on.loops.filter((l) => others.has(l.name) && !table.some((m) => loopOfMount(m, [l])));
  if (spared.length > 0) {
    x.log.info(
      { devices: spared.map((l) => l.path) },
      'left devices of the volume that another node plugin on this host may be using (its stage is under way, or its staging cannot be seen from here); loopvol check reports one that stays unexplained',
    );
  }
  await d.volumes.dropLease(r.id, d.nodeId);
}

/**
 * Detaches the loop devices in `loops` that no mount of `table` (a fresh one) uses, except `keep`.
 * A device the kernel cannot let go of (something still holds it) is reported, not hidden.
 */
export async function detachUnused(
  d: NodeDeps,
  x: Exec,
  loops: readonly LoopDevice[],
  table: readonly MountEntry[],
  keep?: LoopDevice,
): Promise<void> {
  const held: LoopDevice[] = [];
  for (const loop of loops) {
    if (keep && loop.name === keep.name) continue;
    if (table.some((m) => loopOfMount(m, [loop]))) continue;
    if (await d.host.detach(x, loop)) x.log.info({ device: loop.path }, 'detached loop device');
    else held.push(loop);
  }
  if (held.length > 0) {
    // Most often a copy of the staging mount in a mount namespace made while it was staged (a service
    // with private mounts, a container whose mounts do not propagate): the host's unmount never reaches it.
    const ids = held.map((l) => l.majorMinor).join('|');
    throw conflict(
      `${held.map((l) => l.path).join(', ')} is still open: a process holds it, or a mount of it is left in another mount namespace (made while it was staged; grep -lE ' (${ids}) ' /proc/*/mountinfo finds it); it detaches when that ends, and the volume stays in use on this node until then.`,
    );
  }
}
