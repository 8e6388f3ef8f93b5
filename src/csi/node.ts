/**
 * The CSI Node service: each RPC validates its request, names the keys it holds (the volume's node
 * key, which a freeze for a snapshot holds too, and its paths' keys), and calls the algorithm in
 * src/node/ that does the work: stage.ts, unstage.ts, publish.ts (publish and unpublish), stats.ts,
 * grow.ts (expand).
 */
import { failedPrecondition, invalidArgument } from '../errors.js';
import type { NodeHandlers } from '../gen/csi/v1/Node.js';
import type { NodeGetCapabilitiesResponse } from '../gen/csi/v1/NodeGetCapabilitiesResponse.js';
import type { NodeServiceCapability } from '../gen/csi/v1/NodeServiceCapability.js';
import { expandVolume } from '../node/grow.js';
import type { NodeDeps } from '../node/on-host.js';
import { publishVolume, unpublishVolume } from '../node/publish.js';
import { nodeKey } from '../node/fence.js';
import { stageVolume } from '../node/stage.js';
import { volumeStats } from '../node/stats.js';
import { unstageVolume } from '../node/unstage.js';
import { method, type Methods } from '../server/call.js';
import { pathKey } from '../server/inflight.js';
import { parseCapability, parseRange, requireField, requirePath, TOPOLOGY_KEY } from './validate.js';

export const NODE_CAPABILITIES = [
  'STAGE_UNSTAGE_VOLUME',
  'GET_VOLUME_STATS',
  'VOLUME_CONDITION',
  'SINGLE_NODE_MULTI_WRITER',
  'EXPAND_VOLUME',
] as const;

/** The publish context key that names the pool a volume was published from. */
export const PUBLISH_POOL_KEY = 'loopvol.csi.io/pool';
/** The volume (and publish) context key that carries the id of the volume's pool. */
export const POOL_ID_KEY = 'loopvol.csi.io/pool-id';
/** The publish context key that says whether ControllerPublishVolume published the volume read-only. */
export const PUBLISH_READONLY_KEY = 'loopvol.csi.io/readonly';

/**
 * Whether the publish context says the volume was published to this node read-only; undefined when it
 * does not say (a CO that passes no context: the pool's attachment record is read instead).
 */
function publishedReadOnly(context: Record<string, string>): boolean | undefined {
  const value = context[PUBLISH_READONLY_KEY];
  if (value === undefined) return undefined;
  if (value === 'false') return false;
  if (value === 'true') return true;
  throw invalidArgument(`publish_context ${PUBLISH_READONLY_KEY} must be "true" or "false", not "${value}".`);
}

export function nodeService(d: NodeDeps): Methods<NodeHandlers> {
  // The volume's key, and the key of each path the call mounts at or reads the mount of (see pathKey).
  const locks = (v: { id: string; staging?: string; target?: string }): string[] => [
    nodeKey(v.id),
    ...[v.staging, v.target].filter((p) => p !== undefined).map(pathKey),
  ];

  // The same answer every time: built once, not per call (kubelet asks before every volume operation).
  const capabilities: NodeGetCapabilitiesResponse = {
    capabilities: NODE_CAPABILITIES.map((type): NodeServiceCapability => ({ rpc: { type } })),
  };
  return {
    NodeGetCapabilities: method({
      validate: () => null,
      quiet: true,
      run: () => Promise.resolve(capabilities),
    }),

    NodeGetInfo: method({
      validate: () => null,
      quiet: true,
      run: async () => {
        await d.volumes.assertPoolPresent(); // nothing is written into an empty mount point
        await d.nodes.register(d.nodeId, d.poolName, d.maxVolumesPerNode);
        return {
          node_id: d.nodeId,
          max_volumes_per_node: String(d.maxVolumesPerNode),
          accessible_topology: { segments: { [TOPOLOGY_KEY]: d.poolName } },
        };
      },
    }),

    NodeStageVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        staging: requirePath(req.staging_target_path, 'staging_target_path'),
        cap: parseCapability(req.volume_capability, 'volume_capability'),
        publishPool: req.publish_context[PUBLISH_POOL_KEY],
        poolId: req.volume_context[POOL_ID_KEY] ?? req.publish_context[POOL_ID_KEY],
        publishedReadOnly: publishedReadOnly(req.publish_context),
      }),
      locks,
      run: async (v, ctx) => {
        await stageVolume(d, ctx, v);
        return {};
      },
    }),

    NodeUnstageVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        staging: requirePath(req.staging_target_path, 'staging_target_path'),
      }),
      locks,
      run: async (v, ctx) => {
        await unstageVolume(d, ctx, v);
        return {};
      },
    }),

    NodePublishVolume: method({
      validate: (req) => {
        const id = requireField(req.volume_id, 'volume_id');
        const target = requirePath(req.target_path, 'target_path');
        const cap = parseCapability(req.volume_capability, 'volume_capability');
        if (req.staging_target_path === '') {
          throw failedPrecondition(
            'staging_target_path is required: this driver stages volumes (STAGE_UNSTAGE_VOLUME).',
          );
        }
        return {
          id,
          target,
          cap,
          staging: requirePath(req.staging_target_path, 'staging_target_path'),
          readonly: req.readonly,
          publishedReadOnly: publishedReadOnly(req.publish_context),
        };
      },
      locks,
      run: async (v, ctx) => {
        await publishVolume(d, ctx, v);
        return {};
      },
    }),

    NodeUnpublishVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        target: requirePath(req.target_path, 'target_path'),
      }),
      locks,
      run: async (v, ctx) => {
        await unpublishVolume(d, ctx, v);
        return {};
      },
    }),

    NodeGetVolumeStats: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        volumePath: requireField(req.volume_path, 'volume_path'),
      }),
      quiet: true,
      run: async (v, ctx) => {
        const { usage, condition } = await volumeStats(d, ctx, v);
        return { usage, volume_condition: condition };
      },
    }),

    NodeExpandVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        volumePath: requireField(req.volume_path, 'volume_path'),
        range: parseRange(req.capacity_range),
        cap: req.volume_capability ? parseCapability(req.volume_capability, 'volume_capability') : undefined,
      }),
      locks,
      run: async (v, ctx) => {
        const size = await expandVolume(d, ctx, {
          id: v.id,
          volumePath: v.volumePath,
          requiredBytes: v.range.requiredBytes,
          limitBytes: v.range.limitBytes,
        });
        return { capacity_bytes: String(size) };
      },
    }),
  };
}
