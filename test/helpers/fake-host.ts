/**
 * An in-memory kernel behind the Host interface, for unit tests of the node algorithms (src/node/).
 *
 * What it models: paths outside the pool (directories, files, symlinks), loop devices, the mount table
 * as /proc/self/mountinfo shows it, what each image holds (blank, a filesystem, something else), and
 * frozen superblocks. The pool itself is real: fileId and fileSizeOf read the real files (only images are
 * asked), so images keep their true identity and size, and a test grows one with truncate.
 *
 * `ops` logs every command and every change, in order ("attach <image> rw", "format ext4 /dev/loop0",
 * "umount <path>"...); pure look-ups (mounts, loops, fileId, pathKind) are not logged. An operation can
 * be made to fail with failNext / failWhen, to drive rollback paths; a failed one is logged with
 * " (failed)" and changes nothing. Like the real host, every failure is a rejected promise, never a
 * synchronous throw (rollback code chains .catch on the call).
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { busy, conflict } from '../../src/errors.js';
import { CommandError, type Exec } from '../../src/exec/runner.js';
import type {
  DeviceContent,
  FileId,
  Host,
  LoopDevice,
  MountEntry,
  MountRequest,
  PathKind,
  Usage,
} from '../../src/host/host.js';
import type { AttachOptions } from '../../src/host/loop.js';
import type { FormatOptions } from '../../src/host/filesystem.js';
import { devToMajorMinor } from '../../src/host/paths.js';
import type { FsType } from '../../src/pool/types.js';

/** What an image holds. A filesystem knows its own size, which lags behind a grown image. */
export type ImageContent =
  { kind: 'blank' } | { kind: 'filesystem'; type: string; size: number } | { kind: 'other'; what: string };

/** A path outside the pool: a file has a size (0 is what a block publish creates), a symlink a target. */
export interface FakeNode {
  kind: 'directory' | 'file' | 'symlink';
  size?: number;
  target?: string;
}

interface FakeLoop extends LoopDevice {
  /** The image as the fake knows it (backingFile is what sysfs shows, which a test may rewrite). */
  image: string;
  identity: FileId | undefined;
  /** Detached while in use: the kernel lets go of it when its last user does. */
  autoclear: boolean;
  sectorSize: number;
}

/** Flags a mount carries per mount point (mountinfo field 6); the rest belong to the superblock. */
const PER_MOUNT = new Set(['nosuid', 'nodev', 'noexec', 'noatime', 'nodiratime', 'relatime', 'nosymfollow']);

/** A failure as the real runner reports it: a command that exited non-zero with `stderr`. */
export function commandError(command: string, stderr: string, exitCode = 32): CommandError {
  return new CommandError(command, [], exitCode, stderr, 'exit', `${command} exited with status ${exitCode}`);
}

const dashO = (options: readonly string[]): string => (options.length ? ` -o ${options.join(',')}` : '');

export class FakeHost implements Host {
  readonly ops: string[] = [];
  readonly table: MountEntry[] = [];
  readonly attached = new Map<string, FakeLoop>();
  /** What each image holds, by image path; an image not listed is blank. */
  readonly content = new Map<string, ImageContent>();
  /** Devices whose filesystem is frozen. */
  readonly frozen = new Set<string>();
  /** Devices a filesystem holds with no mount here (left frozen, or mounted in a namespace that is gone). */
  readonly heldElsewhere = new Set<string>();
  /** Devices a process holds open (not exclusively: no filesystem claims them), by device path. */
  readonly heldOpen = new Set<string>();
  /** False: losetup cannot report backing identities (the node algorithms fall back to paths). */
  identityReadable = true;
  /** True: binds come out without their flags (older util-linux), so publish must remount them. */
  bindDropsFlags = false;
  /** The sector size a device comes up with unless asked for one (the kernel's choice). */
  kernelSectorSize = 512;
  /**
   * What this host's page cache remembers a device holding, by device path, when that is not what its
   * image holds now (read before another node wrote it): probes answer it until the device is flushed.
   */
  readonly cached = new Map<string, DeviceContent>();

  private readonly nodes = new Map<string, FakeNode>();
  private readonly faults: { match: (op: string) => boolean; err: Error; once: boolean }[] = [];
  private nextMountId = 100;

  // ---- test controls -------------------------------------------------------------------------------

  /** The next operation of this kind (the first word of its log line) fails with `err`. */
  failNext(kind: string, err: Error = commandError(kind, `${kind}: injected failure`)): void {
    this.faults.push({ match: (op) => op.split(' ')[0] === kind, err, once: true });
  }

  /**
   * The next `kind` step takes effect and is then reported failed, as when a command is killed after
   * the kernel acted (a mount that took effect, then a timeout): its caller must undo it all the same.
   */
  killAfter(kind: 'attach' | 'mount' | 'bind'): void {
    const self = this as unknown as Record<string, (...args: unknown[]) => Promise<unknown>>;
    const original = self[kind];
    if (!original) throw new Error(`no step ${kind}`);
    self[kind] = async (...args: unknown[]) => {
      self[kind] = original;
      await original.apply(this, args);
      this.ops.push(`(${kind} reported killed after it took effect)`);
      throw commandError(kind, `${kind}: killed`);
    };
  }

  /** Every operation whose log line `match` accepts fails with `err`. */
  failWhen(match: (op: string) => boolean, err: Error): void {
    this.faults.push({ match, err, once: false });
  }

  /** Puts a directory (with its parents), a file or a symlink at `p`. */
  addPath(p: string, node: FakeNode = { kind: 'directory' }): void {
    for (let d = path.dirname(p); d !== '/'; d = path.dirname(d))
      if (!this.nodes.has(d)) this.nodes.set(d, { kind: 'directory' });
    this.nodes.set(p, node);
  }

  /** Removes everything beneath directory `p` (not `p` itself). */
  emptyDir(p: string): void {
    for (const k of [...this.nodes.keys()]) if (k.startsWith(`${p}/`)) this.nodes.delete(k);
  }

  /** A mount of something that is no volume (a tmpfs, another driver's disk). */
  addForeignMount(mountPoint: string, source = 'tmpfs', fsType = 'tmpfs'): MountEntry {
    return this.push({ root: '/', mountPoint, options: ['rw'], fsType, source, superOptions: ['rw'] });
  }

  mountsAt(p: string): MountEntry[] {
    return this.table.filter((m) => m.mountPoint === p);
  }

  kindOf(p: string): PathKind {
    const n = this.nodes.get(p);
    if (p === '/') return 'directory';
    if (!n) return 'absent';
    if (n.kind === 'file') return n.size ? 'file' : 'empty-file';
    return n.kind;
  }

  // ---- paths --------------------------------------------------------------------------------------

  async fileId(p: string): Promise<FileId | undefined> {
    const st = await fs.stat(p, { bigint: true }).catch(() => undefined);
    return st ? { dev: devToMajorMinor(st.dev), ino: st.ino.toString() } : undefined;
  }

  async fileSizeOf(p: string): Promise<number> {
    return (await fs.stat(p)).size;
  }

  /** Resolves the symlinks the fake holds, component by component, as realpath would. */
  canonicalPath(p: string): Promise<string> {
    let out = '/';
    for (const part of path.resolve(p).split('/').filter(Boolean)) {
      const n = this.nodes.get(path.join(out, part));
      out = n?.kind === 'symlink' && n.target ? path.resolve(out, n.target) : path.join(out, part);
    }
    return Promise.resolve(out);
  }

  pathKind(p: string): Promise<PathKind> {
    return Promise.resolve(this.kindOf(p));
  }

  holdsEntries(p: string): Promise<boolean> {
    const prefix = p === '/' ? '/' : `${p}/`;
    return Promise.resolve(
      this.kindOf(p) === 'directory' && [...this.nodes.keys()].some((k) => k.startsWith(prefix)),
    );
  }

  async makeDir(p: string): Promise<void> {
    const kind = this.kindOf(p);
    await this.act(`mkdir ${p}`, kind === 'absent' || kind === 'directory' ? '' : 'File exists');
    this.addPath(p);
  }

  async createFile(p: string): Promise<boolean> {
    if (this.kindOf(p) !== 'absent') return false;
    const parent = this.kindOf(path.dirname(p));
    await this.act(`create ${p}`, parent === 'directory' ? '' : 'No such file or directory');
    this.nodes.set(p, { kind: 'file', size: 0 });
    return true;
  }

  /** The rules of paths.ts removeCreated: only an empty directory or an empty file goes. */
  async removeCreated(p: string): Promise<'removed' | 'absent'> {
    const kind = this.kindOf(p);
    if (kind === 'absent') return 'absent';
    const children = [...this.nodes.keys()].some((k) => path.dirname(k) === p);
    if (kind === 'file' || kind === 'symlink' || children) {
      throw conflict(
        `${p} is ${children ? 'not empty' : `a ${kind}`}; the driver did not make it, so it stays.`,
      );
    }
    await this.act(`remove ${p}`, this.mountsAt(p).length > 0 ? 'Device or resource busy' : '');
    this.nodes.delete(p);
    return 'removed';
  }

  // ---- loop devices -------------------------------------------------------------------------------

  loops(_x: Exec, identify: (l: LoopDevice) => boolean = () => true): Promise<LoopDevice[]> {
    const shown = [...this.attached.values()].map((l) => ({
      ...this.view(l),
      backing: this.identityReadable && identify(l) ? l.identity : undefined,
    }));
    return Promise.resolve(shown);
  }

  async attach(_x: Exec, image: string, id: FileId | undefined, opts: AttachOptions): Promise<LoopDevice> {
    const identity = await this.fileId(image);
    await this.act(
      `attach ${image} ${opts.readOnly ? 'ro' : 'rw'}`,
      identity ? '' : `${image}: No such file`,
    );
    let n = 0;
    while (this.attached.has(`loop${n}`)) n++;
    const loop: FakeLoop = {
      name: `loop${n}`,
      path: `/dev/loop${n}`,
      majorMinor: `7:${n}`,
      backingFile: image,
      backing: id,
      readOnly: opts.readOnly,
      directIo: opts.directIo,
      sizeBytes: await this.fileSizeOf(image),
      image,
      identity,
      autoclear: false,
      sectorSize: opts.sectorSize ?? this.kernelSectorSize,
    };
    this.attached.set(loop.name, loop);
    return this.view(loop);
  }

  /** Like losetup -d: a device still in use stays until its last user goes (and false is returned). */
  async detach(_x: Exec, loop: LoopDevice): Promise<boolean> {
    const now = this.attached.get(loop.name);
    // Detached and reused for another file since the caller read it: not the caller's any more.
    if (!now || now.backingFile !== loop.backingFile) return true;
    await this.act(`detach ${loop.name}`);
    if (this.inUse(now)) now.autoclear = true;
    else {
      this.attached.delete(loop.name);
      this.cached.delete(loop.path); // the kernel drops a detached device's cached pages
    }
    return !now.autoclear;
  }

  async refreshSize(_x: Exec, loop: LoopDevice): Promise<LoopDevice> {
    await this.act(`refresh ${loop.name}`);
    const l = this.mustLoop(loop.path);
    l.sizeBytes = await this.fileSizeOf(l.image);
    return { ...this.view(l), backing: loop.backing };
  }

  reread(loop: LoopDevice): Promise<LoopDevice> {
    const l = this.attached.get(loop.name);
    if (!l || l.backingFile !== loop.backingFile)
      return Promise.reject(busy(`${loop.path} was detached meanwhile (by another process); try again.`));
    return Promise.resolve({ ...this.view(l), backing: loop.backing });
  }

  hold(loop: LoopDevice): Promise<{ release(): Promise<void> } | undefined> {
    const l = this.attached.get(loop.name);
    if (!l || l.backingFile !== loop.backingFile) return Promise.resolve(undefined);
    const already = this.heldOpen.has(l.path); // a test's own holder stays
    this.heldOpen.add(l.path);
    return Promise.resolve({
      release: () => {
        if (!already) this.heldOpen.delete(l.path);
        if (l.autoclear && !this.inUse(l) && this.attached.get(l.name) === l) this.attached.delete(l.name);
        return Promise.resolve();
      },
    });
  }

  /** Filesystems here have no unit: like attach, this keeps the device's sector size. */
  fitToImage(_x: Exec, _image: string, loop: LoopDevice): Promise<LoopDevice> {
    return Promise.resolve(loop);
  }

  sectorSize(loop: LoopDevice): Promise<number> {
    return Promise.resolve(this.attached.get(loop.name)?.sectorSize ?? 512);
  }

  claimed(device: string): Promise<boolean> {
    return Promise.resolve(this.heldElsewhere.has(device) || this.table.some((m) => m.source === device));
  }

  // ---- the mount table ----------------------------------------------------------------------------

  mounts(): Promise<MountEntry[]> {
    return Promise.resolve(structuredClone(this.table));
  }

  /** Mounts what the image holds: fails, as the kernel does, when that is not a filesystem of `fsType`. */
  async mount(_x: Exec, m: MountRequest): Promise<void> {
    const loop = this.attached.get(path.basename(m.source));
    const here = loop && this.contentOf(loop.image);
    const why =
      this.kindOf(m.target) !== 'directory'
        ? `mount point ${m.target} does not exist`
        : here?.kind !== 'filesystem' || here.type !== m.fsType
          ? `wrong fs type, bad option, bad superblock on ${m.source}`
          : '';
    await this.act(`mount ${m.fsType} ${m.source} ${m.target}${dashO(m.options)}`, why);
    // mount(8) falls back to read-only on a read-only device.
    const ro = m.options.includes('ro') || loop?.readOnly ? 'ro' : 'rw';
    const rest = m.options.filter((o) => o !== 'ro' && o !== 'rw');
    this.heldElsewhere.delete(m.source);
    this.push({
      root: '/',
      mountPoint: m.target,
      majorMinor: loop?.majorMinor,
      options: [ro, ...rest.filter((o) => PER_MOUNT.has(o))],
      fsType: m.fsType,
      source: m.source,
      superOptions: [ro, ...rest.filter((o) => !PER_MOUNT.has(o))],
    });
  }

  /** A bind of a mounted directory copies its mount; a bind of /dev/loopN shows root "/loopN". */
  async bind(_x: Exec, source: string, target: string, options: readonly string[]): Promise<void> {
    const device = /^\/dev\/(loop\d+)$/.exec(source)?.[1];
    const from = this.mountsAt(source).at(-1);
    const fits = device
      ? this.attached.has(device) && this.kindOf(target).endsWith('file')
      : from !== undefined && this.kindOf(target) === 'directory';
    await this.act(`bind ${source} ${target}${dashO(options)}`, fits ? '' : `cannot bind ${source} there`);
    const kept = this.bindDropsFlags ? [] : options.filter((o) => o !== 'rw');
    const flags = [kept.includes('ro') ? 'ro' : 'rw', ...kept.filter((o) => o !== 'ro')];
    if (device) {
      const node = { fsType: 'devtmpfs', source: 'udev', superOptions: ['rw'], majorMinor: '0:5' };
      this.push({ ...node, root: `/${device}`, mountPoint: target, options: flags });
    } else if (from) {
      this.push({ ...structuredClone(from), mountPoint: target, options: flags });
    }
  }

  async remountBind(_x: Exec, target: string, options: readonly string[]): Promise<void> {
    const top = this.mountsAt(target).at(-1);
    await this.act(`remount ${target}${dashO(options)}`, top ? '' : `${target}: not mounted`);
    if (top) top.options = [options.includes('ro') ? 'ro' : 'rw', ...options.filter((o) => o !== 'ro')];
  }

  async unmountAll(
    _x: Exec,
    mountPoint: string,
    _table: MountEntry[] | undefined,
    ours: (m: MountEntry) => boolean,
  ): Promise<MountEntry[]> {
    for (let top = this.mountsAt(mountPoint).at(-1); top; top = this.mountsAt(mountPoint).at(-1)) {
      if (!ours(top)) throw conflict(`${mountPoint} now has ${top.source} mounted on top`);
      await this.act(`umount ${mountPoint}`);
      this.table.splice(this.table.indexOf(top), 1);
      this.released(top);
    }
    return this.mounts();
  }

  // ---- filesystems on devices ---------------------------------------------------------------------

  async probe(_x: Exec, device: string): Promise<DeviceContent> {
    await this.act(`probe ${device}`);
    const remembered = this.cached.get(device);
    if (remembered) return remembered;
    const c = this.contentOf(this.mustLoop(device).image);
    return c.kind === 'filesystem' ? { kind: c.kind, type: c.type } : c;
  }

  /** Like mkfs: refuses a read-only device, or one that holds a signature unless forced to overwrite a filesystem. */
  async format(_x: Exec, fsType: FsType, device: string, options?: FormatOptions): Promise<void> {
    const loop = this.attached.get(path.basename(device));
    const before = loop && this.contentOf(loop.image);
    const why = !loop
      ? `${device}: No such device`
      : loop.readOnly
        ? `${device}: Read-only file system`
        : before?.kind === 'blank' || (options?.force === true && before?.kind === 'filesystem')
          ? ''
          : `${device} contains existing data (${before?.kind}); will not format it`;
    await this.act(`format ${fsType} ${device}`, why);
    if (loop) this.content.set(loop.image, { kind: 'filesystem', type: fsType, size: loop.sizeBytes });
  }

  async check(_x: Exec, fsType: FsType, device: string): Promise<void> {
    await this.act(`check ${fsType} ${device}`);
  }

  async flush(_x: Exec, device: string): Promise<void> {
    await this.act(`flush ${device}`);
    this.cached.delete(device);
  }

  /** Images whose filesystem a mkfs left unfinished (an XFS superblock still "in progress"). */
  readonly unfinished = new Set<string>();

  mkfsUnfinished(fsType: FsType, device: string): Promise<boolean> {
    const loop = this.attached.get(path.basename(device));
    return Promise.resolve(fsType === 'xfs' && loop !== undefined && this.unfinished.has(loop.image));
  }

  async filesystemSize(fsType: FsType, device: string): Promise<number | undefined> {
    await this.act(`superblock ${device}`, '', false);
    const c = this.contentOf(this.mustLoop(device).image);
    return c.kind === 'filesystem' && c.type === fsType ? c.size : undefined;
  }

  mountedFilesystemSize(_x: Exec, fsType: FsType, device: string): Promise<number | undefined> {
    return this.filesystemSize(fsType, device);
  }

  async growOffline(_x: Exec, device: string): Promise<void> {
    await this.act(`grow-offline ${device}`);
    this.fillDevice(device);
  }

  async growOnline(_x: Exec, fsType: FsType, device: string, mountPoint: string): Promise<void> {
    await this.act(`grow-online ${fsType} ${device}`, this.mountsAt(mountPoint).length ? '' : 'not mounted');
    this.fillDevice(device);
  }

  /** No ext4 here ever records an error. */
  ext4Errors(): number {
    return 0;
  }

  /** statfs: the filesystem's own size, a tenth of it used. */
  async usage(mountPoint: string): Promise<Usage> {
    await this.act(`usage ${mountPoint}`, '', false);
    const top = this.mountsAt(mountPoint).at(-1);
    const c = top && this.contentOf(this.mustLoop(top.source).image);
    if (c?.kind !== 'filesystem') throw new Error(`${mountPoint} holds no filesystem`);
    const used = Math.floor(c.size / 10);
    return {
      totalBytes: c.size,
      availableBytes: c.size - used,
      usedBytes: used,
      totalInodes: 1024,
      freeInodes: 1000,
    };
  }

  // ---- freezing -----------------------------------------------------------------------------------

  async freeze(_x: Exec, mountPoint: string): Promise<void> {
    const top = this.mountsAt(mountPoint).at(-1);
    // Frozen already (by anyone): the kernel says busy.
    const refusal = !top ? 'not a mount point' : this.frozen.has(top.source) ? 'Device or resource busy' : '';
    await this.act(`freeze ${mountPoint}`, refusal);
    if (top) this.frozen.add(top.source);
  }

  /** True when it was frozen; a path with no mount reaches no frozen filesystem. */
  async thaw(_x: Exec, mountPoint: string): Promise<boolean> {
    await this.act(`thaw ${mountPoint}`);
    const device = this.mountsAt(mountPoint).at(-1)?.source;
    return device !== undefined && this.frozen.delete(device);
  }

  thawDevice(x: Exec, device: string, table?: readonly MountEntry[]): Promise<boolean | undefined> {
    const m = (table ?? this.table).find((e) => e.source === device);
    return m ? this.thaw(x, m.mountPoint) : Promise.resolve(undefined);
  }

  // ---- internals ----------------------------------------------------------------------------------

  /**
   * Logs `op`, or fails it: with an injected fault, or with `refusal` (what the kernel would say).
   * `log` false: a look-up, which can be made to fail but is not logged.
   */
  private act(op: string, refusal = '', log = true): Promise<void> {
    const i = this.faults.findIndex((f) => f.match(op));
    const fault = this.faults[i];
    if (fault?.once) this.faults.splice(i, 1);
    const err = fault?.err ?? (refusal ? commandError(op.split(' ')[0] ?? op, refusal) : undefined);
    if (err || log) this.ops.push(err ? `${op} (failed)` : op);
    return err ? Promise.reject(err) : Promise.resolve();
  }

  private push(m: Omit<MountEntry, 'id' | 'parent' | 'majorMinor'> & { majorMinor?: string | undefined }) {
    const entry: MountEntry = { ...m, id: this.nextMountId++, parent: 1, majorMinor: m.majorMinor ?? '0:99' };
    this.table.push(entry);
    return entry;
  }

  /** After an unmount: a frozen superblock with no mount left keeps its device; an autoclear loop goes. */
  private released(m: MountEntry): void {
    if (this.table.some((e) => e.source === m.source)) return;
    if (this.frozen.has(m.source)) this.heldElsewhere.add(m.source);
    for (const l of this.attached.values()) {
      if (!l.autoclear || this.inUse(l)) continue;
      this.attached.delete(l.name);
      this.cached.delete(l.path); // the kernel drops a detached device's cached pages
    }
  }

  private inUse(l: FakeLoop): boolean {
    const mounted = this.table.some((m) => m.source === l.path || m.root === `/${l.name}`);
    return mounted || this.heldElsewhere.has(l.path) || this.heldOpen.has(l.path);
  }

  private view(l: FakeLoop): LoopDevice {
    const { image: _i, identity: _d, sectorSize: _s, ...loop } = l;
    return loop;
  }

  private mustLoop(device: string): FakeLoop {
    const l = this.attached.get(path.basename(device));
    if (!l) throw commandError('blockdev', `${device}: No such device`);
    return l;
  }

  private contentOf(image: string): ImageContent {
    return this.content.get(image) ?? { kind: 'blank' };
  }

  /** A grown filesystem fills its device. */
  private fillDevice(device: string): void {
    const l = this.mustLoop(device);
    const c = this.contentOf(l.image);
    if (c.kind === 'filesystem') this.content.set(l.image, { ...c, size: l.sizeBytes });
  }
}
