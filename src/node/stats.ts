/**
 * NodeGetVolumeStats: bytes and inodes of a published or staged volume, and its condition (the image
 * missing, the loop device gone, the filesystem turned read-only or not answering).
 */
import path from 'node:path';
import { errnoCode, missing } from '../errors.js';
import type { Exec } from '../exec/runner.js';
import type { VolumeCondition } from '../gen/csi/v1/VolumeCondition.js';
import type { VolumeUsage } from '../gen/csi/v1/VolumeUsage.js';
import { backingName } from '../host/loop.js';
import { wentReadOnly } from '../host/mounts.js';
import { IMAGE_FILE } from '../pool/layout.js';
import { isDead } from './fs-state.js';
import {
  callerPath,
  isDeviceBind,
  isBackedBy,
  isLoopMount,
  leaseView,
  loopOfMount,
  lookAtHost,
  mustGetVolume,
  type NodeDeps,
} from './on-host.js';

export interface VolumeStats {
  usage: VolumeUsage[];
  condition: VolumeCondition;
}

const abnormal = (message: string): VolumeCondition => ({ abnormal: true, message });

export async function volumeStats(
  d: NodeDeps,
  x: Exec,
  r: { id: string; volumePath: string },
): Promise<VolumeStats> {
  await mustGetVolume(d, r.id);
  const notHere = missing(`Volume ${r.id} is not published at ${r.volumePath}.`);
  if (!path.isAbsolute(r.volumePath)) throw notHere;
  const p = await callerPath(d, r.volumePath, 'volume_path');
  const kind = await d.host.pathKind(p);
  if (kind === 'absent') throw notHere;
  // A device this node's lease records at its staging path is the volume's, even when the image's
  // identity no longer shows it (the pool was mounted again here), as stage and publish take it.
  const { on } = await leaseView(d, await lookAtHost(d, x, r.id));
  const top = on.mounts.filter((m) => m.mountPoint === p).at(-1);
  const imagePresent = on.imageId !== undefined;
  if (!top) {
    return {
      usage: [],
      condition: abnormal(
        imagePresent
          ? `The volume is not mounted at ${r.volumePath}.`
          : 'The disk image is missing from the pool.',
      ),
    };
  }
  const loop = loopOfMount(top, on.loops);
  if (!loop) {
    // Not a loop device, or one of another volume's image (by the path it shows): not this volume's
    // path. One whose image was replaced or deleted under it is this volume's, abnormal.
    const device = loopOfMount(top, on.allLoops);
    const another = device && backingName(device) === IMAGE_FILE && !isBackedBy(device, r.id, undefined);
    if (!isLoopMount(top) || another) throw notHere;
    return {
      usage: [],
      condition: abnormal(
        imagePresent
          ? 'The loop device behind this path is detached or backed by another file.'
          : 'The disk image is missing from the pool.',
      ),
    };
  }
  let condition: VolumeCondition = {
    abnormal: false,
    message: 'The volume is attached, mounted and healthy.',
  };
  if (!imagePresent) condition = abnormal('The disk image is missing from the pool.');
  if (isDeviceBind(top)) return { usage: [{ unit: 'BYTES', total: String(loop.sizeBytes) }], condition };
  if (wentReadOnly(top) && !condition.abnormal) {
    condition = abnormal('The filesystem went read-only, usually after I/O or consistency errors.');
  }
  // statfs still answers for an xfs or ext4 the kernel shut down; only its files show it.
  if (!condition.abnormal && (await isDead(d, top, kind))) {
    return {
      usage: [],
      condition: abnormal(
        'The filesystem does not answer: the kernel stopped it after I/O or consistency errors.',
      ),
    };
  }
  try {
    const u = await d.host.usage(p);
    return {
      usage: [
        {
          unit: 'BYTES',
          total: String(u.totalBytes),
          available: String(u.availableBytes),
          used: String(u.usedBytes),
        },
        {
          unit: 'INODES',
          total: String(u.totalInodes),
          available: String(u.freeInodes),
          used: String(u.totalInodes - u.freeInodes),
        },
      ],
      condition,
    };
  } catch (err) {
    return {
      usage: [],
      condition: abnormal(`The filesystem does not answer (${errnoCode(err) ?? 'error'}).`),
    };
  }
}
