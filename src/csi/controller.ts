/**
 * The CSI Controller service: volumes, attachments, capacity, snapshots and expansion, over the pool.
 * Each RPC validates the request (no side effect before that), names the in-flight keys it holds, and
 * leaves crash safety and cross-process locking to the pool stores. CreateVolume lives in
 * create-volume.ts, the snapshot RPCs in snapshots.ts.
 */
import { failpoint } from '../failpoints.js';
import fs from 'node:fs/promises';
import type { Config } from '../config.js';
import { invalidArgument, notFound, outOfRange } from '../errors.js';
import type { ControllerHandlers } from '../gen/csi/v1/Controller.js';
import type { ControllerServiceCapability } from '../gen/csi/v1/ControllerServiceCapability.js';
import type { VolumeCondition } from '../gen/csi/v1/VolumeCondition.js';
import { mapLimit } from '../limit.js';
import type { Capacity } from '../pool/capacity.js';
import { formatBytes } from '../pool/capacity.js';
import { isNodeId, isVolumeId } from '../pool/ids.js';
import { growImage, preallocate } from '../pool/images.js';
import type { NodeRegistry } from '../pool/nodes.js';
import type { Pool } from '../pool/pool.js';
import type { SnapshotStore } from '../pool/snapshots.js';
import type { Capability, VolumeMeta } from '../pool/types.js';
import type { VolumeStore } from '../pool/volumes.js';
import { method, type Methods } from '../server/call.js';
import type { CopyDeps } from './consistency.js';
import { createVolumeMethod, requestedFsType, sameStrings } from './create-volume.js';
import { POOL_ID_KEY, PUBLISH_POOL_KEY, PUBLISH_READONLY_KEY } from './node.js';
import { volumeMessage } from './messages.js';
import { parseMutableParameters, parseVolumeParameters } from './parameters.js';
import { snapshotMethods } from './snapshots.js';
import {
  describeCapability,
  invalidToken,
  MIN_BYTES,
  parseCapability,
  parseRange,
  requireField,
  floorMiB,
  roundUpMiB,
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

export function controllerService(d: ControllerDeps): Methods<ControllerHandlers> {
  const { volumes } = d;
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

    CreateVolume: createVolumeMethod(d),

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
          publish_context: {
            [PUBLISH_POOL_KEY]: poolName,
            [POOL_ID_KEY]: d.pool.id,
            // The node stages and publishes the volume read-only when this says so (or its attachment does).
            [PUBLISH_READONLY_KEY]: String(v.readonly),
          },
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
        const mount = caps.find((c) => c.accessType === 'mount');
        if (mount && meta.fsType === 'none') {
          return unconfirmed(`The volume was made for raw block access, not ${describeCapability(mount)}.`);
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
          volume: volumeMessage(meta, poolName, d.pool.id),
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
          volume: volumeMessage(meta, poolName, d.pool.id),
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
        await d.pool.assertPresent(); // never report the capacity of whatever disk is under an unmounted pool
        const here = !req.accessible_topology || req.accessible_topology.segments[TOPOLOGY_KEY] === poolName;
        const report = here ? await d.capacity.report() : undefined;
        const available = !report
          ? 0
          : preallocated
            ? report.availablePreallocatedBytes
            : report.availableBytes;
        // No volume can be larger than the largest file the pool's filesystem holds (16 TiB on ext4).
        const largest = report ? floorMiB(await d.pool.fs.maxFileSize()) : 0;
        return {
          available_capacity: String(available),
          maximum_volume_size: { value: String(Math.min(available, largest)) },
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
        const updated = await volumes.update(id, 'ControllerExpandVolume', async (meta, lock) => {
          const current = meta.capacityBytes;
          const requested = range.requiredBytes > 0 ? roundUpMiB(range.requiredBytes) : current;
          if (range.limitBytes > 0 && requested > range.limitBytes) {
            throw outOfRange(
              `No whole number of MiB lies between ${formatBytes(range.requiredBytes)} and ${formatBytes(range.limitBytes)}.`,
            );
          }
          // Already as large or larger: OK at its size (spec), never shrunk. A retry whose first answer
          // was lost, then lowered (Kubernetes' recovery from a failed expansion), must not be stuck.
          // The size is the image's where an expansion cut short (killed between the image and its
          // record) left it larger: that is what the node grows the filesystem to. A length that is
          // no whole number of MiB (a preallocated expansion of a release before 2026-12-03 failed on
          // ext4 after making the image longer) is rounded up, as every capacity is.
          const image = volumes.imagePath(id);
          const st = await fs.stat(image);
          const imageSize = roundUpMiB(st.size);
          const target = Math.max(requested, current, imageSize);
          const largest = await d.pool.fs.maxFileSize();
          if (target > largest) {
            throw outOfRange(
              `The pool's filesystem holds files of at most ${formatBytes(largest)}; volume ${id} cannot grow to ${formatBytes(target)}.`,
            );
          }
          const already = Math.max(current, imageSize);
          if (range.limitBytes > 0 && already > range.limitBytes) {
            throw outOfRange(`Volume ${id} is already ${formatBytes(already)}, more than limit_bytes.`);
          }
          if (target === current && st.size >= target) return undefined;
          const settle = await d.capacity.reserve(
            target - Math.min(st.size, target),
            meta.allocation,
            `growing volume ${id}`,
            { id },
          );
          let grown = false;
          try {
            await growImage(ctx, image, target, meta.allocation === 'preallocate', lock);
            grown = true;
          } finally {
            settle(
              grown && meta.allocation !== 'preallocate' ? target - Math.min(st.size, target) : undefined,
            );
          }
          failpoint('expand-volume:grown');
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
        await volumes.update(id, 'ControllerModifyVolume', async (meta, lock) => {
          const allocation = mutable.allocation ?? meta.allocation;
          if (allocation === 'preallocate' && meta.allocation !== 'preallocate') {
            // Admitted as a preallocated CreateVolume is: against the space the other volumes' promises
            // leave (and what other calls of this process are taking), never against free space alone,
            // which would let it take the blocks the other sparse volumes were promised.
            const st = await fs.stat(volumes.imagePath(id));
            const needed = Math.max(0, st.size - st.blocks * 512);
            const settle = await d.capacity.reserve(needed, 'preallocate', `preallocating volume ${id}`, {
              id,
              promised: needed, // its own promise, which these blocks replace
            });
            try {
              await preallocate(ctx, volumes.imagePath(id), 0, meta.capacityBytes, lock);
            } finally {
              settle(undefined);
            }
          }
          return { ...meta, allocation, mutableParameters: { ...meta.mutableParameters, ...raw } };
        });
        return {};
      },
    }),
    ...snapshotMethods(d),
  };
}
