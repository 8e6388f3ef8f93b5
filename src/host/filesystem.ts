/**
 * Filesystems on a device: what is there (blkid -p decides), formatting a blank device (only), checking
 * an existing one, reading its size from the superblock, and growing it offline or online.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { CommandError, type Exec } from '../exec/runner.js';
import { unsafe } from '../errors.js';
import type { FsType } from '../pool/types.js';
import { readSys } from './loop.js';

/**
 * mkfs, fsck and resize leave a filesystem half-written when killed midway, so they are never killed
 * because a caller gave up: they run to their end (the call answers late; its retry waits for them,
 * then finds their result), bounded only by a long timeout of their own. fsck and resize hold the
 * device exclusively (O_EXCL) while they run, so one that outlives this process keeps every later
 * mount and mkfs out until it ends; mkfs.btrfs writes through a plain descriptor, so mkfs dies with
 * this process instead (see formatDevice).
 */
const UNINTERRUPTIBLE = { detached: true, timeoutMs: 6 * 60 * 60_000 } as const;

export type DeviceContent =
  { kind: 'blank' } | { kind: 'filesystem'; type: string } | { kind: 'other'; what: string };

/** blkid -p: exit 2 means no signature at all; a partition table or an ambiguous probe is "other". */
export async function probeDevice(x: Exec, device: string): Promise<DeviceContent> {
  const { exitCode, stdout } = await x.run('blkid', ['-p', '-o', 'export', device], {
    okCodes: [0, 2, 8],
    timeoutMs: 30_000,
  });
  if (exitCode === 2) return { kind: 'blank' };
  if (exitCode === 8) return { kind: 'other', what: 'several conflicting signatures' };
  const tags = Object.fromEntries(
    stdout
      .split('\n')
      .map((l) => l.split('='))
      .filter((kv): kv is [string, string] => kv.length >= 2 && kv[0] !== undefined && kv[1] !== undefined)
      .map(([k, ...v]) => [k, v.join('=')]),
  ) as Record<string, string | undefined>;
  if (tags.PTTYPE) return { kind: 'other', what: `a ${tags.PTTYPE} partition table` };
  if (tags.TYPE && tags.USAGE !== 'filesystem' && tags.USAGE !== undefined) {
    return { kind: 'other', what: `a ${tags.TYPE} signature (${tags.USAGE})` };
  }
  if (tags.TYPE) return { kind: 'filesystem', type: tags.TYPE };
  return { kind: 'other', what: 'an unrecognized signature' };
}

/**
 * mkfs options for fresh sparse images (see bench/README.md for the measurements):
 *  - no discard pass: the image is already sparse, discarding it only costs time;
 *  - ext4: assume_storage_prezeroed (the image reads as zeros), so neither mkfs nor the kernel's
 *    lazy-init thread writes the inode tables, which would allocate ~2% of the image for nothing;
 *    no reserved blocks (-m 0): there is no root-owned daemon to reserve them for;
 *  - no force flags: mkfs.xfs and mkfs.btrfs refuse a signature blkid missed (mkfs.ext4 asks only on
 *    a terminal, and formats; blkid -p and the `initialized` marker are the guards); only `force` (an
 *    XFS that a mkfs of ours left unfinished, see format.ts) overrides that.
 */
function mkfsCommand(
  fsType: FsType,
  device: string,
  prezeroed: boolean,
  compat: readonly string[],
  force: boolean,
): [string, string[]] {
  const f = (flag: string): string[] => (force ? [flag] : []);
  switch (fsType) {
    case 'ext4':
      return [
        'mkfs.ext4',
        [
          '-q',
          ...f('-F'),
          '-b',
          '4096',
          '-m',
          '0',
          '-E',
          prezeroed ? 'nodiscard,assume_storage_prezeroed=1' : 'nodiscard,lazy_itable_init=1',
          ...compat,
          device,
        ],
      ];
    case 'xfs':
      return ['mkfs.xfs', ['-q', '-K', ...f('-f'), ...compat, device]];
    case 'btrfs':
      return ['mkfs.btrfs', ['-q', '-K', ...f('-f'), ...compat, device]];
  }
}

export interface FormatOptions {
  /** Features the node's kernel cannot mount, turned off (mkfs-compat.ts). */
  compat?: readonly string[];
  /** Overwrite the signature found (only what an unfinished mkfs of ours left). */
  force?: boolean;
  /** Stops mkfs (the format lock was lost: another node may format the volume now). */
  signal?: AbortSignal;
}

/**
 * Formats `device`. mkfs runs to its end whatever the caller does, but dies with this process (by
 * kill -9 too): left running, a mkfs that does not hold the device exclusively (mkfs.btrfs) would
 * write over the filesystem that the retry of a restarted driver makes and mounts. What it leaves
 * half-written is known by the volume's `formatting` record (format.ts).
 */
export async function formatDevice(
  x: Exec,
  fsType: FsType,
  device: string,
  { compat = [], force = false, signal }: FormatOptions = {},
): Promise<void> {
  const run = { ...UNINTERRUPTIBLE, diesWithProcess: true, ...(signal ? { signal } : {}) };
  const [cmd, args] = mkfsCommand(fsType, device, true, compat, force);
  try {
    await x.run(cmd, args, run);
  } catch (err) {
    // e2fsprogs older than 1.47 does not know assume_storage_prezeroed.
    if (
      fsType === 'ext4' &&
      err instanceof CommandError &&
      /assume_storage_prezeroed|Bad option/i.test(err.stderr)
    ) {
      const [cmd2, args2] = mkfsCommand(fsType, device, false, compat, force);
      await x.run(cmd2, args2, run);
      return;
    }
    throw err;
  }
}

/**
 * Checks a filesystem before mounting it, repairing what is safe to repair unattended (fsck -a).
 * XFS and btrfs repair themselves at mount (log replay); their offline repair tools are not for
 * unattended use, so they are not run here.
 */
export async function checkFilesystem(x: Exec, fsType: FsType, device: string, force = false): Promise<void> {
  if (fsType !== 'ext4') return;
  // Errors recorded in the superblock (s_error_count) are cleared only by a full check, which -p skips
  // on a filesystem marked clean: the count would then say "stopped" at every mount (fs-state.ts).
  const errors = (await ext4Superblock(device))?.readUInt32LE(0x194) ?? 0;
  const args = force || errors > 0 ? ['-f', '-p', device] : ['-p', device];
  const { exitCode } = await x.run('e2fsck', args, { ...UNINTERRUPTIBLE, okCodes: [0, 1, 2, 4, 8] });
  if (exitCode >= 4) {
    throw unsafe(
      `The ext4 filesystem on ${device} has errors that need a manual e2fsck (exit status ${exitCode}); it was not mounted.`,
    );
  }
}

/** The ext4 superblock on `device`, or undefined when it holds none. */
async function ext4Superblock(device: string): Promise<Buffer | undefined> {
  const sb = await readAt(device, 1024, 1024);
  return sb.length === 1024 && sb.readUInt16LE(0x38) === 0xef53 ? sb : undefined;
}

/** Reads `length` bytes at `offset` from a device. */
async function readAt(device: string, offset: number, length: number): Promise<Buffer> {
  const handle = await fs.open(device, 'r');
  try {
    const buf = Buffer.alloc(length);
    const { bytesRead } = await handle.read(buf, 0, length, offset);
    return buf.subarray(0, bytesRead);
  } finally {
    await handle.close();
  }
}

/**
 * Whether `device` holds a filesystem whose mkfs never finished, by its superblock's own word: mkfs.xfs
 * marks it "in progress" (sb_inprogress) first and clears that last, and the kernel refuses to mount
 * it, so it never held data. mkfs.ext4 and mkfs.btrfs write their superblock last: cut short, they
 * leave none (blkid: blank). Read after the device's buffers were flushed, as blkid's probe is.
 */
export async function mkfsUnfinished(fsType: FsType, device: string): Promise<boolean> {
  if (fsType !== 'xfs') return false;
  const sb = await readAt(device, 0, 512);
  return sb.length === 512 && sb.toString('latin1', 0, 4) === 'XFSB' && sb[126] !== 0;
}

/**
 * The size the filesystem on `device` believes it has, from its superblock. Only for a filesystem that
 * is not mounted, or after the device's buffers were flushed (xfs writes its superblock around the page cache).
 */
export async function filesystemSize(fsType: FsType, device: string): Promise<number | undefined> {
  switch (fsType) {
    case 'ext4': {
      const sb = await ext4Superblock(device);
      if (!sb) return undefined;
      const blockSize = 1024 * 2 ** sb.readUInt32LE(0x18);
      const lo = sb.readUInt32LE(0x04);
      const incompat = sb.readUInt32LE(0x60);
      const hi = incompat & 0x80 ? sb.readUInt32LE(0x150) : 0;
      return (hi * 2 ** 32 + lo) * blockSize;
    }
    case 'xfs': {
      const sb = await readAt(device, 0, 512);
      if (sb.length < 512 || sb.toString('latin1', 0, 4) !== 'XFSB') return undefined;
      const blockSize = sb.readUInt32BE(4);
      const dblocks = Number(sb.readBigUInt64BE(8));
      return dblocks * blockSize;
    }
    case 'btrfs': {
      const sb = await readAt(device, 0x10000, 4096);
      if (sb.length < 4096 || sb.toString('latin1', 0x40, 0x48) !== '_BHRfS_M') return undefined;
      return Number(sb.readBigUInt64LE(0x70));
    }
  }
}

/**
 * The size a mounted filesystem has now, as the filesystem itself reports it (its on-disk superblock
 * can lag behind: xfs logs a grow and writes the superblock back later).
 */
export async function mountedFilesystemSize(
  x: Exec,
  fsType: FsType,
  device: string,
  mountPoint: string,
): Promise<number | undefined> {
  switch (fsType) {
    case 'ext4':
      await flushDeviceBuffers(x, device);
      return filesystemSize('ext4', device);
    case 'xfs': {
      const { stdout } = await x.run('xfs_growfs', ['-n', mountPoint], { timeoutMs: 30_000 });
      const m = /^data\s+=\s+bsize=(\d+)\s+blocks=(\d+)/m.exec(stdout);
      return m?.[1] && m[2] ? Number(m[1]) * Number(m[2]) : undefined;
    }
    case 'btrfs': {
      const { stdout } = await x.run('btrfs', ['filesystem', 'show', '--raw', mountPoint], {
        timeoutMs: 30_000,
      });
      const sizes = [...stdout.matchAll(/devid\s+\d+\s+size\s+(\d+)/g)].map((m) => Number(m[1]));
      return sizes.length > 0 ? sizes.reduce((a, b) => a + b, 0) : undefined;
    }
  }
}

/** Drops the device's cached pages so a superblock read sees the disk. */
export async function flushDeviceBuffers(x: Exec, device: string): Promise<void> {
  await x.run('blockdev', ['--flushbufs', device], { timeoutMs: 30_000 });
}

/**
 * Whether a filesystem of `fsBytes` is to be grown to its device: when it is short by more than what
 * mkfs and the grow tools leave unused at a device's end. That is a last ext4 block group too small to
 * keep: its overhead (a backup superblock, group descriptors growing by 64 bytes per 128 MiB, reserved
 * descriptor blocks, bitmaps, inode table) plus 50 blocks, measured at 5-6 MiB at 6-10 GiB and at
 * 134-262 MiB; xfs and btrfs fill their device. So 8 MiB plus 1 MiB per TiB, not a share of the size
 * (which skipped growths of 5 GiB at 1 TiB). The check after a growth uses the same rule: a tighter
 * one failed growths that left such a group off, which the retry then took as done.
 */
export function mustGrow(fsBytes: number | undefined, deviceBytes: number): boolean {
  return fsBytes !== undefined && fsBytes < deviceBytes - (8 * 2 ** 20 + Math.floor(deviceBytes / 2 ** 20));
}

/** Grows an unmounted ext4 filesystem to fill its device (resize2fs wants a forced check first). */
export async function growExt4Offline(x: Exec, device: string): Promise<void> {
  await checkFilesystem(x, 'ext4', device, true);
  await x.run('resize2fs', [device], UNINTERRUPTIBLE);
}

export class OnlineGrowthUnsupported extends Error {
  override readonly name = 'OnlineGrowthUnsupported';
}

/** Grows a mounted filesystem to fill its device. */
export async function growOnline(x: Exec, fsType: FsType, device: string, mountPoint: string): Promise<void> {
  switch (fsType) {
    case 'ext4':
      try {
        await x.run('resize2fs', [device], UNINTERRUPTIBLE);
      } catch (err) {
        if (
          err instanceof CommandError &&
          /Permission denied to resize|Operation not permitted/i.test(err.stderr)
        ) {
          throw new OnlineGrowthUnsupported(
            'growing a mounted ext4 filesystem needs CAP_SYS_RESOURCE, which this container does not have',
          );
        }
        throw err;
      }
      return;
    case 'xfs':
      await x.run('xfs_growfs', [mountPoint], UNINTERRUPTIBLE);
      return;
    case 'btrfs':
      await x.run('btrfs', ['filesystem', 'resize', 'max', mountPoint], UNINTERRUPTIBLE);
      return;
  }
}

export interface Usage {
  totalBytes: number;
  availableBytes: number;
  usedBytes: number;
  totalInodes: number;
  freeInodes: number;
}

/** Total and free bytes and inodes of a mounted filesystem. */
export async function filesystemUsage(mountPoint: string): Promise<Usage> {
  const st = await fs.statfs(mountPoint);
  const totalBytes = st.blocks * st.bsize;
  const availableBytes = st.bavail * st.bsize;
  return {
    totalBytes,
    availableBytes,
    usedBytes: Math.max(0, (st.blocks - st.bfree) * st.bsize),
    totalInodes: st.files,
    freeInodes: st.ffree,
  };
}

/**
 * The errors ext4 recorded on `device` (a /dev/loopN) since it was last checked (sysfs `errors_count`;
 * e2fsck clears it), 0 when it is not a mounted ext4. Read synchronously, like every sysfs attribute.
 */
export function ext4Errors(device: string): number {
  return Number(readSys(`/sys/fs/ext4/${path.basename(device)}/errors_count`) ?? 0) || 0;
}
