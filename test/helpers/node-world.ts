/**
 * A node's world for unit tests of the node algorithms (src/node/): an in-memory kernel (FakeHost)
 * and a real pool in a temp directory, with a volume made the way CreateVolume makes one and the node
 * flows bound to fixed kubelet paths.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { pino } from 'pino';
import { bindExec, type Exec, type Runner } from '../../src/exec/runner.js';
import type { NodeDeps } from '../../src/node/on-host.js';
import { publishVolume, unpublishVolume } from '../../src/node/publish.js';
import { stageVolume } from '../../src/node/stage.js';
import { unstageVolume } from '../../src/node/unstage.js';
import { Capacity } from '../../src/pool/capacity.js';
import { volumeIdForName } from '../../src/pool/ids.js';
import { createSparseImage } from '../../src/pool/images.js';
import type { LockOptions } from '../../src/pool/lock.js';
import { NodeRegistry } from '../../src/pool/nodes.js';
import { Pool } from '../../src/pool/pool.js';
import type { Capability, FsType, VolumeMeta } from '../../src/pool/types.js';
import { VolumeStore } from '../../src/pool/volumes.js';
import { codeName, toStatus } from '../../src/server/status.js';
import { FakeHost } from './fake-host.js';

export const MiB = 2 ** 20;
export const SIZE = 64 * MiB;
export const NODE = 'node-a';
export const STAGING = '/var/lib/kubelet/plugins/kubernetes.io/csi/loopvol.csi.io/pv-1/globalmount';
export const TARGET = '/var/lib/kubelet/pods/pod-1/volumes/kubernetes.io~csi/pv-1/mount';
export const log = pino({ level: 'silent' });

const dirs: string[] = [];
/** Removes every world's pool directory (call it from afterAll). */
export async function removeWorlds(): Promise<void> {
  for (const d of dirs.splice(0)) await fs.rm(d, { recursive: true, force: true });
}

/** The node algorithms reach the kernel only through the Host: a command of their own is a bug. */
export const noCommands: Runner = {
  run: (_scope, command, args) =>
    Promise.reject(new Error(`ran ${command} ${args.join(' ')} behind the Host's back`)),
};

export interface World {
  host: FakeHost;
  d: NodeDeps;
  x: Exec;
  volumes: VolumeStore;
  pool: Pool;
  root: string;
}

/** `lock`: how the pool's cross-process locks behave (renewed every `heartbeatMs`, for a lost lock). */
export async function world(opts: { lock?: LockOptions } = {}): Promise<World> {
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-node-flow-'));
  dirs.push(dir);
  const pool = await Pool.open(dir, 'test', log, opts.lock ? { lock: opts.lock } : {});
  const nodes = new NodeRegistry(pool.layout);
  const volumes = new VolumeStore(pool, new Capacity(pool.layout, 100), nodes, log);
  const host = new FakeHost();
  // The CO makes the staging directory and the target's parent (CSI spec); the target is the driver's.
  host.addPath(STAGING);
  host.addPath(path.dirname(TARGET));
  const d: NodeDeps = {
    nodeId: NODE,
    poolName: 'test',
    poolId: pool.id,
    bootId: 'test-boot',
    maxVolumesPerNode: 8,
    loopDirectIo: false,
    volumes,
    nodes,
    host,
    poolRoot: pool.root,
  };
  return { host, d, x: bindExec(noCommands, { log, deadline: Infinity }), volumes, pool, root: pool.root };
}

/** Node `nodeId` on another machine (its own kernel and boot id) that shares `w`'s pool. */
export function anotherHost(w: World, nodeId: string): World {
  const host = new FakeHost();
  host.addPath(STAGING);
  host.addPath(path.dirname(TARGET));
  return { ...w, host, d: { ...w.d, host, nodeId, bootId: `boot-of-${nodeId}` } };
}

/** ControllerPublishVolume of `id` to `node` (mount, single-node writer), as the controller records it. */
export const attachTo = (w: World, id: string, node = NODE) =>
  w.volumes.publish(
    id,
    { node, readonly: false, accessType: 'mount', mode: 'SINGLE_NODE_WRITER', since: 'x' },
    8,
  );

/**
 * A volume staged and published on node-c (another host), force-detached from it (its revoked lease
 * stays until node-c unstages, which a dead node never does), then published to NODE, whose kernel reads
 * the bytes node-c's left. Kubelet's staging path is the same on both hosts.
 */
export async function takenFromAnotherHost(): Promise<{ w: World; c: World; id: string }> {
  const w = await world();
  const { id, image } = await newVolume(w);
  const c = anotherHost(w, 'node-c');
  await stage(c, id);
  await publish(c, id);
  await c.d.nodes.heartbeat('node-c');
  await w.volumes.unpublish(id, 'node-c');
  await attachTo(w, id);
  w.host.content.set(image, must(c.host.content.get(image), 'the image as node-c left it'));
  return { w, c, id };
}

export const cap = (over: Partial<Capability> = {}): Capability => ({
  accessType: 'mount',
  mode: 'SINGLE_NODE_WRITER',
  fsType: 'ext4',
  mountFlags: [],
  ...over,
});

/** The record CreateVolume writes first ("creating"), for a volume named `name` of SIZE bytes. */
export function volumeMeta(name: string, over: Partial<VolumeMeta> = {}): VolumeMeta {
  const now = new Date().toISOString();
  return {
    format: 1,
    id: volumeIdForName(name),
    name,
    state: 'creating',
    capacityBytes: SIZE,
    fsType: 'ext4',
    allocation: 'sparse',
    capabilities: [cap()],
    parameters: {},
    mutableParameters: {},
    requiredBytes: SIZE,
    limitBytes: 0,
    contentSource: null,
    labels: {},
    pool: 'test',
    createdAt: now,
    updatedAt: now,
    ...over,
  };
}

let volumeCount = 0;

/** A volume made the way CreateVolume makes one: a sparse image of SIZE bytes, then a "ready" record. */
export async function newVolume(
  w: World,
  opts: { fsType?: FsType; initialized?: boolean } = {},
): Promise<{ id: string; image: string }> {
  const meta = volumeMeta(`pv-${++volumeCount}`, { fsType: opts.fsType ?? 'ext4' });
  const { id } = meta;
  await w.volumes.create(meta, async (image) => {
    await createSparseImage(image, SIZE);
    return { initialized: opts.initialized ?? false };
  });
  return { id, image: w.volumes.imagePath(id) };
}

export const stage = (w: World, id: string, over: Partial<Capability> = {}, staging = STAGING) =>
  stageVolume(w.d, w.x, {
    id,
    staging,
    cap: cap(over),
    publishPool: undefined,
    poolId: undefined,
    publishedReadOnly: undefined,
  });
export const unstage = (w: World, id: string) => unstageVolume(w.d, w.x, { id, staging: STAGING });
export const publish = (
  w: World,
  id: string,
  over: Partial<Capability> = {},
  readonly = false,
  target = TARGET,
) =>
  publishVolume(w.d, w.x, {
    id,
    staging: STAGING,
    target,
    cap: cap(over),
    readonly,
    publishedReadOnly: undefined,
  });
export const unpublish = (w: World, id: string, target = TARGET) => unpublishVolume(w.d, w.x, { id, target });

/** The gRPC code a call ends with ('OK' when it succeeds). */
export const codeOf = (p: Promise<unknown>): Promise<string> =>
  p.then(
    () => 'OK',
    (err: unknown) => codeName(toStatus(err).code),
  );

/** What the host was asked to do while `p` ran, and how it ended. */
export async function during(w: World, p: () => Promise<unknown>): Promise<{ code: string; ops: string[] }> {
  const from = w.host.ops.length;
  const code = await codeOf(p());
  return { code, ops: w.host.ops.slice(from) };
}

export function must<T>(v: T | undefined, what: string): T {
  if (v === undefined) throw new Error(`${what} is missing`);
  return v;
}
