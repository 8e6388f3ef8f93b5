/**
 * Loop devices, read from /sys/block (the kernel's truth, so a restarted plugin finds what its
 * predecessor attached) and changed with losetup, which creates a new device through
 * /dev/loop-control when none is free.
 *
 * Which file backs a loop device is judged by device and inode (LOOP_GET_STATUS64, read through
 * losetup's BACK-MAJ:MIN and BACK-INO columns). The path sysfs shows is only a hint: the kernel prints
 * it as the mount namespace of the process that attached it saw it, so a plugin in a new container
 * reads something like /volumes/vol-…/disk.img for an image it knows as /var/lib/loopvol/pool/….
 *
 * The identity losetup reported is kept under the device's disk sequence number (sysfs `diskseq`): from
 * kernel 6.5 (b90ecc0379eb, "block: increment diskseq on all media change events") the kernel gives the
 * device a new one, from a counter that never goes back, whenever it is attached, detached or given
 * another file (LOOP_CHANGE_FD), and at nothing else (not a resize, a sector size, direct I/O, a
 * mount). The same number read again is the same attachment, so its identity is not asked of losetup
 * again (a process per look, on the path of every publish, unpublish and unstage). Kernels 5.15 to
 * 6.4 show the number but, unless patched, leave it alone when a loop device is attached or detached:
 * there, and without `diskseq`, every look asks losetup. Nothing is learnt at an attach: losetup opens
 * the image by its name, so what the kernel holds is known only by asking it.
 */
import { existsSync, readFileSync } from 'node:fs';
import os from 'node:os';
import fs, { type FileHandle } from 'node:fs/promises';
import path from 'node:path';
import { busy, errnoCode } from '../errors.js';
import { CallStopped, CommandError, detached, type Exec, type RunOptions } from '../exec/runner.js';
import { filesystemUnit, notAnImage, pinnedPath, withImage } from '../pool/images.js';
import { freshReading, whileCalling } from './fresh.js';
import { type FileId, sameFile } from './paths.js';

export interface LoopDevice {
  name: string;
  path: string;
  majorMinor: string;
  /** The backing file's path as sysfs shows it: a hint, relative to whoever attached it. */
  backingFile: string;
  /** The backing file's true identity, when the device could be asked (root, /dev/loopN present). */
  backing: FileId | undefined;
  readOnly: boolean;
  directIo: boolean;
  /** Detached by the kernel when its last user closes it (a detach asked while it was open). */
  autoclear: boolean;
  sizeBytes: number;
  /** The attachment's disk sequence number as sysfs showed it when read; undefined before kernel 6.5. */
  seq?: string;
}

const SYS_BLOCK = '/sys/block';
const DELETED_SUFFIX = ' (deleted)';

/**
 * One sysfs attribute. Read synchronously: sysfs files live in memory and answer in microseconds, and
 * a scan reads several per loop device (a node with 100 devices: a look at each one's loop/ directory,
 * and 5 reads each for the attached), which through the thread pool cost far more than the reads
 * themselves, and more the more calls scan at once.
 */
export function readSys(file: string): string | undefined {
  try {
    return readFileSync(file, 'utf8').trim();
  } catch (err) {
    const code = errnoCode(err);
    if (code === 'ENOENT' || code === 'ENXIO' || code === 'ENODEV') return undefined;
    throw err;
  }
}

/** A loop device from sysfs (no backing identity), undefined when not attached; read now, a throw rejects. */
export function readLoop(name: string): Promise<LoopDevice | undefined> {
  return new Promise((resolve) => {
    resolve(loopFromSysfs(name));
  });
}

function loopFromSysfs(name: string): LoopDevice | undefined {
  // The loop/ directory exists only while attached. Asking first costs a third of the failed open of
  // backing_file (its error object is what costs), and most devices are detached.
  if (!existsSync(path.join(SYS_BLOCK, name, 'loop'))) return undefined;
  // Read between two readings of its disk sequence number: a device whose number stayed the same
  // showed one attachment throughout. One that changed meanwhile is read again, and after a few tries
  // is given without a number (nothing is then learnt of it, or taken as known).
  for (let attempt = 0; ; attempt++) {
    const seq = readSeq(name);
    const loop = attachmentFromSysfs(name);
    if (!loop || seq === undefined) return loop;
    if (readSeq(name) === seq) return { ...loop, seq };
    if (attempt === 3) return loop;
  }
}

function attachmentFromSysfs(name: string): LoopDevice | undefined {
  const base = path.join(SYS_BLOCK, name);
  const backingFile = readSys(path.join(base, 'loop', 'backing_file'));
  if (backingFile === undefined) return undefined; // not attached
  const [ro, dio, autoclear, size, dev] = [
    readSys(path.join(base, 'ro')),
    readSys(path.join(base, 'loop', 'dio')),
    readSys(path.join(base, 'loop', 'autoclear')),
    readSys(path.join(base, 'size')),
    readSys(path.join(base, 'dev')),
  ];
  return {
    name,
    path: `/dev/${name}`,
    majorMinor: dev ?? '',
    backingFile,
    backing: undefined,
    readOnly: ro === '1',
    directIo: dio === '1',
    autoclear: autoclear === '1',
    sizeBytes: Number(size ?? '0') * 512,
  };
}

/** Whether a kernel of this release changes a loop device's `diskseq` at every attach and detach (6.5 on). */
export function trustsDiskseq(release: string): boolean {
  const m = /^(\d+)\.(\d+)/.exec(release);
  if (!m) return false;
  const [major, minor] = [Number(m[1]), Number(m[2])];
  return major > 6 || (major === 6 && minor >= 5);
}
const DISKSEQ = trustsDiskseq(os.release());

const readSeq = (name: string): string | undefined =>
  DISKSEQ ? readSys(path.join(SYS_BLOCK, name, 'diskseq')) : undefined;

/** Backing identities learnt, by device name, with the attachment (and the path it showed) they belong to. */
const learnt = new Map<string, { seq: string; shown: string; id: FileId }>();

/** Keeps `id` as `loop`'s backing identity, for as long as the device keeps the attachment `loop` was read in. */
function learn(loop: LoopDevice, id: FileId | undefined): void {
  if (loop.seq !== undefined && id !== undefined && loop.backingFile !== '')
    learnt.set(loop.name, { seq: loop.seq, shown: shownPath(loop), id });
}

/** The backing identity learnt of the attachment `loop` was read in, if any. */
function known(loop: LoopDevice): FileId | undefined {
  const k = learnt.get(loop.name);
  return k !== undefined && k.seq === loop.seq && k.shown === shownPath(loop) ? k.id : undefined;
}

/**
 * Whether `a` and `b`, two readings of one device, show the same attachment: by sequence number where
 * both have one, else (kernels before 6.5) by the path shown.
 */
const sameAttachment = (a: LoopDevice, b: LoopDevice): boolean =>
  a.seq !== undefined && b.seq !== undefined ? a.seq === b.seq : shownPath(a) === shownPath(b);

/**
 * `loop` read again from sysfs, with the identity it was judged by. A device detached meanwhile (and
 * maybe attached to another file) is not `loop`'s any more: ABORTED, and nothing of it is used.
 */
export async function reread(loop: LoopDevice): Promise<LoopDevice> {
  const now = await readLoop(loop.name);
  if (!now || !sameAttachment(now, loop))
    throw busy(`${loop.path} was detached meanwhile (by another process); try again.`);
  return { ...now, backing: loop.backing };
}

/** The backing path as sysfs shows it, without the " (deleted)" that appears once the file is unlinked. */
const shownPath = (l: LoopDevice): string =>
  l.backingFile.endsWith(DELETED_SUFFIX) ? l.backingFile.slice(0, -DELETED_SUFFIX.length) : l.backingFile;

/** The backing file's name. */
export const backingName = (l: LoopDevice): string => path.basename(shownPath(l));

export const isDeletedBacking = (l: LoopDevice): boolean => l.backingFile.endsWith(DELETED_SUFFIX);

/**
 * Whether `name` is still attached to the file `loop` was read with (not detached, nor detached and
 * reused for another file since): by identity when it is known, else by the path sysfs shows.
 */
async function stillBacks(x: Exec, loop: LoopDevice): Promise<boolean> {
  const now = await readLoop(loop.name);
  if (!now) return false;
  if (loop.seq !== undefined && now.seq !== undefined) {
    // Another attachment since (its number changed), or this one still showing its file (one being
    // detached shows none before its number changes).
    if (now.seq !== loop.seq) return false;
    if (now.backingFile !== '' && shownPath(now) === shownPath(loop)) return true;
  }
  if (loop.backing) {
    const id = (await backingIdentities(x, loop.path)).get(loop.name);
    if (id) return sameFile(id, loop.backing);
  }
  return shownPath(now) === shownPath(loop);
}

interface LosetupJson {
  loopdevices?: { name?: string; 'back-maj:min'?: string; 'back-ino'?: number | string }[];
}

/** A backing file on a filesystem that hung (anyone's, NFS or FUSE) holds losetup beyond its kill. */
const LISTING: RunOptions = { timeoutMs: 30_000, quiet: true, abandonable: true };

/** Backing identities of loop devices (all, or the one `device`), from losetup: one process for all. */
async function backingIdentities(x: Exec, device?: string): Promise<Map<string, FileId>> {
  const out = new Map<string, FileId>();
  let stdout: string;
  try {
    const args = ['--list', '--json', '--output', 'NAME,BACK-MAJ:MIN,BACK-INO'];
    ({ stdout } = await x.run('losetup', device ? [...args, device] : args, LISTING));
  } catch (err) {
    x.log.warn({ err }, "could not read loop devices' backing inodes; judging them by path only");
    return out;
  }
  if (stdout.trim() === '') return out;
  const parsed = JSON.parse(stdout) as LosetupJson;
  for (const d of parsed.loopdevices ?? []) {
    const dev = d['back-maj:min']?.trim();
    const ino = d['back-ino'];
    if (!d.name || !dev || ino === undefined || ino === '' || dev === '0:0') continue;
    out.set(path.basename(d.name), { dev, ino: String(ino) });
  }
  return out;
}

/** Every attached loop device as sysfs shows it: one reading shared by the calls that ask at once. */
const attachedLoops = freshReading(async (): Promise<readonly LoopDevice[]> => {
  const names = (await fs.readdir(SYS_BLOCK)).filter((n) => /^loop\d+$/.test(n));
  return names.map(loopFromSysfs).filter((l): l is LoopDevice => l !== undefined);
});

/**
 * Every loop device's backing identity: one losetup shared by the calls that ask at once. It runs free
 * of the first caller's cancellation, since the others wait on it too.
 */
const allBackingIdentities = freshReading((x: Exec) => backingIdentities(detached(x)));

/**
 * Every attached loop device. Those for which `identify` is true (by default all) also get their
 * backing file's device and inode. Each caller gets its own copies.
 */
export async function listLoops(
  x: Exec,
  identify: (l: LoopDevice) => boolean = () => true,
): Promise<LoopDevice[]> {
  const loops = await attachedLoops();
  const asked = loops.filter(identify);
  if (asked.every((l) => known(l) !== undefined)) {
    return loops.map((l) => (identify(l) ? { ...l, backing: known(l) } : { ...l }));
  }
  // A caller that stops waiting (cancelled, or past its deadline) judges by path, as it did when its
  // own losetup was killed: rollbacks, whose scope has a deadline of its own, still finish.
  const ids = await whileCalling(x, allBackingIdentities(x)).catch((err: unknown) => {
    if (!(err instanceof CallStopped)) throw err;
    x.log.warn("stopped waiting for the loop devices' backing inodes; judging them by path only");
    return new Map<string, FileId>();
  });
  // losetup began after `loops` were read: an attachment whose number is still the same now is the
  // one losetup described. For one whose number changed meanwhile, losetup may have described its
  // successor: it is judged by the path read with it, and its number (now out of date) keeps any later
  // look from taking it for what is attached now (stillBacks).
  return loops.map((l) => {
    if (!identify(l)) return { ...l };
    const backing = ids.get(l.name);
    if (l.seq !== undefined && readSeq(l.name) !== l.seq) return { ...l, backing: undefined };
    learn(l, backing);
    return { ...l, backing };
  });
}

export interface AttachOptions {
  readOnly: boolean;
  directIo: boolean;
  /**
   * The device gets exactly this logical sector size: a raw block volume's, recorded when its data was
   * first written (the geometry its pod sees must not change). Without it, the kernel's choice stays
   * unless it is larger than the unit of the XFS or ext2/3/4 the image holds.
   */
  sectorSize?: number;
}

/** A loop device's logical sector size, from sysfs. */
export function loopSectorSize(loop: LoopDevice): Promise<number> {
  return Promise.resolve(
    Number(readSys(path.join(SYS_BLOCK, loop.name, 'queue', 'logical_block_size')) ?? '512'),
  );
}

/** Attaches `image` (whose identity is `id`) to a free (or newly created) loop device. */
export async function attachLoop(
  x: Exec,
  image: string,
  id: FileId | undefined,
  opts: AttachOptions,
): Promise<LoopDevice> {
  // An image is a regular file the driver made. A symlink or a device planted in its place (anyone
  // who can write to a shared pool can) would hand the host's disk to a pod, or to mkfs: losetup
  // attaches the file checked, through the handle.
  return withImage(image, !opts.readOnly, async (h) => {
    // With direct I/O, kernels from 6.x give a loop device the backing file's direct-I/O alignment as
    // its sector size: 4096 for an image on an XFS pool once it shares blocks (its first snapshot or
    // clone). Data written on 512-byte sectors is then read at other offsets (a partition table) or
    // refused (an O_DIRECT read of 512 bytes), and a filesystem made on smaller units no longer mounts.
    // Older kernels give 512 whatever the pool's disk. So a raw block volume is attached at the size
    // its data was written on: losetup sets it as it attaches, before anything (LVM, md) can claim the
    // device. A device that came up with sectors larger than the unit of the XFS (sector size) or
    // ext2/3/4 (block size) its image holds gets that unit, in place. Where the pool's alignment is
    // larger, the kernel then uses buffered I/O (the stage says so). Every other device keeps the
    // kernel's choice; the image is read only when it came up with more than 512.
    const pinned = pinnedPath(h);
    if (opts.sectorSize !== undefined) return attachChecked(x, image, pinned, id, opts);
    return fitSector(x, await attachChecked(x, image, pinned, id, opts), h);
  });
}

/**
 * Gives a device with sectors larger than the unit of the XFS or ext2/3/4 its image holds that unit, in
 * place (a device detached instead may linger while udev has it open); also a leftover an attach left.
 */
export async function fitLoopToImage(x: Exec, image: string, loop: LoopDevice): Promise<LoopDevice> {
  if ((await loopSectorSize(loop)) <= 512) return loop;
  return withImage(image, false, (h) => fitSector(x, loop, h));
}

async function fitSector(x: Exec, loop: LoopDevice, h: FileHandle): Promise<LoopDevice> {
  const was = await loopSectorSize(loop);
  if (was <= 512) return loop;
  const unit = await filesystemUnit(h);
  if (unit === undefined || was <= unit) return loop;
  // Still this attachment right before (another's geometry is not changed).
  await reread(loop);
  await x.run('losetup', [`--sector-size=${unit}`, loop.path], { timeoutMs: 30_000 });
  x.log.info(
    { device: loop.path, was, sector: unit },
    'set the sector size of the filesystem the image holds',
  );
  return reread(loop);
}

async function attachChecked(
  x: Exec,
  image: string,
  pinned: string,
  id: FileId | undefined,
  opts: AttachOptions,
): Promise<LoopDevice> {
  // No --nooverlap: it would hand back an existing read-write device when a read-only one is asked for.
  // Reuse is decided by the caller from /sys/block.
  const args = ['--find', '--show'];
  if (opts.readOnly) args.push('--read-only');
  if (opts.directIo) args.push('--direct-io=on');
  if (opts.sectorSize !== undefined) args.push(`--sector-size=${opts.sectorSize}`);
  args.push(pinned);
  let lastErr: unknown;
  for (let attempt = 0; attempt < 4; attempt++) {
    try {
      const { stdout } = await x.run('losetup', args, { timeoutMs: 30_000 });
      const dev = stdout.trim();
      const loop = await readLoop(path.basename(dev));
      if (!loop) throw new Error(`losetup reported ${dev} but it is not attached`);
      // losetup resolves the pinned path back to a name and opens that: the kernel shows the path of
      // what it holds, which is the image's unless the image was swapped meanwhile. Detached whatever
      // the caller's deadline: the caller's undo knows the volume's devices, never this one.
      if (shownPath(loop) !== image || isDeletedBacking(loop)) {
        await detached(x).run('losetup', ['--detach', loop.path], { timeoutMs: 30_000 });
        throw notAnImage(image);
      }
      return { ...loop, backing: id };
    } catch (err) {
      lastErr = err;
      // Two attaches racing for the same free device: one gets EBUSY; try again.
      if (!(err instanceof CommandError && /busy/i.test(err.stderr))) throw err;
    }
  }
  throw lastErr;
}

/**
 * Detaches a loop device (if it is still attached to the file it was read with) and waits until the
 * kernel has let go of it. Returns false when the device is still open somewhere (the kernel then
 * detaches it when the last user closes it).
 */
export async function detachLoop(x: Exec, loop: LoopDevice): Promise<boolean> {
  // The device may have been detached and reused for another file since it was read: leave that one.
  if (!(await stillBacks(x, loop))) return true;
  try {
    await x.run('losetup', ['--detach', loop.path], { timeoutMs: 30_000 });
  } catch (err) {
    if (!(await readLoop(loop.name))) return true; // already gone
    throw err;
  }
  // LOOP_CLR_FD is asynchronous while the device is open somewhere; give it a moment.
  for (let i = 0; i < 50; i++) {
    const still = await readLoop(loop.name);
    if (!still || !sameAttachment(still, loop)) return true;
    await new Promise((r) => setTimeout(r, 20));
  }
  x.log.warn(
    { device: loop.path },
    'a loop device is still open somewhere; the kernel detaches it when it is closed',
  );
  return false;
}

/** Makes the loop device see the image's current size (after the image grew). */
export async function refreshLoopSize(x: Exec, loop: LoopDevice): Promise<LoopDevice> {
  await x.run('losetup', ['--set-capacity', loop.path], { timeoutMs: 30_000 });
  return reread(loop);
}
