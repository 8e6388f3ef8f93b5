/**
 * Wires one driver process: the pool, the services its --mode serves, the gRPC server on the endpoint,
 * and the optional metrics server; and takes them down again.
 *
 * A process whose pool is not there or does not answer serves Identity meanwhile (pool-open.ts).
 */
import type http from 'node:http';
import fs from 'node:fs/promises';
import os from 'node:os';
import * as grpc from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { type Config, servesController, servesNode } from './config.js';
import { controllerService } from './csi/controller.js';
import { groupService } from './csi/group.js';
import { freeingSpaceIn } from './csi/space.js';
import { identityService } from './csi/identity.js';
import { nodeService, POOL_ID_KEY } from './csi/node.js';
import { snapshotMetadataRefusing, snapshotMetadataService } from './csi/snapshot-metadata.js';
import { failedPrecondition } from './errors.js';
import { bindExec, CLEANUP_MS, type Exec, ExecRunner, type Runner } from './exec/runner.js';
import { poolStats } from './audit/pool-stats.js';
import { type Reporter, startReports } from './audit/report.js';
import type { ControllerHandlers } from './gen/csi/v1/Controller.js';
import type { GroupControllerHandlers } from './gen/csi/v1/GroupController.js';
import type { IdentityHandlers } from './gen/csi/v1/Identity.js';
import type { NodeHandlers } from './gen/csi/v1/Node.js';
import type { SnapshotMetadataHandlers } from './gen/csi/v1/SnapshotMetadata.js';
import { type PoolState, Readiness } from './health.js';
import { kernelHost, loopsBackedBy } from './host/host.js';
import { Metrics, serveMetrics } from './metrics.js';
import type { NodeDeps } from './node/on-host.js';
import { FenceGuard, thawLeftovers } from './node/fence.js';
import { QuiesceAgent } from './node/quiesce.js';
import { Capacity } from './pool/capacity.js';
import { startDiscarding } from './pool/leftovers.js';
import { startRecordingSharing } from './pool/shared-records.js';
import { NodeRegistry } from './pool/nodes.js';
import type { Pool } from './pool/pool.js';
import { openPool } from './pool-open.js';
import { QuiesceBoard } from './pool/quiesce.js';
import { SpaceReserve } from './pool/reserve.js';
import { SnapshotMetadataReader } from './pool/snapshot-metadata.js';
import { SnapshotStore } from './pool/snapshots.js';
import { VolumeStore } from './pool/volumes.js';
import { buildService, type CallDeps, method, type Methods } from './server/call.js';
import { InFlight } from './server/inflight.js';
import { csiProto } from './server/proto.js';
import { awaitPredecessor, listen, stop } from './server/server.js';
import { buildStreamingService, type StreamMethods } from './server/stream.js';
import { setTelemetry } from './telemetry.js';
import { driverVersion } from './version.js';

/** A scope for work the driver does on its own behalf (startup), outside any RPC. */
export function startupContext(log: Logger, runner: Runner): Exec {
  return bindExec(runner, { log, deadline: Number.POSITIVE_INFINITY });
}

/** How long a controller waits for a node to answer a request to freeze a volume. */
const FREEZE_WAIT_MS = 10_000;

export interface DriverOptions {
  runner?: Runner;
}

export interface RunningDriver {
  readonly inFlightCalls: () => number;
  stop(): Promise<void>;
}

/** What serving a pool takes: its services' methods, and what must stop with the process. */
interface Serving {
  pool: Pool;
  controller: Methods<ControllerHandlers>;
  group: Methods<GroupControllerHandlers>;
  node: Methods<NodeHandlers>;
  metadata: StreamMethods<SnapshotMetadataHandlers>;
  agent: QuiesceAgent | undefined;
  guard: FenceGuard | undefined;
  /** The controller's clearing of unfinished creations (pool/leftovers.ts). */
  discarding?: { stop: () => void };
}

/** Builds the stores and services over an open pool; a node plugin also registers and starts answering freezes. */
async function serve(
  config: Config,
  pool: Pool,
  log: Logger,
  runner: Runner,
  inflight: InFlight,
): Promise<Serving> {
  const capacity = Capacity.of(pool, config.overcommitRatio);
  const nodes = new NodeRegistry(pool.layout, config.nodeFenceMs);
  const volumes = new VolumeStore(pool, capacity, nodes, log);
  const snapshots = new SnapshotStore(pool, log);
  const board = new QuiesceBoard(pool);
  const startup = startupContext(log, runner);
  const out: Serving = {
    pool,
    controller: {},
    group: {},
    node: {},
    metadata: {},
    agent: undefined,
    guard: undefined,
  };
  // Written before serving, so that a pool's free space stays as it is from the first call on.
  const reserve = new SpaceReserve(pool.root, log);
  await reserve.refill();
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
    await nodes.register(nodeId, config.poolName, config.maxVolumesPerNode);
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
    await out.guard.prepare();
    out.agent = new QuiesceAgent(nodeDeps, board, inflight, out.guard, runner, log);
    await out.agent.prepare();
    await thawLeftovers(nodeDeps, startup, out.guard);
    out.agent.run();
    out.guard.run();
    out.node = freeingSpaceIn(nodeService(nodeDeps), ['NodeUnstageVolume', 'NodeUnpublishVolume'], reserve);
  }
  return out;
}

/** Every method of `definition` answering FAILED_PRECONDITION with `why` (no pool here yet). */
function refusing<H>(definition: grpc.ServiceDefinition, why: () => string): Methods<H> {
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

export async function startDriver(
  config: Config,
  log: Logger,
  options: DriverOptions = {},
): Promise<RunningDriver> {
  // A node plugin's successor on the same host (a new container) takes over its locks at once.
  const role = servesNode(config) && config.nodeId !== undefined ? `node:${config.nodeId}` : undefined;
  // Only once its predecessor is gone: one still finishing its calls holds what it works on.
  const leavePresence =
    role && config.endpoint.kind === 'unix' ? await awaitPredecessor(config.endpoint.path, log) : undefined;
  const runner = options.runner ?? new ExecRunner();
  const openOptions = { create: config.createPool, lock: role ? { role } : {}, runner };
  const inflight = new InFlight();
  let state: PoolState = { missing: 'The pool is not open yet' };
  let serving: Serving | undefined;
  const opening = await openPool(config.poolDir, config.poolName, log, openOptions, {
    opened: async (pool, how) => {
      // Ready only once every service is there to serve it.
      serving = await serve(config, pool, log, runner, inflight);
      state = pool;
      report(pool);
      log.info({ pool: pool.root, id: pool.id }, how);
    },
    missing: (why) => {
      state = { missing: why };
    },
  });
  if (opening.pool) {
    state = opening.pool;
    serving = await serve(config, opening.pool, log, runner, inflight);
  }

  const capacityProbe = servesController(config)
    ? () =>
        serving
          ? Capacity.of(serving.pool, config.overcommitRatio).report()
          : Promise.resolve({ totalBytes: 0, availableBytes: 0, freeBytes: 0 })
    : undefined;
  const metrics = config.metricsAddress
    ? new Metrics(capacityProbe, async () => (serving ? (await serving.pool.quarantined()).length : 0))
    : undefined;
  if (metrics) {
    setTelemetry(metrics);
    if (servesController(config)) {
      metrics.watchPool(
        async () => (serving ? poolStats(serving.pool, log) : undefined),
        config.perVolumeMetrics,
      );
    }
  }
  // What `loopvol check` would say, logged and counted at start and every few minutes; never acted on.
  let reporter: Reporter | undefined;
  const report = (pool: Pool): void => {
    const scopes: ('pool' | 'host')[] = [];
    if (servesController(config)) scopes.push('pool');
    if (servesNode(config)) scopes.push('host');
    reporter = startReports({
      pool,
      log,
      runner,
      host: kernelHost,
      scopes,
      kubeletDir: config.kubeletDir,
      nodeFenceSeconds: config.nodeFenceMs / 1000,
      publish: (scope, findings) => metrics?.setFindings(scope, findings),
    });
  };
  if (serving) report(serving.pool);
  let active = 0;
  const deps: CallDeps = {
    log,
    runner,
    inflight,
    observer: metrics,
    tracker: {
      begin: () => {
        active++;
      },
      end: () => {
        active--;
      },
    },
  };

  const readiness = new Readiness(() => serving?.pool ?? state, config.mode);
  const proto = csiProto().csi.v1;
  const why = (): string => ('missing' in state ? state.missing : 'The pool is not open yet');
  const server = new grpc.Server({ 'grpc.max_receive_message_length': 4 * 1024 * 1024 });
  server.addService(
    proto.Identity.service,
    buildService<IdentityHandlers>(
      'Identity',
      proto.Identity.service,
      identityService({ config, readiness, version: driverVersion() }),
      deps,
    ),
  );
  if (servesController(config)) {
    const waitingController = refusing<ControllerHandlers>(proto.Controller.service, why);
    const waitingGroup = refusing<GroupControllerHandlers>(proto.GroupController.service, why);
    server.addService(
      proto.Controller.service,
      buildService<ControllerHandlers>(
        'Controller',
        proto.Controller.service,
        () => serving?.controller ?? waitingController,
        deps,
      ),
    );
    server.addService(
      proto.GroupController.service,
      buildService<GroupControllerHandlers>(
        'GroupController',
        proto.GroupController.service,
        () => serving?.group ?? waitingGroup,
        deps,
      ),
    );
    const waitingMetadata = snapshotMetadataRefusing(why);
    server.addService(
      proto.SnapshotMetadata.service,
      buildStreamingService<SnapshotMetadataHandlers>(
        'SnapshotMetadata',
        proto.SnapshotMetadata.service,
        () => serving?.metadata ?? waitingMetadata,
        deps,
      ),
    );
  }
  if (servesNode(config)) {
    const waitingNode = refusing<NodeHandlers>(proto.Node.service, why);
    server.addService(
      proto.Node.service,
      buildService<NodeHandlers>('Node', proto.Node.service, () => serving?.node ?? waitingNode, deps),
    );
  }

  await listen(server, config.endpoint, log);
  let metricsServer: http.Server | undefined;
  if (metrics && config.metricsAddress) {
    metricsServer = await serveMetrics(metrics, config.metricsAddress, () => readiness.problem(), log);
  }
  log.info(
    {
      endpoint: config.endpoint,
      pool: serving?.pool.root ?? config.poolDir,
      poolId: serving?.pool.id,
      poolName: config.poolName,
      version: driverVersion(),
      metrics: config.metricsAddress,
    },
    serving ? 'loopvol is serving' : 'loopvol is serving Identity only, waiting for its pool',
  );

  return {
    inFlightCalls: () => active,
    async stop() {
      reporter?.stop();
      serving?.discarding?.stop();
      if (active > 0) log.info({ inFlight: active }, 'waiting for calls in flight');
      metricsServer?.close();
      await stop(server, config.endpoint, config.shutdownTimeoutMs, log);
      // Calls cancelled at the timeout undo what they did (a rollback has CLEANUP_MS of its own):
      // exiting first would leave their devices attached and their leases held.
      for (const until = Date.now() + CLEANUP_MS; active > 0 && Date.now() < until;)
        await new Promise((r) => setTimeout(r, 50));
      if (active > 0) log.warn({ inFlight: active }, 'calls were still undoing their work at exit');
      await opening.stop();
      await serving?.agent?.stop();
      await serving?.guard?.stop();
      if (metrics) setTelemetry(undefined);
      await leavePresence?.();
    },
  };
}
