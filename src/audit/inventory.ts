/**
 * Everything a pool holds, read as it is on disk, with the same parsers and stores the driver uses:
 * volumes (record, image, fences), snapshots, group snapshots, nodes (record, heartbeat, fenced
 * filesystems, freeze requests), locks, trash and quarantine. Reading changes nothing.
 *
 * Ages are judged by this host's clock against the pool filesystem's timestamps (on NFS, the server
 * stamps them): good enough to say "not renewed for minutes", which is all that is asked of them here.
 * Nothing is removed on such a judgement alone; see gc.ts for what is.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Logger } from 'pino';
import { errnoCode } from '../errors.js';
import { Capacity } from '../pool/capacity.js';
import { exists, isRecord, listDir, readJson, type RecordRead } from '../pool/fsutil.js';
import { isGroupSnapshotId, isNodeId, isSnapshotId, isVolumeId } from '../pool/ids.js';
import { type FencedEntry, NodeRegistry } from '../pool/nodes.js';
import { QUARANTINE_NOTE, type Pool } from '../pool/pool.js';
import { type AnswerState, QuiesceBoard } from '../pool/quiesce.js';
import { SnapshotStore } from '../pool/snapshots.js';
import {
  type Attachment,
  type GroupSnapshotMeta,
  type Lease,
  type NodeRecord,
  parseNodeRecord,
  type SnapshotMeta,
  type VolumeMeta,
} from '../pool/types.js';
import { VolumeStore } from '../pool/volumes.js';
import { processGone, selfIdentity } from './self.js';

const BATCH = 64;
/** What fences.ts puts in place of a record it cannot read (it counts as held, by a writer). */
const UNREADABLE_SINCE = 'unknown (unreadable record)';

export interface ImageStat {
  sizeBytes: number;
  allocatedBytes: number;
}

export interface VolumeInfo {
  id: string;
  dir: string;
  record: RecordRead<VolumeMeta>;
  image: ImageStat | undefined;
  /** An image being written (disk.img.partial): a creation or a copy in progress, or interrupted. */
  partial: boolean;
  attachments: Attachment[];
  /** Live leases and revoked ones (revokedAt set). */
  leases: Lease[];
  /** fences.json (or a per-node copy) cannot be read: the volume counts as held by a writer. */
  fencesDamaged: boolean;
}

export interface SnapshotInfo {
  id: string;
  dir: string;
  record: RecordRead<SnapshotMeta>;
  image: ImageStat | undefined;
  partial: boolean;
}

export interface GroupInfo {
  id: string;
  record: RecordRead<GroupSnapshotMeta>;
}

export interface QuarantineInfo {
  entry: string;
  path: string;
  why: string | undefined;
  at: string | undefined;
}

export interface TrashInfo {
  entry: string;
  path: string;
  ageSeconds: number;
}

export interface NodeInfo {
  node: string;
  record: NodeRecord | undefined;
  /** Seconds since its heartbeat was last rewritten; undefined when it has none. */
  heartbeatAgeSeconds: number | undefined;
  /** No heartbeat, or none for longer than the stale time. */
  stale: boolean;
  /** Filesystems the node froze for good (every boot's entries; this boot's are this host's). */
  fenced: FencedEntry[];
  /** Freeze requests standing for this node, by volume id, with the node's answer so far. */
  freezes: Map<string, AnswerState | undefined>;
  /** Its files that exist but cannot be read (.fenced, .revoked): the node holds on, safely, until repaired. */
  damaged: string[];
}

export interface LockInfo {
  key: string;
  file: string;
  holder: string;
  purpose: string;
  role: string | undefined;
  host: string | undefined;
  /** Seconds since the lock file last changed (holders renew it every 15 s). */
  ageSeconds: number;
  /** Whether its holder is provably gone (a process of this host that exited), and why. */
  gone: string | undefined;
}

export interface Inventory {
  volumes: VolumeInfo[];
  snapshots: SnapshotInfo[];
  groups: GroupInfo[];
  quarantine: QuarantineInfo[];
  trash: TrashInfo[];
  nodes: Map<string, NodeInfo>;
  locks: LockInfo[];
}

export interface InventoryOptions {
  /** A node whose heartbeat is older than this (or missing) is stale. */
  staleSeconds: number;
}

async function statImage(file: string): Promise<ImageStat | undefined> {
  try {
    const st = await fs.stat(file);
    return { sizeBytes: st.size, allocatedBytes: st.blocks * 512 };
  } catch (err) {
    if (errnoCode(err) === 'ENOENT' || errnoCode(err) === 'ENOTDIR') return undefined;
    throw err;
  }
}

async function ageSeconds(file: string): Promise<number | undefined> {
  try {
    const st = await fs.stat(file);
    return Math.max(0, (Date.now() - Math.max(st.mtimeMs, st.ctimeMs)) / 1000);
  } catch (err) {
    if (errnoCode(err) === 'ENOENT') return undefined;
    throw err;
  }
}

async function inBatches<T, R>(items: readonly T[], fn: (item: T) => Promise<R>): Promise<R[]> {
  const out: R[] = [];
  for (let i = 0; i < items.length; i += BATCH)
    out.push(...(await Promise.all(items.slice(i, i + BATCH).map(fn))));
  return out;
}

/** The stores the driver itself reads the pool with. */
export function storesFor(pool: Pool, log: Logger): { volumes: VolumeStore; snapshots: SnapshotStore } {
  const nodes = new NodeRegistry(pool.layout);
  return {
    volumes: new VolumeStore(pool, new Capacity(pool.layout, 1), nodes, log),
    snapshots: new SnapshotStore(pool, log),
  };
}

/** Every volume; `fences` false skips the attachments and leases (the metrics need only the rest). */
export async function readVolumes(pool: Pool, store: VolumeStore, fences = true): Promise<VolumeInfo[]> {
  const ids = (await listDir(pool.layout.volumesDir)).filter(isVolumeId).sort();
  return inBatches(ids, async (id) => {
    const [record, image, partial, attachments, leases] = await Promise.all([
      store.inspect(id),
      statImage(pool.layout.volumeImage(id)),
      exists(pool.layout.volumeImageTemp(id)),
      fences ? store.attachments(id) : [],
      fences ? store.leases(id) : [],
    ]);
    const fencesDamaged = [...attachments, ...leases].some((r) => r.since === UNREADABLE_SINCE);
    return {
      id,
      dir: pool.layout.volumeDir(id),
      record,
      image,
      partial,
      attachments: attachments.filter((a) => a.since !== UNREADABLE_SINCE),
      leases: leases.filter((l) => l.since !== UNREADABLE_SINCE),
      fencesDamaged,
    };
  });
}

export async function readSnapshots(pool: Pool, store: SnapshotStore): Promise<SnapshotInfo[]> {
  const ids = (await listDir(pool.layout.snapshotsDir)).filter(isSnapshotId).sort();
  return inBatches(ids, async (id) => ({
    id,
    dir: pool.layout.snapshotDir(id),
    record: await store.inspect(id),
    image: await statImage(pool.layout.snapshotImage(id)),
    partial: await exists(pool.layout.snapshotImageTemp(id)),
  }));
}

async function readGroups(pool: Pool, store: SnapshotStore): Promise<GroupInfo[]> {
  const ids = (await listDir(pool.layout.groupsDir)).filter(isGroupSnapshotId).sort();
  return inBatches(ids, async (id) => ({ id, record: await store.inspectGroup(id) }));
}

export async function readQuarantine(pool: Pool): Promise<QuarantineInfo[]> {
  return inBatches(await pool.quarantined(), async (entry) => {
    const p = path.join(pool.layout.quarantineDir, entry);
    const note = await readJson(path.join(p, QUARANTINE_NOTE)).catch(() => undefined);
    const str = (k: string): string | undefined =>
      isRecord(note) && typeof note[k] === 'string' ? note[k] : undefined;
    return { entry, path: p, why: str('why'), at: str('at') };
  });
}

export async function readTrash(pool: Pool): Promise<TrashInfo[]> {
  const entries = (await listDir(pool.layout.trashDir)).sort();
  const out = await inBatches(entries, async (entry) => {
    const p = path.join(pool.layout.trashDir, entry);
    const age = await ageSeconds(p);
    return age === undefined ? undefined : { entry, path: p, ageSeconds: age };
  });
  return out.filter((t): t is TrashInfo => t !== undefined);
}

const NODE_FILE = /^(.+)\.(json|alive|fenced|revoked|quiesce|frozen|attached)$/;

export async function readNodes(
  pool: Pool,
  opts: InventoryOptions,
  mentioned: readonly string[] = [],
): Promise<Map<string, NodeInfo>> {
  const names = new Set(mentioned.filter(isNodeId));
  for (const f of await listDir(pool.layout.nodesDir)) {
    const node = NODE_FILE.exec(f)?.[1];
    if (node !== undefined && isNodeId(node)) names.add(node);
  }
  const board = new QuiesceBoard(pool);
  const registry = new NodeRegistry(pool.layout);
  const infos = await inBatches([...names].sort(), async (node): Promise<NodeInfo> => {
    const record = parseNodeRecord(await readJson(pool.layout.node(node)).catch(() => undefined));
    const heartbeatAgeSeconds = await ageSeconds(pool.layout.nodeAlive(node));
    const damaged: string[] = [];
    const read = await registry.fenced(node, undefined);
    if (read === 'unreadable') damaged.push(pool.layout.nodeFenced(node));
    const fenced = read === 'unreadable' ? [] : read;
    const revocations = await registry.revocations(node).catch(() => undefined);
    if (revocations === undefined) damaged.push(pool.layout.nodeRevocations(node));
    const requests = await board.requests(node);
    const answers = await board.answers(node);
    const freezes = new Map<string, AnswerState | undefined>();
    for (const r of requests.values()) freezes.set(r.volumeId, answers.get(r.requestId)?.state);
    return {
      node,
      record,
      heartbeatAgeSeconds,
      stale: heartbeatAgeSeconds === undefined || heartbeatAgeSeconds > opts.staleSeconds,
      fenced,
      freezes,
      damaged,
    };
  });
  return new Map(infos.map((n) => [n.node, n]));
}

export async function readLocks(pool: Pool): Promise<LockInfo[]> {
  const me = await selfIdentity();
  const files = (await listDir(pool.layout.locksDir)).filter((f) => f.endsWith('.lock')).sort();
  const out = await inBatches(files, async (f): Promise<LockInfo | undefined> => {
    const file = path.join(pool.layout.locksDir, f);
    const age = await ageSeconds(file);
    if (age === undefined) return undefined; // released meanwhile
    const owner = await readJson(file).catch(() => undefined);
    const field = (k: string): unknown => (isRecord(owner) ? owner[k] : undefined);
    const text = (k: string): string | undefined => {
      const v = field(k);
      return typeof v === 'string' ? v : undefined;
    };
    const pid = field('pid');
    const host = text('host');
    let gone: string | undefined;
    if (typeof pid === 'number' && text('bootId') === me.bootId && text('pidNs') === me.pidNs) {
      if (await processGone(pid, text('start') ?? '')) gone = `its process ${pid} on this host has exited`;
    }
    return {
      key: f.slice(0, -'.lock'.length),
      file,
      holder: typeof pid === 'number' ? `process ${pid} on ${host ?? '?'}` : 'an unreadable owner',
      purpose: text('purpose') ?? '',
      role: text('role'),
      host,
      ageSeconds: age,
      gone,
    };
  });
  return out.filter((l): l is LockInfo => l !== undefined);
}

/** Reads the whole pool. */
export async function readInventory(pool: Pool, log: Logger, opts: InventoryOptions): Promise<Inventory> {
  const stores = storesFor(pool, log);
  const volumes = await readVolumes(pool, stores.volumes);
  const mentioned = volumes.flatMap((v) => [...v.leases, ...v.attachments].map((r) => r.node));
  return {
    volumes,
    snapshots: await readSnapshots(pool, stores.snapshots),
    groups: await readGroups(pool, stores.snapshots),
    quarantine: await readQuarantine(pool),
    trash: await readTrash(pool),
    nodes: await readNodes(pool, opts, mentioned),
    locks: await readLocks(pool),
  };
}

/**
 * A record's state as listings and metrics name it: ready, creating, unreadable (damaged record),
 * no-image (a record whose image is gone), no-record (an image without one), unfinished (neither).
 */
export function stateOf(record: RecordRead<{ state: string }>, hasImage: boolean): string {
  if (record.state === 'damaged') return 'unreadable';
  if (record.state === 'absent') return hasImage ? 'no-record' : 'unfinished';
  if (record.value.state === 'ready' && !hasImage) return 'no-image';
  return record.value.state;
}

/**
 * The PVC a volume was made for, from the labels the provisioner recorded (its csi.storage.k8s.io/
 * parameters, kept without that prefix).
 */
export function pvcOf(meta: Pick<VolumeMeta, 'labels'>): { namespace: string; name: string; pv: string } {
  const label = (key: string): string => meta.labels[key] ?? meta.labels[`csi.storage.k8s.io/${key}`] ?? '';
  return { namespace: label('pvc/namespace'), name: label('pvc/name'), pv: label('pv/name') };
}
