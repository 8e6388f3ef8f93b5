/**
 * The mount table as the kernel sees it (/proc/self/mountinfo): the truth about what is staged and
 * published on this host, whatever our own files say.
 */
import fs from 'node:fs/promises';
import { conflict } from '../errors.js';
import { CommandError, type Exec } from '../exec/runner.js';
import { freshReading } from './fresh.js';

export interface MountEntry {
  id: number;
  parent: number;
  majorMinor: string;
  /** The path inside the mounted filesystem that is mounted here ("/" for a whole filesystem). */
  root: string;
  mountPoint: string;
  options: string[];
  fsType: string;
  source: string;
  superOptions: string[];
}

/** Undoes mountinfo's octal escapes (\040 for a space, \011, \012, \134). */
export function unescapeMountPath(s: string): string {
  return s.replace(/\\([0-7]{3})/g, (_, oct: string) => String.fromCharCode(parseInt(oct, 8)));
}

export function parseMountInfo(text: string): MountEntry[] {
  const out: MountEntry[] = [];
  for (const line of text.split('\n')) {
    if (!line) continue;
    const fields = line.split(' ');
    const sep = fields.indexOf('-', 6);
    if (sep < 0 || fields.length < sep + 3) continue;
    const [id, parent, majorMinor, root, mountPoint, options] = fields;
    if (!id || !parent || !majorMinor || !root || !mountPoint || !options) continue;
    out.push({
      id: Number(id),
      parent: Number(parent),
      majorMinor,
      root: unescapeMountPath(root),
      mountPoint: unescapeMountPath(mountPoint),
      options: options.split(','),
      fsType: fields[sep + 1] ?? '',
      source: unescapeMountPath(fields[sep + 2] ?? ''),
      superOptions: (fields[sep + 3] ?? '').split(','),
    });
  }
  return out;
}

const mountTable = freshReading(async (): Promise<readonly MountEntry[]> =>
  parseMountInfo(await fs.readFile('/proc/self/mountinfo', 'utf8')),
);

/** The mount table, read after the call asked (shared with the calls that ask at once; see fresh.ts). */
export async function readMounts(): Promise<MountEntry[]> {
  return (await mountTable()).map((m) => ({ ...m }));
}

/** The mounts stacked on `mountPoint`, the visible (last mounted) one last. */
export function mountsAt(mounts: readonly MountEntry[], mountPoint: string): MountEntry[] {
  return mounts.filter((m) => m.mountPoint === mountPoint);
}

export const isReadOnlyMount = (m: MountEntry): boolean => m.options.includes('ro');
/**
 * The kernel turned the filesystem read-only after errors: read-only underneath a mount that is not,
 * or ext4's `emergency_ro` on recent kernels (6.18 here), which leaves the filesystem's own `rw` in place.
 */
export const wentReadOnly = (m: MountEntry): boolean =>
  m.superOptions.includes('emergency_ro') || (m.superOptions.includes('ro') && !m.options.includes('ro'));

/**
 * Unmounts every mount stacked on `mountPoint` (a path that is not mounted is fine), top first, and
 * returns the mount table as it is afterwards. `umount` takes whatever is on top, so the top is read
 * again before each: one that `ours` does not accept (stacked there since the caller looked) is left
 * in place, with a conflict. `table` is a mount table just read, to save reading it again.
 */
export async function unmountAll(
  x: Exec,
  mountPoint: string,
  table: MountEntry[] | undefined,
  ours: (m: MountEntry) => boolean,
): Promise<MountEntry[]> {
  let current = table ?? (await readMounts());
  for (let round = 0; round < 8; round++) {
    const top = mountsAt(current, mountPoint).at(-1);
    if (!top) return current;
    if (!ours(top)) {
      throw conflict(
        `${mountPoint} now has ${top.source} (${top.fsType}) mounted on top, which is not the volume's; it was left in place.`,
      );
    }
    try {
      await x.run('umount', [mountPoint], { timeoutMs: 120_000 });
    } catch (err) {
      if (err instanceof CommandError && /target is busy|device is busy/i.test(err.stderr)) {
        throw conflict(
          `${mountPoint} is busy: a process on this node still uses it (a working directory or an open file there), or something is mounted inside it; it stays mounted until that ends.`,
          err,
        );
      }
      // A mount that vanished between our look and umount is what we wanted.
      if (!(err instanceof CommandError && /not mounted|no mount point/i.test(err.stderr))) throw err;
    }
    current = await readMounts();
  }
  throw new Error(`${mountPoint} is still mounted after repeated unmounts`);
}

export interface MountRequest {
  fsType: string;
  source: string;
  target: string;
  options: readonly string[];
}

/** Mounts a filesystem. */
export async function mountFilesystem(x: Exec, m: MountRequest): Promise<void> {
  await x.run(
    'mount',
    ['-t', m.fsType, ...(m.options.length ? ['-o', m.options.join(',')] : []), m.source, m.target],
    { timeoutMs: 120_000 },
  );
}

/** Bind-mounts `source` (a directory, or a device node onto a file) at `target`. */
export async function bindMount(
  x: Exec,
  source: string,
  target: string,
  options: readonly string[],
): Promise<void> {
  await x.run('mount', ['--bind', ...(options.length ? ['-o', options.join(',')] : []), source, target], {
    timeoutMs: 60_000,
  });
}

/** Changes the per-mount flags of a bind mount (ro, nosuid, nodev, noexec...). */
export async function remountBind(x: Exec, target: string, options: readonly string[]): Promise<void> {
  await x.run('mount', ['-o', ['remount', 'bind', ...options].join(','), target], { timeoutMs: 60_000 });
}

/**
 * The line of mount's stderr that says what failed: mount ends with a hint to read dmesg, which says
 * nothing of the cause, so it is skipped.
 */
export function mountErrorLine(err: unknown): string {
  if (!(err instanceof CommandError)) return '';
  const lines = err.stderr
    .split('\n')
    .map((l) => l.trim())
    .filter((l) => l !== '' && !/^dmesg\(1\) may have more information/i.test(l));
  return (lines.at(0) ?? err.lastStderrLine).replace(/\.+$/, '');
}
