/**
 * A controller's world for tests of the controller's copies (snapshots, clones, group snapshots) racing
 * other work on their sources: a real pool in a temp directory and the real command runner (cp, blkid,
 * fallocate on files there), the methods called in-process without gRPC, so a test can hold a source's
 * pool lock, or stand in for a node answering freeze requests, at the moment it chooses.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { ControllerDeps } from '../../src/csi/controller.js';
import { createVolumeMethod } from '../../src/csi/create-volume.js';
import { groupService } from '../../src/csi/group.js';
import { snapshotMethods } from '../../src/csi/snapshots.js';
import { ExecRunner } from '../../src/exec/runner.js';
import type { CreateVolumeResponse } from '../../src/gen/csi/v1/CreateVolumeResponse.js';
import type { CreateSnapshotResponse } from '../../src/gen/csi/v1/CreateSnapshotResponse.js';
import type { CreateVolumeGroupSnapshotResponse } from '../../src/gen/csi/v1/CreateVolumeGroupSnapshotResponse.js';
import type { VolumeCapability__Output } from '../../src/gen/csi/v1/VolumeCapability.js';
import type { VolumeContentSource__Output } from '../../src/gen/csi/v1/VolumeContentSource.js';
import { Capacity } from '../../src/pool/capacity.js';
import type { LockOptions } from '../../src/pool/lock.js';
import { NodeRegistry } from '../../src/pool/nodes.js';
import { Pool } from '../../src/pool/pool.js';
import { QuiesceBoard } from '../../src/pool/quiesce.js';
import { SnapshotStore } from '../../src/pool/snapshots.js';
import type { Lease } from '../../src/pool/types.js';
import { VolumeStore } from '../../src/pool/volumes.js';
import type { CallContext } from '../../src/server/call.js';
import { log, MiB } from './node-world.js';

const dirs: string[] = [];
/** Removes every world's pool directory (call it from afterAll). */
export async function removeControllerWorlds(): Promise<void> {
  for (const d of dirs.splice(0)) await fs.rm(d, { recursive: true, force: true });
}

export const blockCapability: VolumeCapability__Output = {
  access_type: 'block',
  block: {},
  access_mode: { mode: 'SINGLE_NODE_WRITER' },
};
export const mountCapability = (fsType = 'ext4'): VolumeCapability__Output => ({
  access_type: 'mount',
  mount: { fs_type: fsType, mount_flags: [], volume_mount_group: '' },
  access_mode: { mode: 'SINGLE_NODE_WRITER' },
});

export interface VolumeAsk {
  bytes?: number;
  caps?: VolumeCapability__Output[];
  parameters?: Record<string, string>;
  source?: VolumeContentSource__Output;
}

/** A lease as a node's NodeStageVolume records it: the volume staged for writing on `node`. */
export const writerLease = (node: string, accessType: 'mount' | 'block' = 'mount'): Lease => ({
  node,
  stagingPath: '/var/lib/kubelet/plugins/kubernetes.io/csi/loopvol.csi.io/pv/globalmount',
  accessType,
  mode: 'SINGLE_NODE_WRITER',
  readonly: false,
  since: new Date().toISOString(),
});

/**
 * A controller on a new pool in a temporary directory under `under` (default: the system's), which
 * promises up to `overcommitRatio` times its free space (default 100: tests that do not look at space).
 * `dir`: a second controller on another world's pool instead; `lock`: its lock lease and renewals.
 */
export async function controllerWorld({
  under = os.tmpdir(),
  overcommitRatio = 100,
  dir: shared = undefined as string | undefined,
  lock = undefined as LockOptions | undefined,
} = {}) {
  const dir = shared ?? (await fs.mkdtemp(path.join(under, 'loopvol-controller-')));
  if (!shared) dirs.push(dir);
  const pool = await Pool.open(dir, 'test', log, lock ? { lock } : {});
  const nodes = new NodeRegistry(pool.layout);
  const capacity = Capacity.of(pool, overcommitRatio);
  const volumes = new VolumeStore(pool, capacity, nodes, log);
  const snapshots = new SnapshotStore(pool, log);
  const d: ControllerDeps = {
    config: { poolName: 'test', defaultVolumeSize: 64 * MiB },
    pool,
    volumes,
    snapshots,
    nodes,
    capacity,
    board: new QuiesceBoard(pool),
    freezeBudgetMs: 10_000,
    freezeWaitMs: 2_000,
    requester: 'test',
  };
  const runner = new ExecRunner();
  const ctx = (method: string): CallContext => {
    const c: CallContext = {
      reqId: 'test',
      method,
      log,
      signal: new AbortController().signal,
      deadline: Number.POSITIVE_INFINITY,
      runner,
      run: (command, args, options) => runner.run(c, command, args, options),
    };
    return c;
  };
  const createVolume = createVolumeMethod(d);
  const snaps = snapshotMethods(d);
  const groups = groupService(d);
  const must = <T>(m: T | undefined): T => {
    if (!m) throw new Error('the method is missing');
    return m;
  };
  return {
    dir,
    d,
    pool,
    volumes,
    snapshots,
    ctx,
    CreateVolume: (name: string, ask: VolumeAsk = {}): Promise<CreateVolumeResponse> =>
      createVolume
        .prepare({
          name,
          capacity_range: { required_bytes: String(ask.bytes ?? 64 * MiB), limit_bytes: '0' },
          volume_capabilities: ask.caps ?? [blockCapability],
          parameters: ask.parameters ?? {},
          mutable_parameters: {},
          secrets: {},
          volume_content_source: ask.source ?? null,
          accessibility_requirements: null,
        })
        .run(ctx('CreateVolume')),
    CreateSnapshot: (name: string, sourceVolumeId: string): Promise<CreateSnapshotResponse> =>
      must(snaps.CreateSnapshot)
        .prepare({ name, source_volume_id: sourceVolumeId, parameters: {}, secrets: {} })
        .run(ctx('CreateSnapshot')),
    DeleteSnapshot: (snapshotId: string): Promise<unknown> =>
      must(snaps.DeleteSnapshot).prepare({ snapshot_id: snapshotId, secrets: {} }).run(ctx('DeleteSnapshot')),
    CreateVolumeGroupSnapshot: (
      name: string,
      sourceVolumeIds: string[],
      parameters: Record<string, string> = {},
    ): Promise<CreateVolumeGroupSnapshotResponse> =>
      must(groups.CreateVolumeGroupSnapshot)
        .prepare({ name, source_volume_ids: sourceVolumeIds, parameters, secrets: {} })
        .run(ctx('CreateVolumeGroupSnapshot')),
  };
}

export type ControllerWorld = Awaited<ReturnType<typeof controllerWorld>>;

/** The id of the volume a CreateVolume made. */
export const volumeIdOf = (res: CreateVolumeResponse): string => {
  const id = res.volume?.volume_id;
  if (!id) throw new Error('CreateVolume returned no volume');
  return id;
};

/** A content source naming volume `id` (a clone). */
export const fromVolume = (id: string): VolumeContentSource__Output => ({
  type: 'volume',
  volume: { volume_id: id },
  snapshot: null,
});

/** A content source naming snapshot `id` (a restore). */
export const fromSnapshot = (id: string): VolumeContentSource__Output => ({
  type: 'snapshot',
  snapshot: { snapshot_id: id },
  volume: null,
});
