/**
 * The one step that can destroy data: deciding whether a device gets a new filesystem, and making it.
 *
 * Rules: blkid -p always decides (never a guess from the image's allocated blocks: some pool
 * filesystems report none for files that hold data); a device is formatted only when it holds no
 * signature at all *and* the volume was never initialized (the pool's `initialized` marker is the
 * second guard); another filesystem or a partition table is refused untouched. The decision and the
 * mkfs run under the volume's format lock, held across hosts, so two nodes staging a fresh volume at
 * once never both format it: the second one finds the marker and the filesystem, and keeps it. Each
 * mkfs is preceded by a durable `formatting` record: a mkfs.xfs cut short (the driver killed, its
 * container replaced) leaves a superblock blkid recognises but marked "in progress", which no kernel
 * mounts; found on a volume never marked initialized, with that record, it is made again (forced).
 * Any filesystem not so marked is kept, whatever the records say.
 */
import { busy, conflict, unsafe } from '../errors.js';
import { CommandError, type Exec } from '../exec/runner.js';
import { failpoint } from '../failpoints.js';
import type { DeviceContent, LoopDevice } from '../host/host.js';
import { type Capability, type FsType, isFsType, isMultiNode, type VolumeMeta } from '../pool/types.js';
import type { HeldLock } from '../pool/lock.js';
import type { NodeDeps } from './on-host.js';

export type FormatDecision =
  | { action: 'format'; fsType: FsType; force?: true }
  | { action: 'keep'; fsType: FsType }
  | { action: 'refuse'; reason: string };

/**
 * Whether to format a device. Format only a device with no signature at all that was never
 * initialized; keep the filesystem that is there when it is the one asked for (or when none was asked
 * for explicitly); refuse everything else, touching nothing. `unfinished`: the filesystem a mkfs of
 * ours began on the volume (its `formatting` record): found on a volume never marked initialized, it
 * is what that mkfs left (nothing mounts a volume before the mark), and it is made again.
 */
export function decideFormat(
  content: DeviceContent,
  initialized: boolean,
  requestedFs: string,
  volumeFs: FsType,
  unfinished?: FsType,
): FormatDecision {
  const wanted: FsType = isFsType(requestedFs) ? requestedFs : volumeFs;
  if (!initialized && content.kind === 'filesystem' && content.type === unfinished) {
    return { action: 'format', fsType: wanted, force: true };
  }
  switch (content.kind) {
    case 'blank':
      return initialized
        ? {
            action: 'refuse',
            reason:
              'holds data but no filesystem signature (it was formatted or used as a raw device before); it was not formatted.',
          }
        : { action: 'format', fsType: wanted };
    case 'filesystem':
      if (content.type === wanted) return { action: 'keep', fsType: wanted };
      if (requestedFs === '' && isFsType(content.type)) return { action: 'keep', fsType: content.type };
      return {
        action: 'refuse',
        reason: `holds a ${content.type} filesystem, not ${wanted}; it was left untouched.`,
      };
    case 'other':
      return { action: 'refuse', reason: `holds ${content.what}; it was left untouched.` };
  }
}

/** How long a stage waits for another node that is formatting the same volume. */
const FORMAT_LOCK_WAIT_MS = 120_000;

export interface PreparedFilesystem {
  fsType: FsType;
  /** The device to mount: a read-only staging formats through a read-write attachment, then re-attaches. */
  loop: LoopDevice;
  formatted: boolean;
}

/**
 * Makes sure `loop` holds the volume's filesystem: keeps the one there, or formats a blank, never
 * initialized device. `attach` makes a new attachment of the image (for formatting a read-only staging).
 * `fresh`: this call attached `loop`, and no other node may stage the volume meanwhile. Nothing is
 * written (no mkfs, no marker) before `before` has ended well: the device is looked at meanwhile.
 */
export async function prepareFilesystem(
  d: NodeDeps,
  x: Exec,
  vol: VolumeMeta,
  cap: Capability,
  loop: LoopDevice,
  fresh: boolean,
  attach: (readOnly: boolean) => Promise<LoopDevice>,
  before: Promise<unknown> = Promise.resolve(),
): Promise<PreparedFilesystem> {
  const waitMs = Math.max(
    1_000,
    Math.min(FORMAT_LOCK_WAIT_MS, (x.deadline ?? Infinity) - Date.now() - 5_000),
  );
  return d.volumes.withFormatLock(vol.id, waitMs, async (lock) => {
    const initialized = await d.volumes.isInitialized(vol.id);
    const content = await probeUncached(d, x, loop, fresh, initialized);
    // Proof that a filesystem found is a mkfs of ours cut short: its own superblock says it was never
    // finished (so never mounted), and the volume's `formatting` record names its type.
    const unfinished =
      !initialized &&
      content.kind === 'filesystem' &&
      isFsType(content.type) &&
      (await d.host.mkfsUnfinished(content.type, loop.path))
        ? await d.volumes.formatting(vol.id)
        : undefined;
    const decision = decideFormat(
      content,
      initialized,
      cap.fsType,
      vol.fsType === 'none' ? 'ext4' : vol.fsType,
      unfinished,
    );
    if (decision.action === 'refuse') throw unsafe(`Volume ${vol.id} ${decision.reason}`);
    // Made durable before mkfs begins: a retry after it was cut short must not keep what it left.
    const began =
      decision.action === 'format'
        ? d.volumes.markFormatting(vol.id, `node ${d.nodeId}`, decision.fsType)
        : undefined;
    await Promise.all([before, began]);
    lock.assertHeld(); // lost while waiting: another node may have formatted it meanwhile
    if (decision.action === 'keep') {
      if (!initialized) {
        const by = `node ${d.nodeId} (found ${decision.fsType})`;
        await d.volumes.markInitialized(vol.id, by, await d.host.sectorSize(loop));
      }
      return { fsType: decision.fsType, loop, formatted: false };
    }
    if (decision.force)
      x.log.warn({ volumeId: vol.id, fsType: decision.fsType }, 'formatting again over an unfinished mkfs');
    return {
      fsType: decision.fsType,
      loop: await formatBlank(d, x, vol.id, loop, decision, attach, lock),
      formatted: true,
    };
  });
}

/**
 * The filesystem on a staging's device: the live one a reused device still holds (mounted again, never
 * checked or formatted), or the one prepareFilesystem keeps or makes (`formatted` says which), writing
 * nothing before `before` has ended well.
 */
export async function filesystemOn(
  d: NodeDeps,
  x: Exec,
  vol: VolumeMeta,
  cap: Capability,
  loop: LoopDevice,
  reused: boolean,
  attach: (readOnly: boolean) => Promise<LoopDevice>,
  before: Promise<unknown>,
): Promise<{ live: boolean; fsType: FsType; loop: LoopDevice; formatted?: boolean }> {
  // A reused device that a filesystem still holds, with no mount of it here: a superblock left alive
  // (frozen when a pod went away during a snapshot, or mounted in a namespace that is gone). It is
  // mounted again (the kernel hands back that superblock) and thawed, never checked or formatted.
  if (reused && (await d.host.claimed(loop.path))) {
    const content = await d.host.probe(x, loop.path);
    if (content.kind !== 'filesystem' || (cap.fsType !== '' && content.type !== cap.fsType)) {
      throw conflict(
        `Volume ${vol.id} is held by an active filesystem on ${loop.path} that this request does not match.`,
      );
    }
    return { live: true, fsType: content.type as FsType, loop };
  }
  // Attached by this call, of a volume no other node may stage meanwhile (its lease is not shared).
  const fresh = !reused && !isMultiNode(cap.mode);
  return { live: false, ...(await prepareFilesystem(d, x, vol, cap, loop, fresh, attach, before)) };
}

/**
 * What the device holds, never as the device's page cache on this host may remember it from before
 * another node formatted the image. `fresh`: this call attached the device, and no other node can hold
 * the volume meanwhile (its access mode is not one that nodes share), so nothing but this call has
 * written the image since: the device held no cached page when attached (the kernel drops them when a
 * loop device is detached), and what was read of it since (udev's probe) is what it holds. A blank
 * answer with the marker there is read again all the same, after the cache is dropped. Any other device
 * (attached before this call, or of a volume other nodes may stage at once) has its cache dropped
 * first. (A loop device that fell back to buffered I/O also reads through the pool filesystem's cache
 * of the image, which no flush here reaches: on NFS that view is as fresh as the client's last
 * revalidation, and a stale blank one meets the marker and is refused.)
 */
async function probeUncached(
  d: NodeDeps,
  x: Exec,
  loop: LoopDevice,
  fresh: boolean,
  initialized: boolean,
): Promise<DeviceContent> {
  if (fresh) {
    const content = await d.host.probe(x, loop.path);
    if (content.kind !== 'blank' || !initialized) return content;
  }
  await d.host.flush(x, loop.path);
  return d.host.probe(x, loop.path);
}

/**
 * Formats a blank device (or one holding what an unfinished mkfs of ours left: `force`), attaching it
 * read-write for the purpose when it is staged read-only, under the volume's format `lock`: mkfs is
 * stopped when it is lost, and nothing is marked or mounted after it was.
 */
async function formatBlank(
  d: NodeDeps,
  x: Exec,
  id: string,
  loop: LoopDevice,
  { fsType, force = false }: { fsType: FsType; force?: boolean },
  attach: (readOnly: boolean) => Promise<LoopDevice>,
  lock: HeldLock,
): Promise<LoopDevice> {
  let target = loop;
  if (loop.readOnly) {
    await d.host.detach(x, loop);
    target = await attach(false);
  }
  try {
    await d.host.format(x, fsType, target.path, { force, signal: lock.signal });
  } catch (err) {
    if (err instanceof CommandError && /contains|existing|appears to/i.test(err.stderr)) {
      throw unsafe(
        `mkfs found existing data on volume ${id} and refused to format it: ${err.lastStderrLine}`,
        err,
      );
    }
    throw err;
  }
  failpoint('stage:formatted');
  const sectorSize = await d.host.sectorSize(target);
  lock.assertHeld(); // lost during mkfs: another node may be formatting the volume now
  if (!(await d.volumes.markInitialized(id, `node ${d.nodeId} (mkfs.${fsType})`, sectorSize))) {
    x.log.error(
      { volumeId: id },
      'the volume was marked initialized by someone who did not hold its format lock',
    );
    throw busy(`Volume ${id} was marked initialized by another node while this one formatted it; retry.`);
  }
  x.log.info({ device: target.path, fsType }, 'formatted a blank volume');
  if (loop.readOnly) {
    await d.host.detach(x, target);
    target = await attach(true);
  }
  return target;
}
