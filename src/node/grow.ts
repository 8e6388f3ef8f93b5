/**
 * NodeExpandVolume, and growing a mounted filesystem to its device: growth is verified (the filesystem
 * must report the device's size and statfs must show more space), never assumed from a tool's exit.
 */
import path from 'node:path';
import { broken, conflict, missing, outsideRange } from '../errors.js';
import type { Exec } from '../exec/runner.js';
import { mustGrow, OnlineGrowthUnsupported } from '../host/filesystem.js';
import type { LoopDevice } from '../host/host.js';
import { isReadOnlyMount, wentReadOnly } from '../host/mounts.js';
import { FS_TYPES, type FsType, isFsType } from '../pool/types.js';
import { refuseDeadFilesystem } from './fs-state.js';
import {
  callerPath,
  fencedDevices,
  fencedError,
  isDeviceBind,
  loopOfMount,
  lookAtHost,
  mustGetVolume,
  type NodeDeps,
} from './on-host.js';

/**
 * Grows a mounted xfs/btrfs (or ext4 where allowed) filesystem to its device and checks that it did.
 * `unlessUnknown`: leave it when its size cannot be read (a repeat stage of a staging in use).
 */
export async function growMounted(
  d: NodeDeps,
  x: Exec,
  fsType: FsType,
  loop: LoopDevice,
  mountPoint: string,
  { unlessUnknown = false }: { unlessUnknown?: boolean } = {},
): Promise<void> {
  const fills = (n: number | undefined): boolean => n !== undefined && !mustGrow(n, loop.sizeBytes);
  const was = await d.host.mountedFilesystemSize(x, fsType, loop.path, mountPoint);
  if (was === undefined ? unlessUnknown : !mustGrow(was, loop.sizeBytes)) return;
  const before = (await d.host.usage(mountPoint)).totalBytes;
  await d.host.growOnline(x, fsType, loop.path, mountPoint);
  // A grow that hit the pool's end (writes refused by a full pool) can abort the filesystem's journal
  // or transaction: the tool may still say it grew, but the pod's filesystem is read-only now.
  const top = (await d.host.mounts()).filter((m) => m.mountPoint === mountPoint).at(-1);
  if (top && wentReadOnly(top)) {
    throw broken(
      `Growing the ${fsType} filesystem on ${loop.path} turned it read-only (the kernel stopped it after write errors: is the pool full?); unstage the volume and stage it again once there is room.`,
    );
  }
  const size = await d.host.mountedFilesystemSize(x, fsType, loop.path, mountPoint);
  const after = (await d.host.usage(mountPoint)).totalBytes;
  if (!fills(size) || after <= before) {
    throw broken(
      `Growing the ${fsType} filesystem on ${loop.path} did not take effect (device ${loop.sizeBytes} bytes, filesystem ${size ?? 'unreadable'}, statfs ${before} → ${after}).`,
    );
  }
  x.log.info({ device: loop.path, fsType, from: before, to: after }, 'grew mounted filesystem');
}

export interface ExpandRequest {
  id: string;
  volumePath: string;
  requiredBytes: number;
  /** 0: no limit. */
  limitBytes: number;
}

/** Refreshes the loop devices of the volume to the image's size and grows the filesystem at `volumePath`. */
export async function expandVolume(d: NodeDeps, x: Exec, r: ExpandRequest): Promise<number> {
  await mustGetVolume(d, r.id);
  if (!path.isAbsolute(r.volumePath)) throw missing(`Volume ${r.id} is not published at ${r.volumePath}.`);
  const p = await callerPath(d, r.volumePath, 'volume_path');
  const on = await lookAtHost(d, x, r.id);
  const top = on.mounts.filter((m) => m.mountPoint === p).at(-1);
  const loop = top ? loopOfMount(top, on.loops) : undefined;
  if (!top || !loop) throw missing(`Volume ${r.id} is not staged or published at ${r.volumePath}.`);
  // A filesystem frozen for good after a force-detach: growing it would hang on the freeze, unkillably.
  const [fenced] = await fencedDevices(d, r.id, [loop]);
  if (fenced) throw fencedError(r.id, fenced);
  // The size is the image's (ControllerExpandVolume set it): a limit below it is the caller's to fix,
  // checked before any device is refreshed (for a raw block volume that refresh is the growth).
  const imageBytes = await d.host.fileSizeOf(on.image);
  if (r.limitBytes > 0 && imageBytes > r.limitBytes) {
    throw outsideRange(
      `The disk image of volume ${r.id} is ${imageBytes} bytes, more than the limit of ${r.limitBytes} bytes; nothing was grown.`,
    );
  }
  let size = loop.sizeBytes;
  for (const l of on.loops) {
    const refreshed = await d.host.refreshSize(x, l);
    if (l.name === loop.name) size = refreshed.sizeBytes;
  }
  if (r.requiredBytes > 0 && size < r.requiredBytes) {
    throw conflict(
      `The disk image of volume ${r.id} is ${size} bytes, less than the ${r.requiredBytes} asked for; expand it with ControllerExpandVolume first, or retry if that was just done (a shared pool's client may show the old size for a while).`,
    );
  }
  if (isDeviceBind(top)) return size;
  const fsType = top.fsType;
  if (!isFsType(fsType)) {
    throw conflict(
      `${r.volumePath} holds ${fsType}, which this driver does not grow (it knows ${FS_TYPES.join(', ')}).`,
    );
  }
  if (wentReadOnly(top)) {
    throw conflict(
      `The ${fsType} filesystem of volume ${r.id} went read-only after errors; it is grown once it is unstaged and staged again (checked then), not before.`,
    );
  }
  await refuseDeadFilesystem(d, r.id, top);
  let at = p;
  if (isReadOnlyMount(top)) {
    const fsSize = await d.host.mountedFilesystemSize(x, fsType, loop.path, p);
    if (fsSize !== undefined && !mustGrow(fsSize, size)) return size;
    // A pod's read-only bind of a filesystem staged read-write: grown through the read-write mount.
    // The top mount at its path (statfs and the grow tools see that one), writable by its own flags
    // and its filesystem's.
    const rw = on.mounts.find(
      (m, i) =>
        !isDeviceBind(m) &&
        !isReadOnlyMount(m) &&
        !m.superOptions.includes('ro') &&
        loopOfMount(m, [loop]) !== undefined &&
        !on.mounts.slice(i + 1).some((above) => above.mountPoint === m.mountPoint),
    );
    if (!rw)
      throw conflict(
        `Volume ${r.id} is mounted read-only here; its filesystem will be grown when it is next staged read-write.`,
      );
    at = rw.mountPoint;
  }
  try {
    await growMounted(d, x, fsType, { ...loop, sizeBytes: size }, at);
  } catch (err) {
    if (err instanceof OnlineGrowthUnsupported) {
      throw conflict(
        `Cannot grow volume ${r.id} while it is mounted: ${err.message}. The filesystem will be grown when the volume is next staged (restart the pod).`,
        err,
      );
    }
    throw err;
  }
  return size;
}

/**
 * Checks an existing filesystem before it is mounted writable and grows an ext4 that is smaller than
 * its device (offline growth needs no CAP_SYS_RESOURCE, so every stage makes up for a failed online
 * grow). Returns true when an xfs or btrfs must be grown once mounted.
 */
export async function checkAndGrowOffline(
  d: NodeDeps,
  x: Exec,
  id: string,
  fsType: FsType,
  loop: LoopDevice,
): Promise<boolean> {
  await d.host.check(x, fsType, loop.path);
  const size = await d.host.filesystemSize(fsType, loop.path);
  const small = mustGrow(size, loop.sizeBytes);
  if (!small || fsType !== 'ext4') return small;
  await d.host.growOffline(x, loop.path);
  const grown = await d.host.filesystemSize('ext4', loop.path);
  if (grown === undefined || mustGrow(grown, loop.sizeBytes)) {
    throw broken(
      `resize2fs left the ext4 filesystem of volume ${id} at ${grown ?? 'an unreadable size'} on a ${loop.sizeBytes}-byte device.`,
    );
  }
  x.log.info({ device: loop.path, from: size, to: grown }, 'grew ext4 filesystem before mounting');
  return false;
}
