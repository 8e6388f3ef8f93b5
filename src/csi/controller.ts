/**
 * The CSI Controller service: volumes, attachments, capacity, snapshots and expansion, over the pool.
 * Each RPC validates the request (no side effect before that), names the in-flight keys it holds, and
 * leaves crash safety and cross-process locking to the pool stores.
 */
import fs from 'node:fs/promises';
import type { Config } from '../config.js';
import {
  aborted,
  alreadyExists,
  type CsiError,
  invalidArgument,
  notFound,
  outOfRange,
  resourceExhausted,
} from '../errors.js';
import type { ControllerHandlers } from '../gen/csi/v1/Controller.js';
import type { ControllerServiceCapability } from '../gen/csi/v1/ControllerServiceCapability.js';
import type { VolumeCondition } from '../gen/csi/v1/VolumeCondition.js';
import type { VolumeContentSource__Output } from '../gen/csi/v1/VolumeContentSource.js';
import type { Capacity } from '../pool/capacity.js';
import { formatBytes } from '../pool/capacity.js';
import { isNodeId, isSnapshotId, isVolumeId, snapshotIdForName, volumeIdForName } from '../pool/ids.js';
import { copyImage, createSparseImage, growImage, preallocate } from '../pool/images.js';
import { mapLimit } from '../limit.js';
import type { NodeRegistry } from '../pool/nodes.js';
import type { Pool } from '../pool/pool.js';
import type { SnapshotStore } from '../pool/snapshots.js';
import type { Capability, ContentSource, FsType, SnapshotMeta, VolumeMeta } from '../pool/types.js';
import type { FillResult, VolumeStore } from '../pool/volumes.js';
import type { CallContext } from '../server/call.js';
import { method, type Methods } from '../server/call.js';
import { type CopyDeps, withConsistentSources } from './consistency.js';
import { snapshotMessage, volumeMessage } from './messages.js';
import { K8S_PREFIX, parseMutableParameters, parseVolumeParameters } from './parameters.js';
import {
  describeCapability,
  MIN_BYTES,
  parseCapabilities,
  parseCapability,
  parseRange,
  type Range,
  requireField,
  roundUpMiB,
  topologyAdmits,
  TOPOLOGY_KEY,
} from './validate.js';

export interface ControllerDeps extends CopyDeps {
  config: Pick<Config, 'poolName' | 'defaultVolumeSize'>;
  pool: Pool;
  volumes: VolumeStore;
  snapshots: SnapshotStore;
  nodes: NodeRegistry;
  capacity: Capacity;
  /** Why an image is in use on this host (attached as a loop device), if it is: DeleteVolume's last guard. */
  inUseHere?: (image: string) => Promise<string | undefined>;
}

/**
 * GET_SNAPSHOT is left out on purpose although GetSnapshot is implemented: csi-sanity (v5.3.1 and
 * v5.4.0) fails any driver that advertises it as an unknown capability.
 */
export const CONTROLLER_CAPABILITIES = [
  'CREATE_DELETE_VOLUME',
  'PUBLISH_UNPUBLISH_VOLUME',
  'LIST_VOLUMES',
  'GET_CAPACITY',
  'CREATE_DELETE_SNAPSHOT',
  'LIST_SNAPSHOTS',
  'CLONE_VOLUME',
  'PUBLISH_READONLY',
  'EXPAND_VOLUME',
  'LIST_VOLUMES_PUBLISHED_NODES',
  'VOLUME_CONDITION',
  'GET_VOLUME',
  'SINGLE_NODE_MULTI_WRITER',
  'MODIFY_VOLUME',
] as const;

/** How many volumes a listing looks at in parallel. */
const LIST_CONCURRENCY = 16;

/** The filesystem the capabilities ask for, if they ask; conflicting asks are INVALID_ARGUMENT. */
function requestedFsType(caps: readonly Capability[], param: FsType | undefined): FsType | undefined {
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

/** Keys under csi.storage.k8s.io/ that the snapshotter adds; nothing else is a known snapshot parameter. */
export function parseSnapshotParameters(params: Record<string, string>): Record<string, string> {
  for (const key of Object.keys(params)) {
    if (!key.startsWith(K8S_PREFIX)) {
      throw invalidArgument(
        `Snapshot parameter ${JSON.stringify(key)} is not known; loopvol takes no snapshot parameters.`,
      );
    }
  }
  return params;
}

function sameStrings(a: Record<string, string>, b: Record<string, string>): boolean {
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
  let want: number;
  if (requiredBytes > 0) want = requiredBytes;
  else if (sourceBytes !== undefined) want = sourceBytes;
  else want = limitBytes > 0 ? Math.min(defaultBytes, limitBytes) : defaultBytes;
  const size = roundUpMiB(Math.max(want, minBytes, sourceBytes ?? 0));
  if (limitBytes > 0 && size > limitBytes) {
    throw outOfRange(
      size === roundUpMiB(minBytes) && minBytes > want
        ? `This filesystem needs at least ${formatBytes(minBytes)}, more than limit_bytes (${formatBytes(limitBytes)}).`
        : `No whole number of MiB lies between ${formatBytes(requiredBytes)} and ${formatBytes(limitBytes)}.`,
    );
  }
  return size;
}

export function controllerService(d: ControllerDeps): Methods<ControllerHandlers> {
  const { volumes, snapshots } = d;
  const poolName = d.config.poolName;

  async function condition(meta: VolumeMeta): Promise<VolumeCondition> {
    try {
      const st = await fs.stat(volumes.imagePath(meta.id));
      if (st.size < meta.capacityBytes) {
        return {
          abnormal: true,
          message: `The disk image is ${st.size} bytes, smaller than the volume's ${meta.capacityBytes}.`,
        };
      }
      return { abnormal: false, message: 'The disk image is present and complete.' };
    } catch {
      return { abnormal: true, message: 'The disk image is missing from the pool.' };
    }
  }

  async function publishedNodes(id: string): Promise<string[]> {
    return (await volumes.attachments(id)).map((a) => a.node);
  }

  /** Copies a volume's image at one instant (see consistency.ts). */
  async function copyVolumeImage(ctx: CallContext, sourceId: string, dst: string): Promise<Date> {
    return withConsistentSources(ctx, d, [sourceId], async (plan) => {
      await plan.copy(sourceId, dst);
      return plan.takenAt;
    });
  }

  return {
    ControllerGetCapabilities: method({
      validate: () => null,
      quiet: true,
      run: () =>
        Promise.resolve({
          capabilities: CONTROLLER_CAPABILITIES.map((type): ControllerServiceCapability => ({
            rpc: { type },
          })),
        }),
    }),

    CreateVolume: method({
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
        // Resolve the content source (NOT_FOUND when absent).
        let sourceBytes: number | undefined;
        let sourceFs: FsType | undefined;
        let sourceInitialized = false;
        let sourceSnapshot: SnapshotMeta | undefined;
        if (v.source?.kind === 'snapshot') {
          sourceSnapshot = isSnapshotId(v.source.id) ? await snapshots.get(v.source.id) : undefined;
          if (!sourceSnapshot) throw notFound(`Snapshot ${v.source.id} does not exist.`);
          sourceBytes = sourceSnapshot.sizeBytes;
          sourceFs = sourceSnapshot.fsType;
          sourceInitialized = sourceSnapshot.initialized;
        } else if (v.source?.kind === 'volume') {
          const src = isVolumeId(v.source.id) ? await volumes.get(v.source.id) : undefined;
          if (!src) throw notFound(`Volume ${v.source.id} does not exist.`);
          sourceBytes = src.capacityBytes;
          sourceFs = src.fsType;
          sourceInitialized = await volumes.isInitialized(src.id);
        }
        if (v.fsType && sourceFs && sourceInitialized && v.fsType !== sourceFs) {
          throw invalidArgument(`The source holds ${sourceFs}, but ${v.fsType} was asked for.`);
        }
        const fsType: FsType = v.fsType ?? sourceFs ?? 'ext4';
        const needsFs = v.caps.some((c) => c.accessType === 'mount');
        const size = chooseSize(
          v.range,
          needsFs ? MIN_BYTES[fsType] : MIN_BYTES.block,
          d.config.defaultVolumeSize,
          sourceBytes,
        );

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
        const respond = (meta: VolumeMeta) => ({ volume: volumeMessage(meta, poolName) });

        // A damaged record is not "existing": volumes.create quarantines it and says where it went.
        const found = await volumes.inspect(v.id);
        const existing = found.state === 'ok' && found.value.state === 'ready' ? found.value : undefined;
        if (existing) {
          const why = compatible(existing);
          if (why)
            throw alreadyExists(`A volume named ${JSON.stringify(v.name)} already exists, but ${why}.`);
          return respond(existing);
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
        const fill = async (image: string): Promise<FillResult> => {
          if (v.source?.kind === 'snapshot' && sourceSnapshot) {
            // Held while it is read: a DeleteSnapshot meanwhile waits (or is ABORTED), never tears the copy.
            await snapshots.holding(sourceSnapshot.id, 'restore', async (_snap, lock) => {
              const res = await copyImage(ctx, snapshots.imagePath(v.source?.id ?? ''), image, {
                allowCopy: true,
                signal: lock.signal,
              });
              ctx.log.info({ snapshot: v.source?.id, how: res.method }, 'restored snapshot image');
            });
          } else if (v.source?.kind === 'volume') {
            await copyVolumeImage(ctx, v.source.id, image);
          } else {
            await createSparseImage(image, size);
          }
          await growImage(ctx, image, size, false);
          if (preallocated) await preallocate(ctx, image, 0, size);
          return { initialized: sourceInitialized };
        };
        const { volume, created } = await volumes.create(meta, fill);
        if (!created) {
          const why = compatible(volume);
          if (why)
            throw alreadyExists(`A volume named ${JSON.stringify(v.name)} already exists, but ${why}.`);
        } else {
          ctx.log.info(
            { volumeId: v.id, size, fsType, allocation: v.allocation, source: v.source },
            'created volume',
          );
        }
        return respond(volume);
      },
    }),

    DeleteVolume: method({
      validate: (req) => ({ id: requireField(req.volume_id, 'volume_id') }),
      locks: (v) => [v.id],
      run: async (v) => {
        await volumes.delete(v.id, d.inUseHere);
        return {};
      },
    }),

    ControllerPublishVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        node: requireField(req.node_id, 'node_id'),
        cap: parseCapability(req.volume_capability, 'volume_capability'),
        readonly: req.readonly,
      }),
      locks: (v) => [v.id],
      run: async (v) => {
        if (!isVolumeId(v.id) || !(await volumes.get(v.id))) throw notFound(`Volume ${v.id} does not exist.`);
        const node = isNodeId(v.node) ? await d.nodes.get(v.node) : undefined;
        if (!node)
          throw notFound(
            `Node ${v.node} is not known to pool ${poolName}; its node plugin registers it when it starts.`,
          );
        if (node.pool !== poolName) {
          throw notFound(`Node ${v.node} serves pool ${node.pool}, not ${poolName}.`);
        }
        await volumes.publish(
          v.id,
          {
            node: v.node,
            readonly: v.readonly,
            accessType: v.cap.accessType,
            mode: v.cap.mode,
            since: new Date().toISOString(),
          },
          node.maxVolumes,
        );
        return {
          publish_context: { 'loopvol.csi.io/pool': poolName, 'loopvol.csi.io/readonly': String(v.readonly) },
        };
      },
    }),

    ControllerUnpublishVolume: method({
      validate: (req) => ({ id: requireField(req.volume_id, 'volume_id'), node: req.node_id }),
      locks: (v) => [v.id],
      run: async (v) => {
        if (v.node !== '' && !isNodeId(v.node)) return {};
        await volumes.unpublish(v.id, v.node === '' ? undefined : v.node);
        return {};
      },
    }),

    ValidateVolumeCapabilities: method({
      validate: (req) => {
        const id = requireField(req.volume_id, 'volume_id');
        if (req.volume_capabilities.length === 0) throw invalidArgument('volume_capabilities is required.');
        for (const [i, c] of req.volume_capabilities.entries()) {
          if (!c.access_mode) throw invalidArgument(`volume_capabilities[${i}].access_mode is required.`);
          if (!c.mount && !c.block)
            throw invalidArgument(`volume_capabilities[${i}] needs an access type, mount or block.`);
        }
        return { id, req };
      },
      quiet: true,
      run: async ({ id, req }) => {
        const meta = isVolumeId(id) ? await volumes.get(id) : undefined;
        if (!meta) throw notFound(`Volume ${id} does not exist.`);
        const unconfirmed = (message: string) => ({ confirmed: null, message });
        let caps: Capability[];
        try {
          caps = req.volume_capabilities.map((c, i) => parseCapability(c, `volume_capabilities[${i}]`));
        } catch (err) {
          return unconfirmed(err instanceof Error ? err.message : String(err));
        }
        const wrongFs = caps.find(
          (c) => c.accessType === 'mount' && c.fsType !== '' && c.fsType !== meta.fsType,
        );
        if (wrongFs)
          return unconfirmed(`The volume is made for ${meta.fsType}, not ${describeCapability(wrongFs)}.`);
        if (Object.keys(req.parameters).length > 0 && !sameStrings(req.parameters, meta.parameters)) {
          return unconfirmed('The parameters differ from those the volume was created with.');
        }
        if (
          Object.keys(req.mutable_parameters).length > 0 &&
          !sameStrings(req.mutable_parameters, meta.mutableParameters)
        ) {
          return unconfirmed('The mutable parameters differ from the volume’s.');
        }
        return {
          confirmed: {
            volume_context: req.volume_context,
            volume_capabilities: req.volume_capabilities,
            parameters: req.parameters,
            mutable_parameters: req.mutable_parameters,
          },
          message: '',
        };
      },
    }),

    ListVolumes: method({
      validate: (req) => {
        if (req.max_entries < 0) throw invalidArgument('max_entries must not be negative.');
        const token = req.starting_token;
        if (token !== '' && !isVolumeId(token)) throw invalidToken(token);
        return { max: req.max_entries, token: token === '' ? undefined : token };
      },
      quiet: true,
      run: async ({ max, token }) => {
        const { volumes: page, next } = await volumes.list(token, max);
        const entries = await mapLimit(page, LIST_CONCURRENCY, async (meta) => ({
          volume: volumeMessage(meta, poolName),
          status: {
            published_node_ids: await publishedNodes(meta.id),
            volume_condition: await condition(meta),
          },
        }));
        return { entries, next_token: next ?? '' };
      },
    }),

    ControllerGetVolume: method({
      validate: (req) => ({ id: requireField(req.volume_id, 'volume_id') }),
      quiet: true,
      run: async ({ id }) => {
        const meta = isVolumeId(id) ? await volumes.get(id) : undefined;
        if (!meta) throw notFound(`Volume ${id} does not exist.`);
        return {
          volume: volumeMessage(meta, poolName),
          status: { published_node_ids: await publishedNodes(id), volume_condition: await condition(meta) },
        };
      },
    }),

    GetCapacity: method({
      validate: (req) => {
        const caps = req.volume_capabilities.map((c, i) => parseCapability(c, `volume_capabilities[${i}]`));
        const params = parseVolumeParameters(req.parameters);
        const fsType = requestedFsType(caps, params.fsType) ?? 'ext4';
        const needsFs = caps.length === 0 || caps.some((c) => c.accessType === 'mount');
        const preallocated = params.allocation === 'preallocate';
        return { req, preallocated, minBytes: needsFs ? MIN_BYTES[fsType] : MIN_BYTES.block };
      },
      quiet: true,
      run: async ({ req, minBytes, preallocated }) => {
        const here = !req.accessible_topology || req.accessible_topology.segments[TOPOLOGY_KEY] === poolName;
        const report = here ? await d.capacity.report() : undefined;
        const available = !report
          ? 0
          : preallocated
            ? report.availablePreallocatedBytes
            : report.availableBytes;
        return {
          available_capacity: String(available),
          maximum_volume_size: { value: String(available) },
          minimum_volume_size: { value: String(minBytes) },
        };
      },
    }),

    ControllerExpandVolume: method({
      validate: (req) => {
        const id = requireField(req.volume_id, 'volume_id');
        if (!req.capacity_range) throw invalidArgument('capacity_range is required.');
        const range = parseRange(req.capacity_range);
        if (range.requiredBytes === 0 && range.limitBytes === 0) {
          throw invalidArgument('capacity_range needs required_bytes or limit_bytes.');
        }
        const cap = req.volume_capability
          ? parseCapability(req.volume_capability, 'volume_capability')
          : undefined;
        return { id, range, cap };
      },
      locks: (v) => [v.id],
      run: async ({ id, range }, ctx) => {
        if (!isVolumeId(id)) throw notFound(`Volume ${id} does not exist.`);
        const updated = await volumes.update(id, 'ControllerExpandVolume', async (meta) => {
          const current = meta.capacityBytes;
          const target = range.requiredBytes > 0 ? roundUpMiB(range.requiredBytes) : current;
          if (range.limitBytes > 0 && target > range.limitBytes) {
            throw outOfRange(
              `No whole number of MiB lies between ${formatBytes(range.requiredBytes)} and ${formatBytes(range.limitBytes)}.`,
            );
          }
          if (target < current) {
            throw outOfRange(`Volume ${id} is ${formatBytes(current)}; shrinking a volume is not supported.`);
          }
          if (range.limitBytes > 0 && current > range.limitBytes) {
            throw outOfRange(`Volume ${id} is already ${formatBytes(current)}, more than limit_bytes.`);
          }
          const image = volumes.imagePath(id);
          const st = await fs.stat(image);
          if (target === current && st.size >= target) return undefined;
          const settle = await d.capacity.reserve(
            target - Math.min(st.size, target),
            meta.allocation,
            `growing volume ${id}`,
          );
          let grown = false;
          try {
            await growImage(ctx, image, target, meta.allocation === 'preallocate');
            grown = true;
          } finally {
            settle(
              grown && meta.allocation !== 'preallocate' ? target - Math.min(st.size, target) : undefined,
            );
          }
          ctx.log.info({ volumeId: id, from: current, to: target }, 'grew volume image');
          return { ...meta, capacityBytes: target };
        });
        return { capacity_bytes: String(updated.capacityBytes), node_expansion_required: true };
      },
    }),

    ControllerModifyVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        mutable: parseMutableParameters(req.mutable_parameters),
        raw: req.mutable_parameters,
      }),
      locks: (v) => [v.id],
      run: async ({ id, mutable, raw }, ctx) => {
        if (!isVolumeId(id) || !(await volumes.get(id))) throw notFound(`Volume ${id} does not exist.`);
        await volumes.update(id, 'ControllerModifyVolume', async (meta) => {
          const allocation = mutable.allocation ?? meta.allocation;
          if (allocation === 'preallocate' && meta.allocation !== 'preallocate') {
            const { freeBytes } = await d.capacity.report();
            const st = await fs.stat(volumes.imagePath(id));
            const needed = Math.max(0, st.size - st.blocks * 512);
            if (needed > freeBytes) {
              throw resourceExhausted(
                `The pool has ${formatBytes(freeBytes)} free, not the ${formatBytes(needed)} volume ${id} needs preallocated.`,
              );
            }
            await preallocate(ctx, volumes.imagePath(id), 0, meta.capacityBytes);
          }
          return { ...meta, allocation, mutableParameters: { ...meta.mutableParameters, ...raw } };
        });
        return {};
      },
    }),

    CreateSnapshot: method({
      validate: (req) => {
        const name = requireField(req.name, 'name');
        const source = requireField(req.source_volume_id, 'source_volume_id');
        return {
          name,
          source,
          id: snapshotIdForName(name),
          parameters: parseSnapshotParameters(req.parameters),
        };
      },
      locks: (v) => [v.id, v.source],
      run: async (v, ctx) => {
        const found = await snapshots.inspect(v.id);
        const existing = found.state === 'ok' && found.value.state === 'ready' ? found.value : undefined;
        if (existing) {
          if (existing.sourceVolumeId !== v.source) {
            throw alreadyExists(
              `A snapshot named ${JSON.stringify(v.name)} already exists, of volume ${existing.sourceVolumeId}.`,
            );
          }
          return { snapshot: snapshotMessage(existing) };
        }
        const src = isVolumeId(v.source) ? await volumes.get(v.source) : undefined;
        if (!src) throw notFound(`Volume ${v.source} does not exist.`);
        const meta: SnapshotMeta = {
          format: 1,
          id: v.id,
          name: v.name,
          state: 'creating',
          sourceVolumeId: v.source,
          sizeBytes: src.capacityBytes,
          fsType: src.fsType,
          initialized: await volumes.isInitialized(v.source),
          parameters: v.parameters,
          groupSnapshotId: '',
          createdAt: new Date().toISOString(),
        };
        const { snapshot, created } = await snapshots.create(meta, async (image) => {
          const takenAt = await copyVolumeImage(ctx, v.source, image);
          return { takenAt, sizeBytes: (await fs.stat(image)).size };
        });
        if (!created && snapshot.sourceVolumeId !== v.source) {
          throw alreadyExists(
            `A snapshot named ${JSON.stringify(v.name)} already exists, of volume ${snapshot.sourceVolumeId}.`,
          );
        }
        return { snapshot: snapshotMessage(snapshot) };
      },
    }),

    DeleteSnapshot: method({
      validate: (req) => ({ id: requireField(req.snapshot_id, 'snapshot_id') }),
      locks: (v) => [v.id],
      run: async ({ id }) => {
        await snapshots.delete(id);
        return {};
      },
    }),

    ListSnapshots: method({
      validate: (req) => {
        if (req.max_entries < 0) throw invalidArgument('max_entries must not be negative.');
        if (req.starting_token !== '' && !isSnapshotId(req.starting_token))
          throw invalidToken(req.starting_token);
        return {
          max: req.max_entries,
          token: req.starting_token === '' ? undefined : req.starting_token,
          snapshotId: req.snapshot_id,
          sourceId: req.source_volume_id,
        };
      },
      quiet: true,
      run: async ({ max, token, snapshotId, sourceId }) => {
        if (snapshotId !== '') {
          const one = isSnapshotId(snapshotId) ? await snapshots.get(snapshotId) : undefined;
          const match = one && (sourceId === '' || one.sourceVolumeId === sourceId) ? [one] : [];
          return { entries: match.map((s) => ({ snapshot: snapshotMessage(s) })), next_token: '' };
        }
        const { snapshots: page, next } = await snapshots.list(
          token,
          max,
          (s) => sourceId === '' || s.sourceVolumeId === sourceId,
        );
        return { entries: page.map((s) => ({ snapshot: snapshotMessage(s) })), next_token: next ?? '' };
      },
    }),

    GetSnapshot: method({
      validate: (req) => ({ id: requireField(req.snapshot_id, 'snapshot_id') }),
      quiet: true,
      run: async ({ id }) => {
        const meta = isSnapshotId(id) ? await snapshots.get(id) : undefined;
        if (!meta) throw notFound(`Snapshot ${id} does not exist.`);
        return { snapshot: snapshotMessage(meta) };
      },
    }),
  };
}

/** A starting_token this driver never issued: ABORTED, as the spec asks, so the caller starts over. */
function invalidToken(token: string): CsiError {
  return aborted(
    `starting_token ${JSON.stringify(token.slice(0, 80))} is not valid; start the listing again without it.`,
  );
}
