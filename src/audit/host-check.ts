/**
 * What is not as it should be on this host: loop devices of pool images that no lease explains, their
 * mounts, mounts of staged volumes outside the kubelet's directory, and frozen filesystems. A
 * filesystem a node fenced (froze for good after a force-detach, nodes/<node>.fenced) is reported as
 * what it is, on purpose, and never as something to remove.
 */
import type { Exec } from '../exec/runner.js';
import type { Host, MountEntry } from '../host/host.js';
import { isDeviceBind } from '../node/on-host.js';
import type { Lease } from '../pool/types.js';
import type { Pool } from '../pool/pool.js';
import type { Finding } from './findings.js';
import { ext4Frozen, type FreezeState, probeFrozen } from './frozen.js';
import { explainedLoops, type HostView, isUnder, lookAtPoolOnHost, type PoolLoop } from './host-look.js';
import type { Inventory } from './inventory.js';
import { selfIdentity } from './self.js';

export const DEFAULT_KUBELET_DIR = '/var/lib/kubelet';

export interface HostCheckOptions {
  /** The kubelet's root directory: stagings and publications of volumes live under it. */
  kubeletDir: string;
  /** The nodes that run on this host; by default those whose registration names this host. */
  nodeIds?: readonly string[];
  /** Find out whether xfs and btrfs filesystems are frozen by trying to freeze them (see frozen.ts). */
  probeFrozen: boolean;
  /**
   * Once aborted (the operator's Ctrl-C), no further filesystem is probed; the probe under way ends as
   * it would (it thaws what it froze), so the check must not exit before it returns.
   */
  stopProbing?: AbortSignal;
}

export interface HostCheck {
  view: HostView;
  findings: Finding[];
  /** What the reader should know about how this was judged. */
  notes: string[];
}

/** Which nodes may run on this host, and a note when that could not be told. */
async function hostNodes(
  inv: Pick<Inventory, 'nodes'>,
  opts: HostCheckOptions,
): Promise<{ here: (node: string) => boolean; note?: string }> {
  if (opts.nodeIds) {
    const set = new Set(opts.nodeIds);
    return { here: (n) => set.has(n) };
  }
  const me = await selfIdentity();
  const nodes = [...inv.nodes.values()];
  const mine = new Set(nodes.filter((n) => n.record?.host === me.host).map((n) => n.node));
  if (mine.size === 0) {
    if (!nodes.some((n) => n.record !== undefined)) return { here: () => true };
    return {
      here: () => true,
      note: `no node registration names this host (${me.host}), so every node's leases were taken as possibly this host's (fewer devices are called leaks); run this where the node plugin runs, or pass --nodeid`,
    };
  }
  // A node without a registration may be this host's too: its leases explain devices here.
  return { here: (n) => mine.has(n) || inv.nodes.get(n)?.record === undefined };
}

const rwMount = (p: PoolLoop): MountEntry | undefined => {
  const fsMounts = p.mounts.filter((m) => !isDeviceBind(m));
  if (fsMounts.length === 0 || fsMounts.some((m) => m.superOptions.includes('ro'))) return undefined;
  return fsMounts.find((m) => !m.options.includes('ro')) ?? fsMounts[0];
};

export async function hostFindings(
  pool: Pool,
  inv: Pick<Inventory, 'volumes' | 'nodes'>,
  host: Host,
  x: Exec,
  opts: HostCheckOptions,
): Promise<HostCheck> {
  const view = await lookAtPoolOnHost(pool, host, x);
  const me = await selfIdentity();
  const { here, note } = await hostNodes(inv, opts);
  const notes = note ? [note] : [];
  const findings: Finding[] = [];

  // A device's number is reused: after a fence thawed by hand and unstaged, another volume may get it.
  const fenced = new Map<string, { node: string; volumeId: string; at: string }[]>();
  const freezes = new Map<string, string>();
  for (const n of inv.nodes.values()) {
    for (const e of n.fenced)
      if (e.bootId === me.bootId)
        fenced.set(e.device, [...(fenced.get(e.device) ?? []), { ...e, node: n.node }]);
    if (here(n.node)) for (const [v, state] of n.freezes) freezes.set(v, state ?? 'asked');
  }
  const leasesOf = new Map<string, Lease[]>(inv.volumes.map((v) => [v.id, v.leases]));
  // A volume whose fences.json cannot be read may be staged here by a lease nobody can read: all of
  // its devices count as explained (damaged-fences says what to do). A node of this host whose record
  // of fences cannot be read may have fenced any of them: gc touches none.
  const fencesUnknown = new Set(inv.volumes.filter((v) => v.fencesDamaged).map((v) => v.id));
  const fenceRecordLost = [...inv.nodes.values()].find(
    (n) => here(n.node) && n.damaged.some((f) => f.endsWith('.fenced')),
  );
  const fenceUnknown = fenceRecordLost
    ? `node ${fenceRecordLost.node}'s record of fenced filesystems cannot be read, so this may be a fence`
    : undefined;

  // Which devices the leases explain, volume by volume.
  const explained = new Set<string>();
  const byVolume = new Map<string, PoolLoop[]>();
  for (const p of view.loops) {
    if (p.image.kind !== 'volume' || p.image.id === undefined) continue;
    byVolume.set(p.image.id, [...(byVolume.get(p.image.id) ?? []), p]);
  }
  for (const [id, loops] of byVolume) {
    if (fencesUnknown.has(id)) {
      for (const p of loops) explained.add(p.loop.name);
      continue;
    }
    const names = explainedLoops(
      loops.map((p) => p.loop),
      leasesOf.get(id) ?? [],
      view.mounts,
      here,
    );
    for (const n of names) explained.add(n);
  }

  let notChecked = 0;
  for (const p of view.loops) {
    const dev = p.loop.path;
    const id = p.image.id;
    const volumeId = p.image.kind === 'volume' ? id : undefined;
    const what = `${p.image.kind === 'deleted' ? 'a deleted image' : `the ${p.image.kind} image`} ${p.image.path}`;
    // An image whose path names no volume or snapshot (so its id is unknown): any fence on it counts.
    const f = fenced.get(dev)?.find((e) => id === undefined || e.volumeId === id);
    if (f) {
      findings.push({
        kind: 'fenced-filesystem',
        severity: 'notice',
        scope: 'host',
        subject: dev,
        volumeId: f.volumeId,
        node: f.node,
        detail: `node ${f.node} froze the filesystem of volume ${f.volumeId} on ${dev} for good at ${f.at}, because the volume was detached from it while mounted (a force-detach): the old pod's writes must never reach it`,
        action:
          'Intentional. Reboot the node once its pods are gone: only that ends a fence. Neither the driver nor loopvol gc thaws it; an unstage unmounts it and answers FAILED_PRECONDITION, and its frozen superblock keeps the device attached until the reboot.',
      });
      continue;
    }
    const isExplained = explained.has(p.loop.name);
    const stagings = new Set((volumeId ? (leasesOf.get(volumeId) ?? []) : []).map((l) => l.stagingPath));

    // Frozen? Known for ext4 from its superblock; for xfs and btrfs only by trying, on request.
    const rw = rwMount(p);
    let frozen: FreezeState = 'unknown';
    const standing = volumeId ? freezes.get(volumeId) : undefined;
    if (rw) {
      if (rw.fsType === 'ext4') frozen = await ext4Frozen(dev);
      else if (standing === 'frozen') frozen = 'frozen';
      else if (
        opts.probeFrozen &&
        !opts.stopProbing?.aborted &&
        standing === undefined &&
        (isExplained || !volumeId)
      )
        frozen = await probeFrozen(x, rw.mountPoint);
      else notChecked++;
      if (frozen === 'frozen') {
        findings.push(
          standing !== undefined
            ? {
                kind: 'frozen-for-copy',
                severity: 'notice',
                scope: 'host',
                subject: rw.mountPoint,
                ...(volumeId ? { volumeId } : {}),
                detail: `the filesystem on ${dev} is frozen for a snapshot or clone being copied now`,
                action:
                  'Nothing: the node thaws it when the copy ends, or on its own when the freeze runs out.',
              }
            : {
                kind: 'frozen-filesystem',
                severity: 'problem',
                scope: 'host',
                subject: rw.mountPoint,
                ...(volumeId ? { volumeId } : {}),
                detail: `the filesystem on ${dev} (${what}) is frozen, and no copy and no fence explains it: writes to it hang`,
                action: `Thaw it: fsfreeze --unfreeze ${rw.mountPoint} (a restart of the node plugin thaws every pool filesystem it did not fence). Never unmount it frozen: it would stay frozen until a reboot.`,
              },
        );
      }
    }

    let mountsRemovable = true;
    for (const m of p.mounts) {
      if (isExplained) {
        if (isUnder(m.mountPoint, opts.kubeletDir) || stagings.has(m.mountPoint)) continue;
        mountsRemovable = false;
        findings.push({
          kind: 'mount-outside-kubelet',
          severity: 'problem',
          scope: 'host',
          subject: m.mountPoint,
          ...(volumeId ? { volumeId } : {}),
          detail: `${dev} of staged volume ${id ?? '?'} is also mounted at ${m.mountPoint}, outside ${opts.kubeletDir} and not at its staging path`,
          action: `Someone mounted it by hand (or the CO uses another kubelet directory: see --kubelet-dir). Unmount it when done: umount ${m.mountPoint}. gc leaves it: the volume is in use.`,
        });
        continue;
      }
      const unsafe =
        frozen === 'frozen' ? 'it is frozen (unmounting it would leave it frozen for good)' : fenceUnknown;
      if (unsafe) mountsRemovable = false;
      findings.push({
        kind: 'leaked-mount',
        severity: 'problem',
        scope: 'host',
        subject: m.mountPoint,
        ...(volumeId ? { volumeId } : {}),
        detail: `${dev} (${what}) is mounted at ${m.mountPoint}, and no lease explains it`,
        action: unsafe
          ? unsafe === fenceUnknown
            ? 'Repair that record first (see damaged-node-record); then loopvol gc unmounts it.'
            : 'Thaw it first (fsfreeze --unfreeze), then loopvol gc unmounts it.'
          : 'loopvol gc unmounts it unless something uses it (then stop that first).',
        ...(unsafe
          ? { gcSkipped: unsafe }
          : { gc: { action: 'unmount' as const, mountPoint: m.mountPoint, device: dev, volumeId } }),
      });
    }
    if (isExplained) continue;

    let skip: string | undefined;
    if (p.image.kind === 'quarantine') skip = 'its image is quarantined: decide about the record first';
    else if (fenceUnknown) skip = fenceUnknown;
    else if (!mountsRemovable) skip = 'it is still mounted';
    else if (p.mounts.length === 0 && (await host.claimed(dev)))
      skip =
        'a filesystem still holds it with no mount here (mounted in another mount namespace, or left frozen when unmounted)';
    findings.push({
      kind: 'leaked-loop-device',
      severity: 'problem',
      scope: 'host',
      subject: dev,
      ...(volumeId ? { volumeId } : {}),
      detail: `${dev} is attached to ${what}${p.image.partial ? ' (an unfinished copy)' : ''}, and no lease explains it${p.mounts.length > 0 ? ` (mounted at ${p.mounts.map((m) => m.mountPoint).join(', ')})` : ''}`,
      action: skip
        ? `Leave it to an operator: ${skip}.`
        : `loopvol gc detaches it${p.mounts.length > 0 ? ' after unmounting it' : ''}.`,
      ...(skip ? { gcSkipped: skip } : { gc: { action: 'detach' as const, device: dev, volumeId } }),
    });
  }
  if (notChecked > 0) {
    const why = opts.stopProbing?.aborted
      ? 'the probing was interrupted'
      : 'only trying to freeze one tells (--probe-frozen does, and thaws at once)';
    notes.push(
      `${notChecked} xfs or btrfs filesystem${notChecked > 1 ? 's were' : ' was'} not checked for a freeze: ${why}`,
    );
  }
  return { view, findings, notes };
}
