/**
 * mkfs options a node's kernel can mount. The image's tools are newer than many nodes' kernels: the
 * xfsprogs of a current Debian makes filesystems with nrext64 that kernels before 5.19 refuse
 * ("unknown incompatible features": RHEL 8, Ubuntu 20.04, Amazon Linux 2), e2fsprogs 1.47 adds
 * orphan_file that kernels before 5.15 mount only read-only. mkfs runs on the node, so the driver
 * knows the kernel (uname): it turns off each default feature that kernel is too old for, as far as
 * the installed mkfs knows the feature (an option it does not know would make it fail).
 */
import os from 'node:os';
import { CommandError, detached, type Exec } from '../exec/runner.js';
import { whileCalling } from './fresh.js';
import type { FsType } from '../pool/types.js';

export type Version = readonly [number, number, number];

/** The first "a.b[.c]" in `text`. */
export function parseVersion(text: string): Version | undefined {
  const m = /(\d+)\.(\d+)(?:\.(\d+))?/.exec(text);
  if (!m) return undefined;
  return [Number(m[1]), Number(m[2]), Number(m[3] ?? 0)];
}

const before = (a: Version, b: Version): boolean =>
  a[0] !== b[0] ? a[0] < b[0] : a[1] !== b[1] ? a[1] < b[1] : a[2] < b[2];

export function kernelVersion(release = os.release()): Version {
  return parseVersion(release) ?? [0, 0, 0];
}

/** What the installed mkfs of a filesystem knows: feature names it accepts, and where (btrfs: -O or -R). */
export interface MkfsKnows {
  features: ReadonlySet<string>;
  /** btrfs-progs before 6.3 take runtime features (free-space-tree) with -R, later ones with -O. */
  runtimeFeatures?: ReadonlySet<string>;
}

interface Rule {
  fs: FsType;
  feature: string;
  /** The first kernel that mounts a filesystem with the feature (read-write). */
  kernel: Version;
  /** The mkfs argument that turns it off. */
  flag: '-m' | '-i' | '-n' | '-O' | '-R';
  off: string;
}

/** Features that mkfs turns on by default in some release, and the kernels that first mount them. */
export const RULES: readonly Rule[] = [
  { fs: 'xfs', feature: 'nrext64', kernel: [5, 19, 0], flag: '-i', off: 'nrext64=0' },
  { fs: 'xfs', feature: 'bigtime', kernel: [5, 10, 0], flag: '-m', off: 'bigtime=0' },
  { fs: 'xfs', feature: 'inobtcount', kernel: [5, 10, 0], flag: '-m', off: 'inobtcount=0' },
  { fs: 'xfs', feature: 'exchange', kernel: [6, 10, 0], flag: '-i', off: 'exchange=0' },
  { fs: 'xfs', feature: 'parent', kernel: [6, 12, 0], flag: '-n', off: 'parent=0' },
  { fs: 'xfs', feature: 'metadir', kernel: [6, 13, 0], flag: '-m', off: 'metadir=0' },
  { fs: 'xfs', feature: 'reflink', kernel: [4, 9, 0], flag: '-m', off: 'reflink=0' },
  { fs: 'xfs', feature: 'rmapbt', kernel: [4, 8, 0], flag: '-m', off: 'rmapbt=0' },
  { fs: 'ext4', feature: 'orphan_file', kernel: [5, 15, 0], flag: '-O', off: '^orphan_file' },
  { fs: 'ext4', feature: 'metadata_csum_seed', kernel: [4, 4, 0], flag: '-O', off: '^metadata_csum_seed' },
  { fs: 'ext4', feature: 'metadata_csum', kernel: [3, 18, 0], flag: '-O', off: '^metadata_csum' },
  { fs: 'btrfs', feature: 'block-group-tree', kernel: [6, 1, 0], flag: '-O', off: '^block-group-tree' },
  { fs: 'btrfs', feature: 'free-space-tree', kernel: [4, 5, 0], flag: '-O', off: '^free-space-tree' },
  { fs: 'btrfs', feature: 'no-holes', kernel: [3, 14, 0], flag: '-O', off: '^no-holes' },
];

export interface CompatChoice {
  /** Arguments to add to mkfs. */
  args: string[];
  /** What was turned off, and why, for the log. */
  off: string[];
}

/** The mkfs arguments for a filesystem `kernel` can mount, with a mkfs that knows `knows`. */
export function compatArgs(fsType: FsType, kernel: Version, knows: MkfsKnows): CompatChoice {
  const groups = new Map<string, string[]>();
  const off: string[] = [];
  for (const r of RULES) {
    if (r.fs !== fsType || !before(kernel, r.kernel)) continue;
    let flag: string = r.flag;
    if (knows.runtimeFeatures?.has(r.feature)) flag = '-R';
    else if (!knows.features.has(r.feature)) continue;
    groups.set(flag, [...(groups.get(flag) ?? []), r.off]);
    off.push(`${r.feature} (needs Linux ${r.kernel.slice(0, 2).join('.')})`);
  }
  const args = [...groups].flatMap(([flag, opts]) => [flag, opts.join(',')]);
  return { args, off };
}

/**
 * Reads what the installed mkfs knows, from what it prints whatever its exit status. A tool that is
 * not installed knows nothing extra (its mkfs then fails on its own). Any other failure to get its
 * answer (it timed out, was killed, could not be started) is an error: read as "knows nothing", it
 * would have the filesystem made with every feature this kernel cannot mount.
 */
async function askMkfs(x: Exec, fsType: FsType): Promise<MkfsKnows> {
  const text = async (cmd: string, args: string[]): Promise<string> => {
    try {
      const r = await x.run(cmd, args, { okCodes: [0, 1], timeoutMs: 10_000, quiet: true });
      return `${r.stdout}\n${r.stderr}`;
    } catch (err) {
      if (err instanceof CommandError && err.reason === 'exit') return err.stderr;
      if (err instanceof CommandError && err.reason === 'spawn' && err.why === 'ENOENT') return '';
      throw err;
    }
  };
  switch (fsType) {
    case 'xfs': {
      // Its usage lists every option it knows as "name=0|1".
      const usage = await text('mkfs.xfs', []);
      return { features: new Set([...usage.matchAll(/([a-z0-9_]+)=0\|1/g)].map((m) => m[1] ?? '')) };
    }
    case 'ext4': {
      const v = parseVersion(await text('mke2fs', ['-V'])) ?? [0, 0, 0];
      const features = new Set<string>();
      if (!before(v, [1, 43, 0])) features.add('metadata_csum').add('metadata_csum_seed');
      if (!before(v, [1, 47, 0])) features.add('orphan_file');
      return { features };
    }
    case 'btrfs': {
      const names = (t: string): Set<string> =>
        new Set([...t.matchAll(/^([a-z0-9-]+)\s+-/gm)].map((m) => m[1] ?? ''));
      return {
        features: names(await text('mkfs.btrfs', ['-O', 'list-all'])),
        runtimeFeatures: names(await text('mkfs.btrfs', ['-R', 'list-all'])),
      };
    }
  }
}

const asked = new Map<FsType, Promise<MkfsKnows>>();
/** How long the questions to one mkfs may take together (each command has 10 s). */
const ASK_MS = 30_000;

/**
 * The compatibility arguments for this node's kernel and mkfs (the tool is asked once per process: its
 * answer is kept, a question that got none is asked again by the next caller).
 */
export async function mkfsCompat(x: Exec, fsType: FsType, kernel = kernelVersion()): Promise<CompatChoice> {
  let knows = asked.get(fsType);
  if (!knows) {
    // Asked for every caller to come, free of this one's deadline and cancellation; each caller stops
    // waiting at its own.
    const question = askMkfs(detached(x, ASK_MS), fsType);
    knows = question;
    asked.set(fsType, question);
    question.catch(() => {
      if (asked.get(fsType) === question) asked.delete(fsType);
    });
  }
  return compatArgs(fsType, kernel, await whileCalling(x, knows));
}
