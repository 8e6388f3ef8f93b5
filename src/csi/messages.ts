/** Pool records → CSI response messages. */
import type { Timestamp } from '../gen/google/protobuf/Timestamp.js';
import type { Snapshot } from '../gen/csi/v1/Snapshot.js';
import type { Volume } from '../gen/csi/v1/Volume.js';
import type { VolumeContentSource } from '../gen/csi/v1/VolumeContentSource.js';
import type { SnapshotMeta, VolumeMeta } from '../pool/types.js';
import { TOPOLOGY_KEY } from './validate.js';

export function timestamp(iso: string): Timestamp {
  const ms = Date.parse(iso);
  const safe = Number.isFinite(ms) ? ms : 0;
  return { seconds: String(Math.floor(safe / 1000)), nanos: (safe % 1000) * 1_000_000 };
}

export function contentSourceMessage(meta: VolumeMeta): VolumeContentSource | null {
  if (!meta.contentSource) return null;
  return meta.contentSource.kind === 'snapshot'
    ? { snapshot: { snapshot_id: meta.contentSource.id } }
    : { volume: { volume_id: meta.contentSource.id } };
}

export function volumeMessage(meta: VolumeMeta, poolName: string, poolId: string): Volume {
  return {
    volume_id: meta.id,
    capacity_bytes: String(meta.capacityBytes),
    volume_context: {
      ...(meta.fsType === 'none' ? {} : { 'loopvol.csi.io/fstype': meta.fsType }),
      'loopvol.csi.io/pool-id': poolId,
    },
    content_source: contentSourceMessage(meta),
    accessible_topology: [{ segments: { [TOPOLOGY_KEY]: poolName } }],
  };
}

export function snapshotMessage(meta: SnapshotMeta): Snapshot {
  return {
    snapshot_id: meta.id,
    source_volume_id: meta.sourceVolumeId,
    size_bytes: String(meta.sizeBytes),
    creation_time: timestamp(meta.createdAt),
    ready_to_use: meta.state === 'ready',
    group_snapshot_id: meta.groupSnapshotId,
  };
}
