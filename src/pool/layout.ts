/**
 * Where everything lives in a pool directory. The pool describes itself: an operator (or a later
 * release migrating it) can read it with ls and cat.
 *
 *   pool.json                         {"format": 1, ...}: the layout version
 *   volumes/<vol-id>/meta.json        the volume: name, size, filesystem, parameters, state
 *   volumes/<vol-id>/disk.img         its disk image (sparse unless allocation=preallocate)
 *   volumes/<vol-id>/initialized      present once a node formatted it or used it as a raw device;
 *                                     records the sector size of the device its data was written on
 *   volumes/<vol-id>/formatting       written before a node's mkfs: until `initialized` exists, a
 *                                     filesystem of its type on the image is that unfinished mkfs's
 *   volumes/<vol-id>/fences.json      every node's attachment (ControllerPublishVolume, the attach
 *                                     fence) and lease (NodeStageVolume, the node-side fence)
 *   volumes/<vol-id>/attachments/<node>.json, leases/<node>.json   per-node copies of those, for
 *                                     releases before fences.json (read too: an older node's hold counts)
 *   snapshots/<snap-id>/meta.json, disk.img    point-in-time copies
 *   groups/<group-id>/meta.json               volume group snapshots (their members are snapshots)
 *   nodes/<node>.json                 node plugins that serve this pool, and their attach limits
 *   nodes/<node>.attached/<vol-id>    index of volumes published to a node (counts the limit)
 *   nodes/<node>.alive                the node plugin's heartbeat (rewritten every few seconds)
 *   nodes/<node>.fenced               filesystems the node froze for good after a force-detach
 *   nodes/<node>.revoked              volumes force-detached from the node, not yet confirmed by it
 *   nodes/<node>.quiesce              freeze requests to a node (see pool/quiesce.ts)
 *   nodes/<node>.frozen               the node's answers to them
 *   locks/<key>.lock                  cross-process locks
 *   trash/                            deleted volumes and snapshots on their way out
 *   quarantine/<id>.<when>/           directories whose record could not be read, kept for an operator
 *   reserve                           4 MiB of written blocks a call that frees space gives back when
 *                                     the pool is full (see pool/reserve.ts)
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { errnoCode } from '../errors.js';
import { isGroupSnapshotId, isNodeId, isSnapshotId, isVolumeId } from './ids.js';

export const POOL_FORMAT = 1;
/** Every disk image in a pool has this file name (a volume's, a snapshot's). */
export const IMAGE_FILE = 'disk.img';

function checked(id: string, ok: boolean, what: string): string {
  if (!ok) throw new Error(`refusing to build a path from the ${what} ${JSON.stringify(id)}`);
  return id;
}

export class PoolLayout {
  constructor(readonly root: string) {}

  get formatFile(): string {
    return path.join(this.root, 'pool.json');
  }
  get volumesDir(): string {
    return path.join(this.root, 'volumes');
  }
  get snapshotsDir(): string {
    return path.join(this.root, 'snapshots');
  }
  get groupsDir(): string {
    return path.join(this.root, 'groups');
  }
  get nodesDir(): string {
    return path.join(this.root, 'nodes');
  }
  get locksDir(): string {
    return path.join(this.root, 'locks');
  }
  get trashDir(): string {
    return path.join(this.root, 'trash');
  }
  get quarantineDir(): string {
    return path.join(this.root, 'quarantine');
  }

  /** The directories of the pool itself, each made at its creation. */
  get ownDirs(): string[] {
    return [
      this.volumesDir,
      this.snapshotsDir,
      this.groupsDir,
      this.nodesDir,
      this.locksDir,
      this.trashDir,
      this.quarantineDir,
    ];
  }

  volumeDir(id: string): string {
    return path.join(this.volumesDir, checked(id, isVolumeId(id), 'volume id'));
  }
  volumeMeta(id: string): string {
    return path.join(this.volumeDir(id), 'meta.json');
  }
  volumeImage(id: string): string {
    return path.join(this.volumeDir(id), IMAGE_FILE);
  }
  volumeImageTemp(id: string): string {
    return path.join(this.volumeDir(id), `${IMAGE_FILE}.partial`);
  }
  /** How many of the volume's blocks may be shared with another image (a reflink): capacity.ts. */
  volumeShared(id: string): string {
    return path.join(this.volumeDir(id), 'shared.json');
  }
  volumeInitialized(id: string): string {
    return path.join(this.volumeDir(id), 'initialized');
  }
  volumeFormatting(id: string): string {
    return path.join(this.volumeDir(id), 'formatting');
  }
  volumeFences(id: string): string {
    return path.join(this.volumeDir(id), 'fences.json');
  }
  attachmentsDir(id: string): string {
    return path.join(this.volumeDir(id), 'attachments');
  }
  attachment(id: string, node: string): string {
    return path.join(this.attachmentsDir(id), `${checked(node, isNodeId(node), 'node id')}.json`);
  }
  leasesDir(id: string): string {
    return path.join(this.volumeDir(id), 'leases');
  }
  lease(id: string, node: string): string {
    return path.join(this.leasesDir(id), `${checked(node, isNodeId(node), 'node id')}.json`);
  }

  snapshotDir(id: string): string {
    return path.join(this.snapshotsDir, checked(id, isSnapshotId(id), 'snapshot id'));
  }
  snapshotMeta(id: string): string {
    return path.join(this.snapshotDir(id), 'meta.json');
  }
  snapshotImage(id: string): string {
    return path.join(this.snapshotDir(id), IMAGE_FILE);
  }
  snapshotImageTemp(id: string): string {
    return path.join(this.snapshotDir(id), `${IMAGE_FILE}.partial`);
  }

  groupDir(id: string): string {
    return path.join(this.groupsDir, checked(id, isGroupSnapshotId(id), 'group snapshot id'));
  }
  groupMeta(id: string): string {
    return path.join(this.groupDir(id), 'meta.json');
  }

  node(node: string): string {
    return path.join(this.nodesDir, `${checked(node, isNodeId(node), 'node id')}.json`);
  }
  nodeAttachedDir(node: string): string {
    return path.join(this.nodesDir, `${checked(node, isNodeId(node), 'node id')}.attached`);
  }
  nodeAlive(node: string): string {
    return path.join(this.nodesDir, `${checked(node, isNodeId(node), 'node id')}.alive`);
  }
  nodeRevocations(node: string): string {
    return path.join(this.nodesDir, `${checked(node, isNodeId(node), 'node id')}.revoked`);
  }
  nodeFenced(node: string): string {
    return path.join(this.nodesDir, `${checked(node, isNodeId(node), 'node id')}.fenced`);
  }
  nodeQuiesceRequests(node: string): string {
    return path.join(this.nodesDir, `${checked(node, isNodeId(node), 'node id')}.quiesce`);
  }
  nodeQuiesceAnswers(node: string): string {
    return path.join(this.nodesDir, `${checked(node, isNodeId(node), 'node id')}.frozen`);
  }
  nodeAttached(node: string, volumeId: string): string {
    return path.join(this.nodeAttachedDir(node), checked(volumeId, isVolumeId(volumeId), 'volume id'));
  }
}

/**
 * The pool's own directories, when one is not a plain directory: the driver deletes what it puts in
 * the trash, and reads and writes volumes and records, by path. A symlink planted there (anyone who
 * can write to a shared pool can) would point all of that at another place: the trash's sweep would
 * empty the directory it leads to. Missing ones are fine (made, or not yet).
 */
export async function layoutProblem(layout: PoolLayout): Promise<string | undefined> {
  // Deletes and quarantines move directories between these by rename(2): one filesystem for all.
  const moved = new Set([
    layout.volumesDir,
    layout.snapshotsDir,
    layout.groupsDir,
    layout.trashDir,
    layout.quarantineDir,
  ]);
  let first: { dir: string; dev: number } | undefined;
  for (const dir of layout.ownDirs) {
    let st;
    try {
      st = await fs.lstat(dir);
    } catch (err) {
      if (errnoCode(err) === 'ENOENT') continue;
      throw err;
    }
    if (!st.isDirectory())
      return `${dir} is not a directory (${st.isSymbolicLink() ? 'a symlink' : 'another kind of file'}); the driver never follows it. Put back a directory of the pool there.`;
    if (!moved.has(dir)) continue;
    first ??= { dir, dev: st.dev };
    if (st.dev !== first.dev)
      return `${dir} is on another filesystem than ${first.dir}; deletes move directories from one to the other (rename), so they must be one.`;
  }
  return undefined;
}

/** A name the trash holds: `<id>.<12 hex digits>` (Pool.discard), never anything else. */
export function isTrashEntry(entry: string): boolean {
  const dot = entry.lastIndexOf('.');
  const id = entry.slice(0, dot);
  return (
    dot > 0 &&
    /^[0-9a-f]{12}$/.test(entry.slice(dot + 1)) &&
    (isVolumeId(id) || isSnapshotId(id) || isGroupSnapshotId(id))
  );
}
