/** The records a pool keeps on disk, and their parsers (a file written by hand or by an old release is checked, never trusted). */
import { isRecord, isStringRecord, type RecordRead } from './fsutil.js';

export const FS_TYPES = ['ext4', 'xfs', 'btrfs'] as const;
export type FsType = (typeof FS_TYPES)[number];
export const isFsType = (v: unknown): v is FsType =>
  typeof v === 'string' && (FS_TYPES as readonly string[]).includes(v);

/** What a volume holds: one of our filesystems, or 'none' (a raw block volume: whatever the pod made of it). */
export type VolumeFs = FsType | 'none';
const isVolumeFs = (v: unknown): v is VolumeFs => v === 'none' || isFsType(v);

export const ALLOCATIONS = ['sparse', 'preallocate'] as const;
export type Allocation = (typeof ALLOCATIONS)[number];
export const isAllocation = (v: unknown): v is Allocation =>
  typeof v === 'string' && (ALLOCATIONS as readonly string[]).includes(v);

/** A loop device's logical sector size: a power of two the kernel accepts (512 to 64 KiB). */
export const isSectorSize = (v: unknown): v is number =>
  typeof v === 'number' && Number.isInteger(v) && v >= 512 && v <= 65536 && (v & (v - 1)) === 0;

export type AccessType = 'mount' | 'block';

/** The access modes loopvol serves. Multi-node writers are refused: ext4/xfs/btrfs on a loop device cannot be shared. */
export const ACCESS_MODES = [
  'SINGLE_NODE_WRITER',
  'SINGLE_NODE_READER_ONLY',
  'SINGLE_NODE_SINGLE_WRITER',
  'SINGLE_NODE_MULTI_WRITER',
  'MULTI_NODE_READER_ONLY',
] as const;
export type AccessMode = (typeof ACCESS_MODES)[number];
export const isAccessMode = (v: unknown): v is AccessMode =>
  typeof v === 'string' && (ACCESS_MODES as readonly string[]).includes(v);

export const isReaderOnly = (mode: AccessMode): boolean =>
  mode === 'SINGLE_NODE_READER_ONLY' || mode === 'MULTI_NODE_READER_ONLY';
export const isMultiNode = (mode: AccessMode): boolean => mode === 'MULTI_NODE_READER_ONLY';

export interface Capability {
  accessType: AccessType;
  mode: AccessMode;
  /** Requested filesystem for mount access; '' means the volume's own. */
  fsType: string;
  mountFlags: string[];
}

export interface ContentSource {
  kind: 'snapshot' | 'volume';
  id: string;
}

export interface VolumeMeta {
  format: 1;
  id: string;
  name: string;
  state: 'creating' | 'ready';
  capacityBytes: number;
  fsType: VolumeFs;
  allocation: Allocation;
  capabilities: Capability[];
  parameters: Record<string, string>;
  mutableParameters: Record<string, string>;
  /** The capacity_range of the CreateVolume that made it, for idempotent retries. */
  requiredBytes: number;
  limitBytes: number;
  contentSource: ContentSource | null;
  /** Keys the provisioner adds (PVC name, namespace, PV name). */
  labels: Record<string, string>;
  pool: string;
  createdAt: string;
  updatedAt: string;
}

export interface Attachment {
  node: string;
  readonly: boolean;
  accessType: AccessType;
  mode: AccessMode;
  since: string;
}

export interface Lease {
  node: string;
  stagingPath: string;
  accessType: AccessType;
  mode: AccessMode;
  readonly: boolean;
  since: string;
  /** The loop device (e.g. "loop3") the node staged it on: a hint, always checked against /sys/block. */
  device?: string;
  /**
   * That device's disk sequence number when the lease named it (sysfs `diskseq`, where the kernel changes
   * it at every attach: 6.5 on): a device of that name with another number is another attachment. A
   * lease taken again before its attach (a restage) keeps the device it named before, and its number.
   */
  deviceSeq?: string;
  /**
   * The boot id of the host that staged it: another node's lease names devices and a staging path on
   * this host only when it was taken under this host's boot id (several plugins sharing one machine).
   * Kubelet's staging path is the same on every node, so without it a lease left by another host would
   * claim this host's own staging.
   */
  bootId?: string;
  /**
   * Set when the CO detached the volume from the node (ControllerUnpublishVolume) while it still held
   * this lease: the lease no longer lets the node use the volume, but it still stops other nodes until
   * the node has fenced itself (fencedAt) or is seen dead.
   */
  revokedAt?: string;
  /** When the node confirmed it stopped writing (froze the filesystem, or had nothing mounted). */
  fencedAt?: string;
  /** The mount flags it was staged with (not in leases of older releases). */
  mountFlags?: string[];
}

export interface SnapshotMeta {
  format: 1;
  id: string;
  name: string;
  state: 'creating' | 'ready';
  sourceVolumeId: string;
  sizeBytes: number;
  fsType: VolumeFs;
  /** Whether the source had been formatted or used raw (so a restore never gets formatted over). */
  initialized: boolean;
  /** The sector size its source's data was written on (absent: not initialized, or an older record). */
  sectorSize?: number;
  parameters: Record<string, string>;
  groupSnapshotId: string;
  createdAt: string;
}

export interface GroupSnapshotMeta {
  format: 1;
  id: string;
  name: string;
  state: 'creating' | 'ready';
  sourceVolumeIds: string[];
  snapshotIds: string[];
  parameters: Record<string, string>;
  createdAt: string;
}

export interface NodeRecord {
  node: string;
  pool: string;
  maxVolumes: number;
  host: string;
  registeredAt: string;
}

const str = (v: unknown): v is string => typeof v === 'string';
const num = (v: unknown): v is number => typeof v === 'number' && Number.isSafeInteger(v) && v >= 0;

function parseCapability(v: unknown): Capability | undefined {
  if (!isRecord(v)) return undefined;
  const { accessType, mode, fsType, mountFlags } = v;
  if ((accessType !== 'mount' && accessType !== 'block') || !isAccessMode(mode) || !str(fsType))
    return undefined;
  if (!Array.isArray(mountFlags) || !mountFlags.every(str)) return undefined;
  return { accessType, mode, fsType, mountFlags };
}

export function parseVolumeMeta(v: unknown): VolumeMeta | undefined {
  if (!isRecord(v) || v.format !== 1) return undefined;
  const caps = Array.isArray(v.capabilities) ? v.capabilities.map(parseCapability) : [];
  const source = v.contentSource;
  let contentSource: ContentSource | null = null;
  if (isRecord(source)) {
    if ((source.kind !== 'snapshot' && source.kind !== 'volume') || !str(source.id)) return undefined;
    contentSource = { kind: source.kind, id: source.id };
  }
  if (
    !str(v.id) ||
    !str(v.name) ||
    (v.state !== 'creating' && v.state !== 'ready') ||
    !num(v.capacityBytes) ||
    !isVolumeFs(v.fsType) ||
    !isAllocation(v.allocation) ||
    caps.some((c) => c === undefined) ||
    !isStringRecord(v.parameters) ||
    !isStringRecord(v.mutableParameters) ||
    !num(v.requiredBytes) ||
    !num(v.limitBytes) ||
    !isStringRecord(v.labels) ||
    !str(v.pool) ||
    !str(v.createdAt) ||
    !str(v.updatedAt)
  ) {
    return undefined;
  }
  return {
    format: 1,
    id: v.id,
    name: v.name,
    state: v.state,
    capacityBytes: v.capacityBytes,
    fsType: v.fsType,
    allocation: v.allocation,
    capabilities: caps as Capability[],
    parameters: v.parameters,
    mutableParameters: v.mutableParameters,
    requiredBytes: v.requiredBytes,
    limitBytes: v.limitBytes,
    contentSource,
    labels: v.labels,
    pool: v.pool,
    createdAt: v.createdAt,
    updatedAt: v.updatedAt,
  };
}

export function parseAttachment(v: unknown): Attachment | undefined {
  if (!isRecord(v)) return undefined;
  const { node, readonly, accessType, mode, since } = v;
  if (!str(node) || typeof readonly !== 'boolean' || (accessType !== 'mount' && accessType !== 'block'))
    return undefined;
  if (!isAccessMode(mode) || !str(since)) return undefined;
  return { node, readonly, accessType, mode, since };
}

/**
 * The device a lease taken before its attach (`lease`, naming none) keeps from the node's lease before it
 * (`mine`): what that named, unless it was named in another boot, where the name means nothing now (a
 * lease of an older release says no boot: its name is kept, as namedLoop reads it).
 */
export function keptDevice(lease: Lease, mine: Lease | undefined): Pick<Lease, 'device' | 'deviceSeq'> {
  const from = lease.device !== undefined ? lease : mine;
  const otherBoot = from !== lease && from?.bootId !== undefined && from.bootId !== lease.bootId;
  if (!from?.device || otherBoot) return {};
  return { device: from.device, ...(from.deviceSeq ? { deviceSeq: from.deviceSeq } : {}) };
}

/** Whether two leases name the same attachment: the device's name, and its disk sequence number. */
export const sameDevice = (a: Lease, b: Lease): boolean =>
  a.device === b.device && a.deviceSeq === b.deviceSeq;

export function parseLease(v: unknown): Lease | undefined {
  if (!isRecord(v)) return undefined;
  const { node, stagingPath, accessType, mode, readonly, since, device, bootId, revokedAt, fencedAt } = v;
  const { mountFlags, deviceSeq } = v;
  if (!str(node) || !str(stagingPath) || (accessType !== 'mount' && accessType !== 'block')) return undefined;
  if (!isAccessMode(mode) || typeof readonly !== 'boolean' || !str(since)) return undefined;
  if (device !== undefined && !(str(device) && /^loop\d+$/.test(device))) return undefined;
  if (deviceSeq !== undefined && !(str(deviceSeq) && /^\d+$/.test(deviceSeq))) return undefined;
  if (bootId !== undefined && !str(bootId)) return undefined;
  if ((revokedAt !== undefined && !str(revokedAt)) || (fencedAt !== undefined && !str(fencedAt)))
    return undefined;
  if (mountFlags !== undefined && !(Array.isArray(mountFlags) && mountFlags.every(str))) return undefined;
  return {
    node,
    stagingPath,
    accessType,
    mode,
    readonly,
    since,
    ...(device === undefined ? {} : { device }),
    ...(device === undefined || deviceSeq === undefined ? {} : { deviceSeq }),
    ...(bootId === undefined ? {} : { bootId }),
    ...(revokedAt === undefined ? {} : { revokedAt }),
    ...(fencedAt === undefined ? {} : { fencedAt }),
    ...(mountFlags === undefined ? {} : { mountFlags }),
  };
}

export function parseSnapshotMeta(v: unknown): SnapshotMeta | undefined {
  if (!isRecord(v) || v.format !== 1) return undefined;
  if (
    !str(v.id) ||
    !str(v.name) ||
    (v.state !== 'creating' && v.state !== 'ready') ||
    !str(v.sourceVolumeId) ||
    !num(v.sizeBytes) ||
    !isVolumeFs(v.fsType) ||
    typeof v.initialized !== 'boolean' ||
    (v.sectorSize !== undefined && !isSectorSize(v.sectorSize)) ||
    !isStringRecord(v.parameters) ||
    !str(v.groupSnapshotId) ||
    !str(v.createdAt)
  ) {
    return undefined;
  }
  return {
    format: 1,
    id: v.id,
    name: v.name,
    state: v.state,
    sourceVolumeId: v.sourceVolumeId,
    sizeBytes: v.sizeBytes,
    fsType: v.fsType,
    initialized: v.initialized,
    ...(isSectorSize(v.sectorSize) ? { sectorSize: v.sectorSize } : {}),
    parameters: v.parameters,
    groupSnapshotId: v.groupSnapshotId,
    createdAt: v.createdAt,
  };
}

export function parseGroupSnapshotMeta(v: unknown): GroupSnapshotMeta | undefined {
  if (!isRecord(v) || v.format !== 1) return undefined;
  const { id, name, state, sourceVolumeIds, snapshotIds, parameters, createdAt } = v;
  if (!str(id) || !str(name) || (state !== 'creating' && state !== 'ready')) return undefined;
  if (!Array.isArray(sourceVolumeIds) || !sourceVolumeIds.every(str)) return undefined;
  if (!Array.isArray(snapshotIds) || !snapshotIds.every(str)) return undefined;
  if (!isStringRecord(parameters) || !str(createdAt)) return undefined;
  return { format: 1, id, name, state, sourceVolumeIds, snapshotIds, parameters, createdAt };
}

export function parseNodeRecord(v: unknown): NodeRecord | undefined {
  if (!isRecord(v)) return undefined;
  const { node, pool, maxVolumes, host, registeredAt } = v;
  if (!str(node) || !str(pool) || !num(maxVolumes) || !str(host) || !str(registeredAt)) return undefined;
  return { node, pool, maxVolumes, host, registeredAt };
}

/** Readers of the pool's volume and snapshot records: the stores, for what looks over the whole pool. */
export interface RecordReaders {
  volumes: { inspect: (id: string) => Promise<RecordRead<VolumeMeta>> };
  snapshots: { inspect: (id: string) => Promise<RecordRead<SnapshotMeta>> };
}
