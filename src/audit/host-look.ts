/**
 * What this host has of the pool: loop devices backed by its images (recognized by the backing file's
 * device and inode, as the node plugin does; by path only when the identity cannot be read) and the
 * mounts that show them; and which of them a lease explains.
 *
 * A lease explains a loop device of its volume when the lease's staging path shows it, when the lease
 * names it (its `device`), or, for a lease of a node on this host, when the lease names no device or
 * one that is no longer there: a stage may be attaching right now, and a device that might be a
 * stage's is never called a leak.
 */
import path from 'node:path';
import type { Exec } from '../exec/runner.js';
import type { Host, LoopDevice, MountEntry } from '../host/host.js';
import { backingName, isDeletedBacking } from '../host/loop.js';
import { devToMajorMinor } from '../host/paths.js';
import { isDeviceBind, loopOfMount } from '../node/on-host.js';
import { listDir } from '../pool/fsutil.js';
import { IMAGE_FILE } from '../pool/layout.js';
import type { Pool } from '../pool/pool.js';
import type { Lease } from '../pool/types.js';
import fs from 'node:fs/promises';

export type ImageKind = 'volume' | 'snapshot' | 'trash' | 'quarantine' | 'deleted';

export interface PoolImageRef {
  kind: ImageKind;
  /** The volume or snapshot id the image belongs to (for trash and quarantine: the id it had). */
  id: string | undefined;
  path: string;
  /** An image being written (disk.img.partial). */
  partial: boolean;
}

export interface PoolLoop {
  loop: LoopDevice;
  image: PoolImageRef;
  /** Mounts that show this device: filesystems on it, and binds of its device node. */
  mounts: MountEntry[];
}

export interface HostView {
  loops: PoolLoop[];
  mounts: MountEntry[];
}

const PARTIAL = `${IMAGE_FILE}.partial`;
const isImageName = (l: LoopDevice): boolean => backingName(l) === IMAGE_FILE || backingName(l) === PARTIAL;
const idOf = (entry: string): string | undefined => /^((?:vol|snap)-[0-9a-f]{32})/.exec(entry)?.[1];

/** Where `p` (a path under the pool's root) sits in the pool, or undefined when it is not an image of it. */
export function classifyImagePath(root: string, p: string): PoolImageRef | undefined {
  const rel = path.relative(root, p);
  if (rel.startsWith('..') || path.isAbsolute(rel)) return undefined;
  const [top, entry, file, ...rest] = rel.split('/');
  if (entry === undefined || rest.length > 0 || (file !== IMAGE_FILE && file !== PARTIAL)) return undefined;
  const partial = file === PARTIAL;
  switch (top) {
    case 'volumes':
      return /^vol-[0-9a-f]{32}$/.test(entry) ? { kind: 'volume', id: entry, path: p, partial } : undefined;
    case 'snapshots':
      return /^snap-[0-9a-f]{32}$/.test(entry)
        ? { kind: 'snapshot', id: entry, path: p, partial }
        : undefined;
    case 'trash':
      return { kind: 'trash', id: idOf(entry), path: p, partial };
    case 'quarantine':
      return { kind: 'quarantine', id: idOf(entry), path: p, partial };
    case undefined:
    default:
      return undefined;
  }
}

/**
 * Every image file in the pool, by "dev:ino": regular files of the pool's filesystem with one name,
 * reached through no symlink. A symlink or a hard link planted in the pool (to another pool's image,
 * say) would make that image's devices, and the mounts of a pod using them, look like this pool's
 * leftovers.
 */
async function imagesById(pool: Pool): Promise<Map<string, PoolImageRef>> {
  const out = new Map<string, PoolImageRef>();
  const { layout } = pool;
  const rootDev = (await fs.stat(pool.root, { bigint: true })).dev;
  const plain = async (p: string, dir: boolean) => {
    const st = await fs.lstat(p, { bigint: true }).catch(() => undefined);
    if (!st || st.dev !== rootDev) return undefined;
    if (dir) return st.isDirectory() ? st : undefined;
    return st.isFile() && st.nlink === 1n ? st : undefined;
  };
  const dirs = [layout.volumesDir, layout.snapshotsDir, layout.trashDir, layout.quarantineDir];
  for (const dir of dirs) {
    if (!(await plain(dir, true))) continue;
    for (const entry of await listDir(dir)) {
      if (!(await plain(path.join(dir, entry), true))) continue;
      for (const file of [IMAGE_FILE, PARTIAL]) {
        const p = path.join(dir, entry, file);
        const ref = classifyImagePath(pool.root, p);
        if (!ref) continue;
        const st = await plain(p, false);
        if (st) out.set(`${devToMajorMinor(st.dev)}:${st.ino}`, ref);
      }
    }
  }
  return out;
}

/** The loop devices of this pool's images on this host, and the mount table. */
export async function lookAtPoolOnHost(pool: Pool, host: Host, x: Exec): Promise<HostView> {
  const [loops, mounts, images, rootStat] = await Promise.all([
    host.loops(x, isImageName),
    host.mounts(),
    imagesById(pool),
    fs.stat(pool.root, { bigint: true }),
  ]);
  const poolDev = devToMajorMinor(rootStat.dev);
  const prefix = `${pool.root}/`;
  const out: PoolLoop[] = [];
  for (const loop of loops) {
    if (!isImageName(loop)) continue;
    const shown = loop.backingFile.replace(/ \(deleted\)$/, '');
    let image: PoolImageRef | undefined;
    if (loop.backing) {
      image = images.get(`${loop.backing.dev}:${loop.backing.ino}`);
      // An image deleted while attached: on the pool's filesystem, and shown under this pool's root.
      if (!image && isDeletedBacking(loop) && loop.backing.dev === poolDev && shown.startsWith(prefix)) {
        const ref = classifyImagePath(pool.root, shown);
        image = { kind: 'deleted', id: ref?.id, path: shown, partial: ref?.partial ?? false };
      }
    } else if (shown.startsWith(prefix)) {
      const ref = classifyImagePath(pool.root, shown);
      if (ref) image = isDeletedBacking(loop) ? { ...ref, kind: 'deleted' } : ref;
    }
    if (!image) continue;
    out.push({ loop, image, mounts: mounts.filter((m) => loopOfMount(m, [loop]) !== undefined) });
  }
  // By device number (loop2 before loop10); no localeCompare, which maps the ICU data into memory.
  const num = (name: string): number => Number(name.replace(/^loop/, ''));
  out.sort((a, b) => num(a.loop.name) - num(b.loop.name));
  return { loops: out, mounts };
}

/**
 * The devices among `loops` (all backed by one volume's image) that the volume's leases explain.
 * `here` says whether a node may run on this host.
 */
export function explainedLoops(
  loops: readonly LoopDevice[],
  leases: readonly Lease[],
  mounts: readonly MountEntry[],
  here: (node: string) => boolean,
): Set<string> {
  const out = new Set<string>();
  const all = (): Set<string> => new Set(loops.map((l) => l.name));
  for (const l of leases) {
    for (const m of mounts) {
      if (m.mountPoint !== l.stagingPath || isDeviceBind(m)) continue;
      const shown = loopOfMount(m, loops);
      if (shown) out.add(shown.name);
    }
    if (!here(l.node)) continue;
    if (l.device === undefined) return all(); // no device recorded yet: a stage may be attaching
    const named = loops.find((d) => d.name === l.device);
    if (!named) return all(); // the hint is stale: a new stage may be attaching its device
    out.add(named.name);
  }
  return out;
}

/** Whether `p` lies under `dir`. */
export const isUnder = (p: string, dir: string): boolean =>
  p === dir || p.startsWith(dir.endsWith('/') ? dir : `${dir}/`);
