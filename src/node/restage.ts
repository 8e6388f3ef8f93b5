/**
 * NodeStageVolume's idempotency: whether a volume is already staged at the path as a request asks (then
 * the call answers OK at once), or staged in a way the request contradicts (ALREADY_EXISTS, or
 * FAILED_PRECONDITION when staged at another path). The host's mount table decides, with this node's
 * lease for what the mount table cannot show (raw block access, the mount flags asked for).
 */
import { conflict, mismatch } from '../errors.js';
import type { Exec } from '../exec/runner.js';
import { isReadOnlyMount } from '../host/mounts.js';
import type { Capability, Lease } from '../pool/types.js';
import { refuseDeadFilesystem } from './fs-state.js';
import { growMounted } from './grow.js';
import { type NodeDeps, type OnHost, refuseWritableBinds, stagingLoop } from './on-host.js';

/** The same mount flags, in any order, `ro` and `rw` aside (the access mode and the mount decide those). */
function sameFlags(a: readonly string[], b: readonly string[]): boolean {
  const set = (xs: readonly string[]) => [...new Set(xs.filter((f) => f !== 'ro' && f !== 'rw'))].sort();
  return set(a).join('\0') === set(b).join('\0');
}

/**
 * True when the volume is already staged at `staging` as asked (then the lease is refreshed); throws
 * when it is staged in a way this request contradicts.
 */
export async function alreadyStaged(
  d: NodeDeps,
  x: Exec,
  on: OnHost,
  r: { id: string; cap: Capability },
  staging: string,
  { readOnly, published }: { readOnly: boolean; published: boolean },
  ownLease: Lease | undefined,
): Promise<boolean> {
  const { cap } = r;
  if (cap.accessType === 'mount') {
    const top = on.mounts.filter((m) => m.mountPoint === staging).at(-1);
    if (top) {
      const loop = on.loops.find((l) => l.path === top.source);
      if (!loop) throw conflict(`${staging} already has ${top.source} mounted, which is not volume ${r.id}.`);
      if (
        (cap.fsType !== '' && top.fsType !== cap.fsType) ||
        loop.readOnly !== readOnly ||
        isReadOnlyMount(top) !== (readOnly || cap.mountFlags.includes('ro')) ||
        ownLease?.accessType === 'block'
      ) {
        throw mismatch(
          `Volume ${r.id} is already staged at ${staging} as ${top.fsType}${loop.readOnly ? ' on a read-only device' : isReadOnlyMount(top) ? ' read-only' : ''}, which this request does not match.`,
        );
      }
      if (published) refuseWritableBinds(on, r.id, { source: top.source, staging }, mismatch);
      // A repeat stage never answers OK for a filesystem that died since it was staged.
      await refuseDeadFilesystem(d, r.id, top);
      const recorded = ownLease?.stagingPath === staging ? ownLease.mountFlags : undefined;
      if (recorded !== undefined && !sameFlags(recorded, cap.mountFlags)) {
        throw mismatch(
          `Volume ${r.id} is already staged at ${staging} with mount flags [${recorded.join(',')}], not [${cap.mountFlags.join(',')}]; unstage it to change them.`,
        );
      }
      await d.volumes.takeLease(r.id, {
        node: d.nodeId,
        stagingPath: staging,
        accessType: 'mount',
        mode: cap.mode,
        readonly: readOnly,
        since: new Date().toISOString(),
        bootId: d.bootId,
        ...(recorded === undefined ? {} : { mountFlags: recorded }),
      });
      // xfs and btrfs grow once mounted: a stage killed between its mount and that growth left the
      // filesystem smaller than its device (a restore or clone into a larger volume), which the repeat
      // grows before answering OK.
      if (!isReadOnlyMount(top) && (top.fsType === 'xfs' || top.fsType === 'btrfs'))
        await growMounted(d, x, top.fsType, loop, staging, { unlessUnknown: true });
      return true;
    }
  }
  const live = ownLease ? stagingLoop(on.loops, ownLease, on.mounts, d.bootId) : undefined;
  if (!ownLease || !live) return false;
  if (ownLease.stagingPath !== staging) {
    throw conflict(
      `Volume ${r.id} is already staged on this node at ${ownLease.stagingPath}; unstage it there first.`,
    );
  }
  if (ownLease.accessType === 'block' && cap.accessType === 'block') {
    // An unstage asked while a process held the device: the kernel detaches it when that one closes it,
    // from under a pod published on it now (a raw block staging does not hold it open).
    if (live.autoclear) throw stillOpen(r.id, live.path);
    if (ownLease.mode !== cap.mode || ownLease.readonly !== readOnly || live.readOnly !== readOnly) {
      throw mismatch(
        `Volume ${r.id} is already staged at ${staging} with access mode ${ownLease.mode}${live.readOnly ? ', read-only' : ''}.`,
      );
    }
    return true;
  }
  if (ownLease.accessType !== cap.accessType) {
    throw mismatch(`Volume ${r.id} is already staged at ${staging} for ${ownLease.accessType} access.`);
  }
  return false;
}

/** The refusal to stage a volume whose device a process holds open while it is being detached. */
export const stillOpen = (id: string, device: string): Error =>
  conflict(
    `Volume ${id} is still attached at ${device}, which a process or another loop device on this node holds open (fuser -v ${device}; losetup -j ${device}); it detaches when closed, and the volume cannot be staged until then.`,
  );
