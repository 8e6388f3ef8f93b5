/**
 * The node's kernel, as the node algorithms see it: loop devices, the mount table, mounting and
 * unmounting, filesystems on devices, freezing, and the few path operations a publish or an unpublish
 * makes. `kernelHost` is the real one; tests of the algorithms use a fake behind the same interface
 * (test/helpers/fake-host.ts), in the spirit of mount-utils' Interface.
 *
 * Every method that runs a command takes the caller's Exec, so commands obey its deadline and
 * cancellation (or, for cleanup, a detached scope of their own).
 */
import { open } from 'node:fs/promises';
import type { Exec } from '../exec/runner.js';
import type { FsType } from '../pool/types.js';
import {
  checkFilesystem,
  type DeviceContent,
  filesystemSize,
  ext4Errors,
  filesystemUsage,
  flushDeviceBuffers,
  formatDevice,
  type FormatOptions,
  growExt4Offline,
  growOnline,
  mkfsUnfinished,
  mountedFilesystemSize,
  probeDevice,
  type Usage,
} from './filesystem.js';
import { freeze, thaw, thawDevice } from './freeze.js';
import { kernelVersion, mkfsCompat } from './mkfs-compat.js';
import {
  type AttachOptions,
  attachLoop,
  fitLoopToImage,
  loopSectorSize,
  backingName,
  detachLoop,
  listLoops,
  type LoopDevice,
  refreshLoopSize,
  reread,
} from './loop.js';
import {
  bindMount,
  type MountEntry,
  type MountRequest,
  mountFilesystem,
  readMounts,
  remountBind,
  unmountAll,
} from './mounts.js';
import {
  canonicalPath,
  createFile,
  type FileId,
  fileId,
  fileSize,
  holdsEntries,
  isClaimed,
  makeDir,
  type PathKind,
  pathKind,
  removeCreated,
  sameFile,
} from './paths.js';

export type { DeviceContent, FileId, LoopDevice, MountEntry, MountRequest, PathKind, Usage };

export interface Host {
  // Paths
  fileId(p: string): Promise<FileId | undefined>;
  fileSizeOf(p: string): Promise<number>;
  canonicalPath(p: string): Promise<string>;
  pathKind(p: string): Promise<PathKind>;
  /** True when `p` is a directory holding anything. */
  holdsEntries(p: string): Promise<boolean>;
  makeDir(p: string): Promise<void>;
  /** Creates an empty file unless something is there; true when it made it. */
  createFile(p: string): Promise<boolean>;
  /** Removes an empty directory or empty file the driver made; anything else is a conflict, left in place. */
  removeCreated(p: string): Promise<'removed' | 'absent'>;

  // Loop devices
  /** Attached loop devices; those `identify` picks carry their backing file's device and inode. */
  loops(x: Exec, identify?: (l: LoopDevice) => boolean): Promise<LoopDevice[]>;
  attach(x: Exec, image: string, id: FileId | undefined, opts: AttachOptions): Promise<LoopDevice>;
  /** False when the device stays attached until its last user closes it. */
  detach(x: Exec, loop: LoopDevice): Promise<boolean>;
  refreshSize(x: Exec, loop: LoopDevice): Promise<LoopDevice>;
  /** The device read again; ABORTED when it was detached since `loop` was read (maybe attached anew). */
  reread(loop: LoopDevice): Promise<LoopDevice>;
  /**
   * Opens the device (read-only) and keeps it open until `release`: a detach meanwhile, anyone's, only
   * marks it to go when its last user closes it, so its number cannot go to another image. Undefined
   * when it cannot be opened: its detach is under way (the kernel refuses opens then), or no node of it
   * is here.
   */
  hold(loop: LoopDevice): Promise<{ release(): Promise<void> } | undefined>;
  /** Gives a device with sectors larger than the unit of the filesystem its image holds that unit. */
  fitToImage(x: Exec, image: string, loop: LoopDevice): Promise<LoopDevice>;
  /** The device's logical sector size. */
  sectorSize(loop: LoopDevice): Promise<number>;
  /** True when a filesystem holds the device, mounted here or not. */
  claimed(device: string): Promise<boolean>;

  // The mount table
  mounts(): Promise<MountEntry[]>;
  mount(x: Exec, m: MountRequest): Promise<void>;
  bind(x: Exec, source: string, target: string, options: readonly string[]): Promise<void>;
  remountBind(x: Exec, target: string, options: readonly string[]): Promise<void>;
  /** Unmounts everything stacked on `mountPoint`, while `ours` accepts the top; returns the table afterwards. */
  unmountAll(
    x: Exec,
    mountPoint: string,
    table: MountEntry[] | undefined,
    ours: (m: MountEntry) => boolean,
  ): Promise<MountEntry[]>;

  // Filesystems on devices
  probe(x: Exec, device: string): Promise<DeviceContent>;
  format(x: Exec, fsType: FsType, device: string, options?: FormatOptions): Promise<void>;
  check(x: Exec, fsType: FsType, device: string): Promise<void>;
  flush(x: Exec, device: string): Promise<void>;
  filesystemSize(fsType: FsType, device: string): Promise<number | undefined>;
  mkfsUnfinished(fsType: FsType, device: string): Promise<boolean>;
  mountedFilesystemSize(
    x: Exec,
    fsType: FsType,
    device: string,
    mountPoint: string,
  ): Promise<number | undefined>;
  growOffline(x: Exec, device: string): Promise<void>;
  growOnline(x: Exec, fsType: FsType, device: string, mountPoint: string): Promise<void>;
  usage(mountPoint: string): Promise<Usage>;
  /** Errors an ext4 on `device` recorded since it was last checked (0 for other filesystems). */
  ext4Errors(device: string): number;

  // Freezing
  freeze(x: Exec, mountPoint: string): Promise<void>;
  /** True when it was frozen. */
  thaw(x: Exec, mountPoint: string): Promise<boolean>;
  /** Thaws the filesystem on `device` through any mount of it; undefined when none is left. */
  thawDevice(x: Exec, device: string, table?: readonly MountEntry[]): Promise<boolean | undefined>;
}

export const kernelHost: Host = {
  fileId,
  fileSizeOf: fileSize,
  canonicalPath,
  pathKind,
  holdsEntries,
  makeDir,
  createFile,
  removeCreated,
  loops: listLoops,
  attach: attachLoop,
  detach: detachLoop,
  refreshSize: refreshLoopSize,
  reread,
  hold: holdLoop,
  fitToImage: fitLoopToImage,
  sectorSize: loopSectorSize,
  claimed: isClaimed,
  mounts: readMounts,
  mount: mountFilesystem,
  bind: bindMount,
  remountBind,
  unmountAll,
  probe: probeDevice,
  format: async (x, fsType, device, options) => {
    const compat = await mkfsCompat(x, fsType);
    if (compat.off.length > 0) {
      x.log.info(
        { fsType, kernel: kernelVersion().join('.'), off: compat.off, args: compat.args },
        'mkfs features turned off for this kernel',
      );
    }
    await formatDevice(x, fsType, device, { ...options, compat: compat.args });
  },
  check: (x, fsType, device) => checkFilesystem(x, fsType, device),
  flush: flushDeviceBuffers,
  filesystemSize,
  mkfsUnfinished,
  mountedFilesystemSize,
  growOffline: growExt4Offline,
  growOnline,
  usage: filesystemUsage,
  ext4Errors,
  freeze,
  thaw,
  thawDevice,
};

/**
 * The loop devices on this host backed by `file` (by device and inode; by path when the identity of
 * a device cannot be read). Empty when the file does not exist.
 */
export async function loopsBackedBy(host: Host, x: Exec, file: string): Promise<LoopDevice[]> {
  const id = await host.fileId(file);
  if (!id) return [];
  const name = file.slice(file.lastIndexOf('/') + 1);
  const loops = await host.loops(x, (l) => backingName(l) === name);
  return loops.filter((l) => (l.backing ? sameFile(l.backing, id) : l.backingFile === file));
}

async function holdLoop(loop: LoopDevice): Promise<{ release(): Promise<void> } | undefined> {
  try {
    const fh = await open(loop.path, 'r');
    return { release: () => fh.close().catch(() => undefined) };
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === 'ENXIO' || code === 'ENOENT') return undefined;
    throw err;
  }
}
