/** The calls tests make over and over: create (and publish) a volume, stage and publish it as a kubelet would. */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Volume__Output } from '../../src/gen/csi/v1/Volume.js';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import type { DriverProcess } from './driver.js';

export interface Made {
  id: string;
  image: string;
  volume: Volume__Output | null;
}

/** Creates a volume of `bytes` through `c` and, unless `node` is null, publishes it to that node. */
export async function createVolume(
  c: DriverProcess,
  name: string,
  cap: VolumeCapability,
  bytes: number,
  node: string | null = 'node-1',
): Promise<Made> {
  const res = await c.clients.controller.CreateVolume({
    name,
    capacity_range: { required_bytes: String(bytes) },
    volume_capabilities: [cap],
  });
  const id = res.volume?.volume_id ?? '';
  if (node !== null) {
    await c.clients.controller.ControllerPublishVolume({
      volume_id: id,
      node_id: node,
      volume_capability: cap,
    });
  }
  return { id, image: path.join(c.poolDir, 'volumes', id, 'disk.img'), volume: res.volume };
}

/** ControllerPublishVolume of `id` to each of `nodes` (read-only when `readonly`). */
export async function publishTo(
  c: DriverProcess,
  id: string,
  nodes: readonly string[],
  cap: VolumeCapability,
  readonly = false,
): Promise<void> {
  for (const node_id of nodes)
    await c.clients.controller.ControllerPublishVolume({
      volume_id: id,
      node_id,
      volume_capability: cap,
      readonly,
    });
}

/** NodeStageVolume at `staging` (made first, as the kubelet does). */
export async function stage(n: DriverProcess, id: string, staging: string, cap: VolumeCapability) {
  await fs.mkdir(staging, { recursive: true });
  return n.clients.node.NodeStageVolume({
    volume_id: id,
    staging_target_path: staging,
    volume_capability: cap,
  });
}

/** NodePublishVolume at `target` (its parent made first, as the kubelet does). */
export async function publish(
  n: DriverProcess,
  id: string,
  staging: string,
  target: string,
  cap: VolumeCapability,
  readonly = false,
) {
  await fs.mkdir(path.dirname(target), { recursive: true });
  return n.clients.node.NodePublishVolume({
    volume_id: id,
    staging_target_path: staging,
    target_path: target,
    volume_capability: cap,
    readonly,
  });
}

/** NodeUnpublishVolume then NodeUnstageVolume. */
export async function teardown(n: DriverProcess, id: string, staging: string, target: string): Promise<void> {
  await n.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
  await n.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
}
