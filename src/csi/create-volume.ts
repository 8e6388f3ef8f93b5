/**
 * CreateVolume: a new image (sparse, or preallocated), or a copy of a snapshot or of another volume,
 * idempotent by name and crash-safe (see pool/volumes.ts). Sizes: the request rounded up to a MiB, at
 * least the filesystem's minimum and the source's size, within the limit, or OUT_OF_RANGE.
 */
import { alreadyExists, busy, invalidArgument, notFound, outOfRange, resourceExhausted } from '../errors.js';
import type { VolumeContentSource__Output } from '../gen/csi/v1/VolumeContentSource.js';
import { formatBytes } from '../pool/capacity.js';
import { isSnapshotId, isVolumeId, volumeIdForName } from '../pool/ids.js';
import {
  allocatedBytes,
  copyImage,
  createSparseImage,
  growImage,
  ownBlocks,
  preallocate,
} from '../pool/images.js';
import type { Exec } from '../exec/runner.js';
import { probeDevice } from '../host/filesystem.js';
import {
  type Capability,
  type ContentSource,
  FS_TYPES,
  type FsType,
  isFsType,
  type SnapshotMeta,
  type VolumeFs,
  type VolumeMeta,
} from '../pool/types.js';
import type { FillResult } from '../pool/volumes.js';
import { pausepoint } from '../failpoints.js';
import type { HeldLock } from '../pool/lock.js';
import { method, type Method } from '../server/call.js';
import type { CreateVolumeRequest__Output } from '../gen/csi/v1/CreateVolumeRequest.js';
import type { CreateVolumeResponse } from '../gen/csi/v1/CreateVolumeResponse.js';
import { withConsistentSources } from './consistency.js';
import type { ControllerDeps } from './controller.js';
import { volumeMessage } from './messages.js';
import { parseMutableParameters, parseVolumeParameters } from './parameters.js';
import {
  MIN_BYTES,
  parseCapabilities,
  parseRange,
  type Range,
  requireField,
  floorMiB,
  roundUpMiB,
  topologyAdmits,
  TOPOLOGY_KEY,
} from './validate.js';

/** The filesystem the capabilities ask for, if they ask; conflicting asks are INVALID_ARGUMENT. */
export function requestedFsType(caps: readonly Capability[], param: FsType | undefined): FsType | undefined {
  const asked = new Set<string>(
    caps.filter((c) => c.accessType === 'mount' && c.fsType !== '').map((c) => c.fsType),
  );
  if (param) asked.add(param);
  if (asked.size > 1)
    throw invalidArgument(`The request asks for several filesystems (${[...asked].join(', ')}); choose one.`);
  const [only] = [...asked];
  return only as FsType | undefined;
}

function parseContentSource(src: VolumeContentSource__Output | null): ContentSource | null {
  if (!src) return null;
  if (src.type === 'snapshot' || src.snapshot) {
    return {
      kind: 'snapshot',
      id: requireField(src.snapshot?.snapshot_id ?? '', 'volume_content_source.snapshot.snapshot_id'),
    };
  }
  if (src.type === 'volume' || src.volume) {
    return {
      kind: 'volume',
      id: requireField(src.volume?.volume_id ?? '', 'volume_content_source.volume.volume_id'),
    };
  }
  throw invalidArgument('volume_content_source names neither a snapshot nor a volume.');
}

export function sameStrings(a: Record<string, string>, b: Record<string, string>): boolean {
  const ka = Object.keys(a).sort();
  const kb = Object.keys(b).sort();
  return ka.length === kb.length && ka.every((k, i) => k === kb[i] && a[k] === b[k]);
}

/**
 * The size to make: required rounded up to a MiB, at least the filesystem's minimum and the source's
 * size; with no range, the default (or the source's size). OUT_OF_RANGE when no size fits.
 */
export function chooseSize(
  range: Range,
  minBytes: number,
  defaultBytes: number,
  sourceBytes: number | undefined,
): number {
  const { requiredBytes, limitBytes } = range;
  if (sourceBytes !== undefined && requiredBytes > 0 && requiredBytes < sourceBytes) {
    throw outOfRange(
      `The source is ${formatBytes(sourceBytes)}; a volume made from it cannot be smaller (asked for ${formatBytes(requiredBytes)}).`,
    );
  }
  if (sourceBytes !== undefined && limitBytes > 0 && limitBytes < sourceBytes) {
    throw outOfRange(
      `The source is ${formatBytes(sourceBytes)}, more than limit_bytes (${formatBytes(limitBytes)}).`,
    );
  }
  // Requests round up to a whole MiB, limits down: the size made is never below one nor above the other.
  const limit = limitBytes > 0 ? floorMiB(limitBytes) : Number.POSITIVE_INFINITY;
  let want: number;
  if (requiredBytes > 0) want = requiredBytes;
  else if (sourceBytes !== undefined) want = sourceBytes;
  else want = Math.min(defaultBytes, limit);
  const size = roundUpMiB(Math.max(want, minBytes, sourceBytes ?? 0));
  if (size > limit) {
    throw outOfRange(
      size === roundUpMiB(minBytes) && minBytes > want
        ? `This filesystem needs at least ${formatBytes(minBytes)}, more than limit_bytes (${formatBytes(limitBytes)}).`
        : `No whole number of MiB lies between ${formatBytes(requiredBytes)} and ${formatBytes(limitBytes)}.`,
    );
  }
  return size;
}

/** The filesystem an image file holds (blkid -p reads files too), or 'none'. */
async function imageHolds(x: Exec, image: string): Promise<VolumeFs> {
  const content = await probeDevice(x, image);
  return content.kind === 'filesystem' && isFsType(content.type) ? content.type : 'none';
}

export function createVolumeMethod(
  d: ControllerDeps,
): Method<CreateVolumeRequest__Output, CreateVolumeResponse> {
  const { volumes, snapshots } = d;
  const poolName = d.config.poolName;
  return method({
    validate: (req) => {
      const name = requireField(req.name, 'name');
      const caps = parseCapabilities(req.volume_capabilities, 'volume_capabilities');
      const range = parseRange(req.capacity_range);
      const params = parseVolumeParameters(req.parameters);
      const mutable = parseMutableParameters(req.mutable_parameters);
      const source = parseContentSource(req.volume_content_source);
      const fsType = requestedFsType(caps, params.fsType);
      return {
        req,
        name,
        id: volumeIdForName(name),
        caps,
        range,
        params,
        fsType,
        allocation: mutable.allocation ?? params.allocation ?? 'sparse',
        source,
      };
    },
    locks: (v) => [v.id, ...(v.source ? [v.source.id] : [])],
    run: async (v, ctx) => {
      if (!topologyAdmits(v.req.accessibility_requirements, poolName)) {
        throw resourceExhausted(
          `This driver provisions in ${TOPOLOGY_KEY}=${poolName}, which the accessibility requirements exclude.`,
        );
      }
      const compatible = (existing: VolumeMeta): string | undefined => {
        if (existing.name !== v.name) return 'a different name hashes to the same id';
        if (v.range.requiredBytes > 0 && existing.capacityBytes < v.range.requiredBytes)
          return `its size is ${formatBytes(existing.capacityBytes)}`;
        if (v.range.limitBytes > 0 && existing.capacityBytes > v.range.limitBytes)
          return `its size is ${formatBytes(existing.capacityBytes)}`;
        if (!sameStrings(existing.parameters, v.req.parameters))
          return 'it was created with other parameters';
        if (!sameStrings(existing.mutableParameters, v.req.mutable_parameters))
          return 'it was created with other mutable parameters';
        if (existing.contentSource?.kind !== v.source?.kind || existing.contentSource?.id !== v.source?.id)
          return 'it has another content source';
        if (v.fsType && v.fsType !== existing.fsType) return `it was created for ${existing.fsType}`;
        return undefined;
      };
      const respond = (meta: VolumeMeta) => ({ volume: volumeMessage(meta, poolName, d.pool.id) });

      // A retry finds the volume it made, whatever became of its source since (expanded, written to,
      // its snapshot deleted): judged by the request alone. A damaged record is not "existing":
      // volumes.create quarantines it and says where it went.
      const found = await volumes.inspect(v.id);
      const existing = found.state === 'ok' && found.value.state === 'ready' ? found.value : undefined;
      if (existing) {
        const why = compatible(existing);
        if (why) throw alreadyExists(`A volume named ${JSON.stringify(v.name)} already exists, but ${why}.`);
        return respond(existing);
      }

      // Resolve the content source (NOT_FOUND when absent). A source volume is read again under its lock,
      // before it is copied: what is decided here from it must still hold then.
      let sourceBytes: number | undefined;
      let sourceImage: string | undefined;
      let sourceInitialized = false;
      let sourceSnapshot: SnapshotMeta | undefined;
      if (v.source?.kind === 'snapshot') {
        sourceSnapshot = isSnapshotId(v.source.id) ? await snapshots.get(v.source.id) : undefined;
        if (!sourceSnapshot) throw notFound(`Snapshot ${v.source.id} does not exist.`);
        sourceBytes = sourceSnapshot.sizeBytes;
        sourceImage = snapshots.imagePath(sourceSnapshot.id);
        sourceInitialized = sourceSnapshot.initialized;
      } else if (v.source?.kind === 'volume') {
        const src = isVolumeId(v.source.id) ? await volumes.get(v.source.id) : undefined;
        if (!src) throw notFound(`Volume ${v.source.id} does not exist.`);
        sourceBytes = src.capacityBytes;
        sourceImage = volumes.imagePath(src.id);
        sourceInitialized = await volumes.isInitialized(src.id);
      }
      const needsFs = v.caps.some((c) => c.accessType === 'mount');
      // What the source holds, from the image itself (a raw block volume's pod may have made any
      // filesystem of it, or none): never from a label.
      const sourceFs = sourceImage && sourceInitialized ? await imageHolds(ctx, sourceImage) : undefined;
      if (sourceFs === 'none' && needsFs) {
        throw invalidArgument(
          `The source holds no ${FS_TYPES.join(', ')} filesystem (raw block data); restore it as a block volume.`,
        );
      }
      if (v.fsType && sourceFs && v.fsType !== sourceFs) {
        throw invalidArgument(`The source holds ${sourceFs}, but ${v.fsType} was asked for.`);
      }
      const fsType: VolumeFs = sourceFs ?? v.fsType ?? (needsFs ? 'ext4' : 'none');
      const size = chooseSize(
        v.range,
        needsFs && fsType !== 'none' ? MIN_BYTES[fsType] : MIN_BYTES.block,
        d.config.defaultVolumeSize,
        sourceBytes,
      );
      const largest = await d.pool.fs.maxFileSize();
      if (size > largest) {
        throw outOfRange(
          `The pool's filesystem holds files of at most ${formatBytes(largest)}; a volume of ${formatBytes(size)} cannot be made there.`,
        );
      }

      const now = new Date().toISOString();
      const meta: VolumeMeta = {
        format: 1,
        id: v.id,
        name: v.name,
        state: 'creating',
        capacityBytes: size,
        fsType,
        allocation: v.allocation,
        capabilities: v.caps,
        parameters: v.req.parameters,
        mutableParameters: v.req.mutable_parameters,
        requiredBytes: v.range.requiredBytes,
        limitBytes: v.range.limitBytes,
        contentSource: v.source,
        labels: v.params.labels,
        pool: poolName,
        createdAt: now,
        updatedAt: now,
      };
      const preallocated = v.allocation === 'preallocate';
      const fill = async (image: string, lock: HeldLock): Promise<FillResult> => {
        // Its blocks are shared with its source (a reflink); the sector size the source's data was written on.
        const copied: { shared: boolean; sectorSize?: number } = {
          shared: false,
          sectorSize: sourceSnapshot?.sectorSize,
        };
        if (v.source?.kind === 'snapshot' && sourceSnapshot) {
          // Held while it is read: a DeleteSnapshot meanwhile waits (or is ABORTED), never tears the copy.
          const decided = sourceSnapshot;
          await snapshots.holding(decided.id, 'restore', async (held, lock) => {
            // The snapshot read before its lock is the one copied: not one deleted and made again under
            // the same name (by another controller) meanwhile, whose size and content were not decided on.
            if (held.createdAt !== decided.createdAt || held.sourceVolumeId !== decided.sourceVolumeId) {
              throw busy(
                `Snapshot ${decided.id} was replaced while this restore of it waited for it; retry.`,
              );
            }
            const res = await copyImage(ctx, snapshots.imagePath(v.source?.id ?? ''), image, {
              allowCopy: true,
              signal: lock.signal,
              purpose: 'restore',
            });
            ctx.log.info({ snapshot: v.source?.id, how: res.method }, 'restored snapshot image');
            copied.shared = res.method === 'reflink';
          });
        } else if (v.source?.kind === 'volume') {
          const id = v.source.id;
          await withConsistentSources(ctx, d, [id], async (plan) => {
            // A first NodeStageVolume (or an expansion) while this waited for the lock changes what the
            // copy holds: the size, filesystem and "initialized" chosen above would no longer fit it.
            const held = plan.source(id);
            const heldFs = held.initialized ? await imageHolds(ctx, volumes.imagePath(id)) : undefined;
            if (
              held.meta.capacityBytes !== sourceBytes ||
              held.initialized !== sourceInitialized ||
              heldFs !== sourceFs
            ) {
              throw busy(
                `Volume ${id} was staged, written or expanded while this clone of it waited for it; retry.`,
              );
            }
            copied.shared = (await plan.copy(id, image)).method === 'reflink';
            copied.sectorSize = held.sectorSize;
          });
        } else {
          await createSparseImage(image, size);
        }
        // A preallocated volume owns its blocks: a reflinked copy's are shared with its source until
        // written, so they are made its own (outside the source's lock and freeze) before the rest is reserved.
        if (preallocated && copied.shared) await ownBlocks(ctx, image, lock);
        // A sparse one keeps sharing them: each may need a block of its own when it is rewritten.
        const sharedBytes = copied.shared && !preallocated ? await allocatedBytes(image) : undefined;
        await pausepoint('create-volume:filled');
        // A process that lost the lock meanwhile (stalled past its lease) must not set the length of
        // what is now another's image: the lock is checked, by the clock too, right before.
        await growImage(ctx, image, size, false, lock);
        if (preallocated) await preallocate(ctx, image, 0, size, lock);
        return {
          initialized: sourceInitialized,
          sectorSize: copied.sectorSize,
          ...(sharedBytes ? { sharedBytes } : {}),
        };
      };
      const { volume, created } = await volumes.create(meta, fill);
      if (!created) {
        const why = compatible(volume);
        if (why) throw alreadyExists(`A volume named ${JSON.stringify(v.name)} already exists, but ${why}.`);
      } else {
        ctx.log.info(
          { volumeId: v.id, size, fsType, allocation: v.allocation, source: v.source },
          'created volume',
        );
      }
      return respond(volume);
    },
  });
}
