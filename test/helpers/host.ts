/**
 * Host state for root-only tests: what a test left behind under its temporary root (loop devices whose
 * image lives there, mounts there), cleaning up exactly that, and scratch filesystems for pools.
 */
import { execFileSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { pino } from 'pino';
import { bindExec, ExecRunner } from '../../src/exec/runner.js';
import { readSys } from '../../src/host/loop.js';
import { mkfsCompat } from '../../src/host/mkfs-compat.js';
import { parseMountInfo } from '../../src/host/mounts.js';

export interface Leaks {
  loops: string[];
  mounts: string[];
}

function sh(cmd: string, args: string[]): string {
  return execFileSync(cmd, args, { encoding: 'utf8', env: { ...process.env, LC_ALL: 'C' } });
}

/** glibc's encoding of st_dev → "major:minor" (what losetup's BACK-MAJ:MIN shows). */
function majorMinor(dev: bigint): string {
  return `${((dev >> 8n) & 0xfffn) | ((dev >> 32n) & ~0xfffn)}:${(dev & 0xffn) | ((dev >> 12n) & ~0xffn)}`;
}

/**
 * "major:minor:inode" → path, for the regular files under `root`, descending into the mount points
 * under it only where they are local filesystems (a scratch pool): never into a network one, which
 * may be hung on purpose.
 */
async function fileIdsUnder(root: string, skip: Set<string>): Promise<Map<string, string>> {
  const ids = new Map<string, string>();
  const walk = async (dir: string): Promise<void> => {
    const entries = await fs.readdir(dir, { withFileTypes: true }).catch(() => []);
    for (const e of entries) {
      const p = path.join(dir, e.name);
      if (e.isDirectory()) {
        if (!skip.has(p)) await walk(p);
      } else if (e.isFile()) {
        const st = await fs.stat(p, { bigint: true }).catch(() => undefined);
        if (st) ids.set(`${majorMinor(st.dev)}:${st.ino}`, p);
      }
    }
  };
  await walk(root);
  return ids;
}

/**
 * Loop devices backed by files under `root` and mounts under `root` (deepest first). A loop device
 * attached in another mount namespace (a node plugin in a container, or of its own) shows its backing
 * file as that namespace saw it, relative to a bind mount or to a mount this one cannot reach
 * ("/pool/volumes/vol-…/disk.img"): such devices are matched by their backing file's device and inode,
 * also inside a scratch pool's filesystem mounted under `root`.
 */
export async function leaksUnder(root: string): Promise<Leaks> {
  return reported(await leakedUnder(root));
}

/** A device whose detach was asked while something held it says so (what holds it is the question). */
const pending = (l: LeakedLoop): boolean => sysOf(l.name, 'loop/autoclear') === '1';

const reported = ({ loops, mounts }: { loops: LeakedLoop[]; mounts: string[] }): Leaks => ({
  loops: loops.map((l) => (pending(l) ? `${l.line} (detach pending)` : l.line)),
  mounts,
});

/** Whether `l` still shows what it was listed with (its number may serve another image by now). */
const unchanged = (l: LeakedLoop): boolean =>
  sysOf(l.name, 'loop/backing_file') === l.shown && sysOf(l.name, 'diskseq') === l.seq;

/** A leaked loop device as listed: its line, and what sysfs showed of it then (to detach only that). */
interface LeakedLoop {
  line: string;
  name: string;
  shown: string;
  seq: string;
}

/** One sysfs attribute of loop device `name`, '' when it has none (not attached), as the driver reads it. */
const sysOf = (name: string, file: string): string => readSys(`/sys/block/${name}/${file}`) ?? '';

async function leakedUnder(root: string): Promise<{ loops: LeakedLoop[]; mounts: string[] }> {
  const prefix = `${root}/`;
  const under = parseMountInfo(await fs.readFile('/proc/self/mountinfo', 'utf8')).filter(
    (m) => m.mountPoint === root || m.mountPoint.startsWith(prefix),
  );
  const mounts = under.map((m) => m.mountPoint).sort((a, b) => b.length - a.length);
  const loops: LeakedLoop[] = [];
  const others = new Map<string, { shown: string; seq: string }>();
  for (const name of await fs.readdir('/sys/block')) {
    if (!/^loop\d+$/.test(name)) continue;
    const seq = sysOf(name, 'diskseq');
    const shown = sysOf(name, 'loop/backing_file');
    if (shown.startsWith(prefix)) loops.push({ line: `/dev/${name} ${shown}`, name, shown, seq });
    else if (shown !== '') others.set(name, { shown, seq });
  }
  if (others.size > 0) {
    let listed: { name?: string; 'back-maj:min'?: string; 'back-ino'?: string | number }[] = [];
    try {
      listed =
        (
          JSON.parse(
            sh('losetup', ['--list', '--json', '--output', 'NAME,BACK-MAJ:MIN,BACK-INO']) || '{}',
          ) as {
            loopdevices?: typeof listed;
          }
        ).loopdevices ?? [];
    } catch {
      listed = [];
    }
    const local = new Set(['ext4', 'xfs', 'btrfs', 'tmpfs']);
    const ids = await fileIdsUnder(
      root,
      new Set(under.filter((m) => !local.has(m.fsType)).map((m) => m.mountPoint)),
    );
    for (const d of listed) {
      const name = path.basename(d.name ?? '');
      const seen = others.get(name);
      const file = ids.get(`${d['back-maj:min']?.trim() ?? ''}:${String(d['back-ino'] ?? '')}`);
      if (seen && file) loops.push({ line: `/dev/${name} ${file}`, name, ...seen });
    }
  }
  return { loops, mounts };
}

/** Whether `mountPoint` is a mount point in this process's mount namespace. */
export async function isMounted(mountPoint: string): Promise<boolean> {
  return parseMountInfo(await fs.readFile('/proc/self/mountinfo', 'utf8')).some(
    (m) => m.mountPoint === mountPoint,
  );
}

/**
 * Removes exactly what `leaksUnder(root)` finds and returns what was found, in rounds: the loop devices
 * first (one whose filesystem is mounted goes once it is unmounted), then the mounts, deepest first. A
 * device attached in another mount namespace holds its image through that namespace's mount, not this
 * one's: its image's filesystem here unmounts all the same, after which nothing here could tell the
 * device was ours. A lazy unmount is the last resort.
 */
export async function cleanupUnder(root: string): Promise<Leaks> {
  // A detach the file asked for while something else had the device open for a moment (another file's
  // `losetup --list`, running beside it, slow on a loaded machine) ends at that close: given five
  // seconds, it is not a leak.
  const waiting = (await leakedUnder(root)).loops.filter(pending);
  for (let i = 0; i < 250 * SLOW && waiting.some(unchanged); i++) await new Promise((r) => setTimeout(r, 20));
  let now = await leakedUnder(root);
  const found = reported(now);
  for (let round = 0; round < 4; round++) {
    if (now.loops.length === 0 && now.mounts.length === 0) return found;
    for (const l of now.loops.filter(unchanged)) {
      try {
        sh('losetup', ['-d', `/dev/${l.name}`]);
      } catch {
        // gone meanwhile: the next round looks again
      }
    }
    for (const mp of now.mounts) {
      try {
        sh('umount', [mp]);
      } catch {
        // busy: the next round
      }
    }
    now = await leakedUnder(root);
  }
  for (const mp of now.mounts) sh('umount', ['-l', mp]);
  return found;
}

export interface ScratchFs {
  mountPoint: string;
  device: string;
  remove(): Promise<void>;
}

/** A real filesystem of `fsType` on a loop device, mounted at `dir/mnt` (for pools with or without reflink). */
export async function scratchFilesystem(
  dir: string,
  fsType: 'ext4' | 'xfs' | 'btrfs',
  sizeMiB: number,
): Promise<ScratchFs> {
  const image = path.join(dir, `${fsType}-scratch.img`);
  const mountPoint = path.join(dir, 'mnt');
  await fs.mkdir(mountPoint, { recursive: true });
  sh('truncate', ['-s', `${sizeMiB}M`, image]);
  // Made as the driver makes filesystems on this kernel: newer mkfs defaults an older kernel cannot mount.
  const x = bindExec(new ExecRunner(), { log: pino({ level: 'silent' }) });
  const { args: compat } = await mkfsCompat(x, fsType);
  const device = sh('losetup', ['--find', '--show', image]).trim();
  try {
    if (fsType === 'xfs') sh('mkfs.xfs', ['-q', '-m', 'reflink=1', ...compat, device]);
    else if (fsType === 'btrfs') sh('mkfs.btrfs', ['-q', ...compat, device]);
    else sh('mkfs.ext4', ['-q', '-F', ...compat, device]);
    sh('mount', [device, mountPoint]);
  } catch (err) {
    sh('losetup', ['-d', device]);
    throw err;
  }
  return {
    mountPoint,
    device,
    async remove() {
      try {
        sh('umount', [mountPoint]);
      } finally {
        sh('losetup', ['-d', device]);
        await fs.rm(image, { force: true });
      }
    },
  };
}

export async function sha256(file: string): Promise<string> {
  return createHash('sha256')
    .update(await fs.readFile(file))
    .digest('hex');
}

/** Writes `mib` MiB of pseudo-random bytes (seeded, so reproducible) to `file` and returns its sha256. */
export async function writeRandom(file: string, mib: number, seed: number): Promise<string> {
  const hash = createHash('sha256');
  const handle = await fs.open(file, 'w');
  try {
    let x = seed >>> 0 || 1;
    for (let i = 0; i < mib; i++) {
      const buf = Buffer.alloc(1024 * 1024);
      for (let j = 0; j < buf.length; j += 4) {
        x ^= x << 13;
        x ^= x >>> 17;
        x ^= x << 5;
        buf.writeUInt32LE(x >>> 0, j);
      }
      hash.update(buf);
      await handle.write(buf);
    }
    await handle.sync();
  } finally {
    await handle.close();
  }
  return hash.digest('hex');
}

/** Bytes a file occupies on disk. */
export async function diskUsage(file: string): Promise<number> {
  return (await fs.stat(file)).blocks * 512;
}

export const MiB = 2 ** 20;

/**
 * A tag for this run's volume names. A volume's id is a hash of its name, sysfs shows an image on sshfs
 * from the mount's root (/volumes/<id>/disk.img), and loop devices outlive a run that was killed: with
 * names of its own, no volume of this run is taken for a device an earlier run left behind.
 */
export const RUN = Date.now().toString(36);
export const GiB = 2 ** 30;

export const isRoot = (): boolean => process.getuid?.() === 0;

/**
 * How many times slower than this machine the suites run: LOOPVOL_TEST_SLOW, set by test/kernels/ for a
 * guest whose CPU is emulated. The helpers' waits for a process or a mount scale by it.
 */
export const SLOW = Math.max(1, Number(process.env.LOOPVOL_TEST_SLOW ?? 1) || 1);

/** Polls `what` every `everyMs` until it holds; throws after `ms` (by default a minute, times SLOW). */
export async function until(what: () => boolean, ms = 60_000 * SLOW, everyMs = 20): Promise<void> {
  const end = Date.now() + ms;
  while (!what()) {
    if (Date.now() > end) throw new Error('timed out');
    await new Promise((r) => setTimeout(r, everyMs));
  }
}

/**
 * What a reboot of a fenced node would end: mounts each device's frozen ext4 superblock again (the
 * kernel hands back the frozen one), thaws it and unmounts it, so the loop device can go.
 */
export async function thawFenced(devices: readonly string[]): Promise<void> {
  for (const dev of devices) {
    const mp = await fs.mkdtemp('/tmp/loopvol-test-thaw-');
    try {
      execFileSync('mount', ['-t', 'ext4', dev, mp], { stdio: 'ignore' });
      execFileSync('fsfreeze', ['--unfreeze', mp], { stdio: 'ignore' });
    } catch {
      // not frozen, or gone
    } finally {
      try {
        execFileSync('umount', [mp], { stdio: 'ignore' });
      } catch {
        // was not mounted
      }
      await fs.rm(mp, { recursive: true, force: true });
    }
  }
}

/** True when the filesystem at `mp` is frozen (freezing it again says busy). */
export function frozen(mp: string): boolean {
  try {
    execFileSync('fsfreeze', ['--freeze', mp], { stdio: 'pipe' });
  } catch (err) {
    return /busy/i.test(String((err as { stderr?: Buffer }).stderr));
  }
  execFileSync('fsfreeze', ['--unfreeze', mp]);
  return false;
}

/**
 * The command line (argv) that runs what follows it in a mount namespace of its own, as a node plugin
 * in its own container: `propagation` as unshare(1) takes it. A new namespace starts as a copy of this
 * one, with every mount that other test files running beside this one have at that instant; such a
 * copy would keep their filesystems, and so their loop devices, held until this namespace ends (an
 * unmount on the host does not reach a private copy), and their unstage could not detach them. So,
 * inside the new namespace and before the command, the copies of every test's mount (anything under
 * the temporary directory's "loopvol-" entries) except those under `keep` are unmounted there, deepest
 * first. An unmount reaches the peers of the mount's parent: each parent is made private first (in
 * this namespace only), so that with `unchanged` on a host whose mounts are shared nothing is
 * unmounted on the host. A mount point with an escaped character (a space) is left alone.
 */
export function ownMountNamespace(keep: string, propagation: 'private' | 'unchanged' = 'private'): string[] {
  const drop = [
    `awk -v tmp="$1/loopvol-" -v keep="$2" -v OFS="$tab" '{ mp[$1] = $5; up[$1] = $2 } ` +
      `index($5, tmp) == 1 && $5 != keep && index($5, keep "/") != 1 && index($5, "\\\\") == 0 { drop[$1] = 1 } ` +
      `END { for (id in drop) print mp[up[id]], mp[id] }' /proc/self/mountinfo`,
    `sort -t "$tab" -k2,2r`,
    `while IFS="$tab" read -r parent m; do mount --make-private "$parent" && umount -l "$m"; done 2>/dev/null`,
  ].join(' | ');
  const script = `tab=$(printf '\\t'); ${drop}`;
  return [
    'unshare',
    '--mount',
    '--propagation',
    propagation,
    '--',
    'sh',
    '-c',
    `${script}; shift 2; exec "$@"`,
    'sh',
    os.tmpdir(),
    keep,
  ];
}

/** The source of the top mount at `mp` in this process's mount table ('' when nothing is mounted there). */
export async function mountSource(mp: string): Promise<string> {
  const line = (await fs.readFile('/proc/self/mountinfo', 'utf8'))
    .split('\n')
    .filter((l) => l.split(' ')[4] === mp)
    .at(-1);
  return line?.split(' - ')[1]?.split(' ')[1] ?? '';
}
