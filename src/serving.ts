/**
 * Serving an open pool: the stores and services over it, and what must stop with the process (its
 * loops, the node's freeze answers and fencing); and the services' answers while there is no pool.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import * as grpc from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { type Config, servesController, servesNode } from './config.js';
import { controllerService } from './csi/controller.js';
import { groupService } from './csi/group.js';
import { freeingSpaceIn, withRoom } from './csi/space.js';
import { nodeService, POOL_ID_KEY } from './csi/node.js';
import { snapshotMetadataService } from './csi/snapshot-metadata.js';
import { failedPrecondition } from './errors.js';
import { bindExec, type Exec, type Runner } from './exec/runner.js';
import type { ControllerHandlers } from './gen/csi/v1/Controller.js';
import type { GroupControllerHandlers } from './gen/csi/v1/GroupController.js';
import type { NodeHandlers } from './gen/csi/v1/Node.js';
import type { SnapshotMetadataHandlers } from './gen/csi/v1/SnapshotMetadata.js';
import { kernelHost, loopsBackedBy } from './host/host.js';
import type { NodeDeps } from './node/on-host.js';
import { FenceGuard, thawLeftovers } from './node/fence.js';
import { QuiesceAgent } from './node/quiesce.js';
import { Capacity } from './pool/capacity.js';
import { startDiscarding } from './pool/leftovers.js';
import { startRecordingSharing } from './pool/shared-records.js';
import { NodeRegistry } from './pool/nodes.js';
import type { Pool } from './pool/pool.js';
import { repeat } from './limit.js';
import { QuiesceBoard } from './pool/quiesce.js';
import { SpaceReserve } from './pool/reserve.js';
import { SnapshotMetadataReader } from './pool/snapshot-metadata.js';
import { SnapshotStore } from './pool/snapshots.js';
import { VolumeStore } from './pool/volumes.js';
import { method, type Methods } from './server/call.js';
import { InFlight } from './server/inflight.js';
import { type StreamMethods } from './server/stream.js';

/** A scope for work the driver does on its own behalf (startup), outside any RPC. */
export function startupContext(log: Logger, runner: Runner): Exec {
  return bindExec(runner, { log, deadline: Number.POSITIVE_INFINITY });
}

/** How often the pool's space reserve is looked at (written again once the pool has room). */
const RESERVE_CHECK_MS = 60_000;
/** How long a controller waits for a node to answer a request to freeze a volume. */
const FREEZE_WAIT_MS = 10_000;

/** What serving a pool takes: its services' methods, and what must stop with the process. */
export interface Serving {
  pool: Pool;
  controller: Methods<ControllerHandlers>;
  group: Methods<GroupControllerHandlers>;
  node: Methods<NodeHandlers>;
  metadata: StreamMethods<SnapshotMetadataHandlers>;
  agent: QuiesceAgent | undefined;
  guard: FenceGuard | undefined;
  /** The controller's clearing of unfinished creations (pool/leftovers.ts). */
  discarding?: { stop: () => void };
  /** The pool's space reserve written again when it has room (pool/reserve.ts). */
  reserving?: { stop: () => void };
}

/** Stops what serving a pool started (its loops, the node's freeze answers and fencing). */
export async function stopServing(serving: Serving | undefined): Promise<void> {
  serving?.discarding?.stop();
  serving?.reserving?.stop();
  await serving?.agent?.stop();
  await serving?.guard?.stop();
}

/**
 * Builds the stores and services over an open pool; a node plugin also registers and starts answering
 * freezes. What it started is stopped again when it fails midway.
 */
export async function serve(
  config: Config,
  pool: Pool,
  log: Logger,
  runner: Runner,
  inflight: InFlight,
): Promise<Serving> {
  const out: Serving = {
    pool,
    controller: {},
    group: {},
    node: {},
    metadata: {},
    agent: undefined,
    guard: undefined,
  };
  try {
    return await serveInto(out, config, log, runner, inflight);
  } catch (err) {
    await stopServing(out).catch(() => undefined);
    throw err;
  }
}

async function serveInto(
  out: Serving,
  config: Config,
  log: Logger,
  runner: Runner,
  inflight: InFlight,
): Promise<Serving> {
  const pool = out.pool;
  const capacity = Capacity.of(pool, config.overcommitRatio);
  const nodes = new NodeRegistry(pool.layout, config.nodeFenceMs);
  const volumes = new VolumeStore(pool, capacity, nodes, log);
  const snapshots = new SnapshotStore(pool, log);
  const board = new QuiesceBoard(pool);
  const startup = startupContext(log, runner);
  // Written before serving, so that a pool's free space stays as it is from the first call on; then
  // written again, when there is room, every minute.
  const reserve = new SpaceReserve(pool.root, log, () => pool.assertPresent());
  const reserving = repeat(RESERVE_CHECK_MS, () => reserve.refill());
  out.reserving = reserving;
  await reserving.first;
  const quarantined = await pool.quarantined();
  if (quarantined.length > 0) {
    log.warn(
      { quarantined: quarantined.map((q) => `${pool.layout.quarantineDir}/${q}`) },
      'the pool holds quarantined records (unreadable, kept instead of deleted); an operator must restore or remove them',
    );
  }
  if (servesController(config)) {
    const copy = {
      pool,
      volumes,
      capacity,
      board,
      freezeBudgetMs: config.freezeBudgetMs,
      freezeWaitMs: FREEZE_WAIT_MS,
      requester: `controller on ${os.hostname()}`,
    };
    const inUseHere = async (image: string): Promise<string | undefined> => {
      const loops = await loopsBackedBy(kernelHost, startup, image);
      return loops.length > 0 ? `attached as ${loops.map((l) => l.path).join(', ')}` : undefined;
    };
    // Publishes wait for this (it reads every volume's attachments once); serving starts at once.
    volumes.repairNodeIndex().then(
      ({ added, unreadable }) => {
        if (added > 0)
          log.warn({ added }, 'added node index entries of attachments an older release had lost');
        if (unreadable.length > 0)
          log.error(
            { volumes: unreadable.slice(0, 20), count: unreadable.length },
            "could not read these volumes' attachments to check the node index; loopvol check tells more",
          );
      },
      (err: unknown) => {
        log.error({ err }, 'could not check the node index against the attachments');
      },
    );
    out.discarding = startDiscarding(pool, { volumes, snapshots }, log);
    startRecordingSharing(pool, capacity, { volumes, snapshots }, log);
    out.controller = freeingSpaceIn(
      controllerService({ ...copy, config, snapshots, nodes, capacity, inUseHere }),
      ['DeleteVolume', 'DeleteSnapshot', 'ControllerUnpublishVolume'],
      reserve,
    );
    out.group = freeingSpaceIn(groupService({ ...copy, snapshots }), ['DeleteVolumeGroupSnapshot'], reserve);
    out.metadata = snapshotMetadataService({ reader: new SnapshotMetadataReader(pool, snapshots) });
  }
  if (servesNode(config)) {
    const nodeId = config.nodeId;
    if (nodeId === undefined) throw new Error('the node service needs --nodeid');
    // On a full pool, the start-up writes of a node with volumes published to it take the reserve: a
    // plugin that cannot start frees nothing. One with none (joining) has nothing to free: it fails to
    // start, as it would without a reserve, and leaves the reserve to those that do.
    const mayFree = (await nodes.attachedVolumes(nodeId)).length > 0;
    const room = <T>(step: () => Promise<T>): Promise<T> => (mayFree ? withRoom(reserve, step) : step());
    await room(() => nodes.register(nodeId, config.poolName, config.maxVolumesPerNode));
    const nodeDeps: NodeDeps = {
      nodeId,
      poolName: config.poolName,
      poolId: pool.id,
      maxVolumesPerNode: config.maxVolumesPerNode,
      loopDirectIo: config.loopDirectIo,
      volumes,
      nodes,
      host: kernelHost,
      poolRoot: pool.root,
      // Compared with canonical staging and target paths: a kubelet root reached through a symlink
      // (/var/lib/kubelet -> /data/kubelet) is compared as what it leads to.
      kubeletDir: await kernelHost.canonicalPath(config.kubeletDir),
      bootId: (
        await fs.readFile('/proc/sys/kernel/random/boot_id', 'utf8').catch(() => 'unknown-boot')
      ).trim(),
    };
    // A predecessor's freezes are declared over before anything is thawed, then thawed, then new
    // requests are answered.
    out.guard = new FenceGuard(nodeDeps, pool, inflight, runner, log);
    const guard = out.guard;
    await room(() => guard.prepare());
    const agent = new QuiesceAgent(nodeDeps, board, inflight, out.guard, runner, log);
    out.agent = agent;
    await room(() => agent.prepare());
    await room(() => thawLeftovers(nodeDeps, startup, guard));
    out.agent.run();
    out.guard.run();
    out.node = freeingSpaceIn(nodeService(nodeDeps), ['NodeUnstageVolume', 'NodeUnpublishVolume'], reserve);
  }
  return out;
}

/** Every method of `definition` answering FAILED_PRECONDITION with `why` (no pool here yet). */
export function refusing<H>(definition: grpc.ServiceDefinition, why: () => string): Methods<H> {
  const table: Record<string, unknown> = {};
  for (const name of Object.keys(definition)) {
    table[name] = method<{ volume_context?: Record<string, string> }, never, string>({
      validate: (req) => {
        const wanted = req.volume_context?.[POOL_ID_KEY];
        return wanted ? `${why()} (volume of pool ${wanted})` : why();
      },
      run: (msg) => Promise.reject(failedPrecondition(`${msg}.`)),
    });
  }
  return table as Methods<H>;
}
