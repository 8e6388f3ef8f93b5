/**
 * The pool in numbers, for the controller's metrics: volumes and snapshots by state, the bytes their
 * images promise (provisioned) and occupy (allocated), and each volume's allocated bytes with the PVC
 * it was made for.
 */
import type { Logger } from 'pino';
import type { Pool } from '../pool/pool.js';
import { pvcOf, readSnapshots, readVolumes, stateOf, storesFor } from './inventory.js';

export interface VolumeBytes {
  id: string;
  pvcNamespace: string;
  pvcName: string;
  allocatedBytes: number;
}

export interface PoolStats {
  volumes: Map<string, number>;
  snapshots: Map<string, number>;
  provisionedBytes: { volume: number; snapshot: number };
  allocatedBytes: { volume: number; snapshot: number };
  perVolume: VolumeBytes[];
}

export async function poolStats(pool: Pool, log: Logger): Promise<PoolStats> {
  const stores = storesFor(pool, log);
  const volumes = await readVolumes(pool, stores.volumes, false);
  const snapshots = await readSnapshots(pool, stores.snapshots);
  const out: PoolStats = {
    volumes: new Map(),
    snapshots: new Map(),
    provisionedBytes: { volume: 0, snapshot: 0 },
    allocatedBytes: { volume: 0, snapshot: 0 },
    perVolume: [],
  };
  for (const v of volumes) {
    const state = stateOf(v.record, v.image !== undefined);
    out.volumes.set(state, (out.volumes.get(state) ?? 0) + 1);
    out.provisionedBytes.volume += v.image?.sizeBytes ?? 0;
    out.allocatedBytes.volume += v.image?.allocatedBytes ?? 0;
    if (v.record.state === 'ok' && v.image) {
      const pvc = pvcOf(v.record.value);
      out.perVolume.push({
        id: v.id,
        pvcNamespace: pvc.namespace,
        pvcName: pvc.name,
        allocatedBytes: v.image.allocatedBytes,
      });
    }
  }
  for (const s of snapshots) {
    const state = stateOf(s.record, s.image !== undefined);
    out.snapshots.set(state, (out.snapshots.get(state) ?? 0) + 1);
    out.provisionedBytes.snapshot += s.image?.sizeBytes ?? 0;
    out.allocatedBytes.snapshot += s.image?.allocatedBytes ?? 0;
  }
  return out;
}
