/**
 * Wires one driver process: the pool, the services its --mode serves, the gRPC server on the endpoint,
 * and the optional metrics server; and takes them down again.
 */
import type http from 'node:http';
import os from 'node:os';
import * as grpc from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { type Config, servesController, servesNode } from './config.js';
import { controllerService } from './csi/controller.js';
import { groupService } from './csi/group.js';
import { identityService } from './csi/identity.js';
import { nodeService } from './csi/node.js';
import { csiProto } from './server/proto.js';
import { bindExec, type Exec, ExecRunner, type Runner } from './exec/runner.js';
import type { ControllerHandlers } from './gen/csi/v1/Controller.js';
import type { GroupControllerHandlers } from './gen/csi/v1/GroupController.js';
import type { IdentityHandlers } from './gen/csi/v1/Identity.js';
import type { NodeHandlers } from './gen/csi/v1/Node.js';
import { Readiness } from './health.js';
import { Metrics, serveMetrics } from './metrics.js';
import { kernelHost, loopsBackedBy } from './host/host.js';
import type { NodeDeps } from './node/on-host.js';
import { QuiesceAgent, thawLeftovers } from './node/quiesce.js';
import { Capacity } from './pool/capacity.js';
import { NodeRegistry } from './pool/nodes.js';
import { Pool } from './pool/pool.js';
import { SnapshotStore } from './pool/snapshots.js';
import { QuiesceBoard } from './pool/quiesce.js';
import { VolumeStore } from './pool/volumes.js';
import { buildService, type CallDeps } from './server/call.js';
import { InFlight } from './server/inflight.js';
import { listen, stop } from './server/server.js';
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
  readonly pool: Pool;
  readonly inFlightCalls: () => number;
  stop(): Promise<void>;
}

export async function startDriver(
  config: Config,
  log: Logger,
  options: DriverOptions = {},
): Promise<RunningDriver> {
  // A node plugin's successor on the same host (a new container) takes over its locks at once.
  const role = servesNode(config) && config.nodeId !== undefined ? `node:${config.nodeId}` : undefined;
  const pool = await Pool.open(config.poolDir, config.poolName, log, role ? { role } : {});
  const runner = options.runner ?? new ExecRunner();
  const inflight = new InFlight();
  const capacityProbe = servesController(config)
    ? () => new Capacity(pool.layout, config.overcommitRatio).report()
    : undefined;
  const metrics = config.metricsAddress
    ? new Metrics(capacityProbe, async () => (await pool.quarantined()).length)
    : undefined;
  const quarantined = await pool.quarantined();
  if (quarantined.length > 0) {
    log.warn(
      { quarantined: quarantined.map((q) => `${pool.layout.quarantineDir}/${q}`) },
      'the pool holds quarantined records (unreadable, kept instead of deleted); an operator must restore or remove them',
    );
  }
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

  const readiness = new Readiness(pool, config.mode);
  const proto = csiProto().csi.v1;
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
  const capacity = new Capacity(pool.layout, config.overcommitRatio);
  const nodes = new NodeRegistry(pool.layout);
  const volumes = new VolumeStore(pool, capacity, nodes, log);
  const snapshots = new SnapshotStore(pool, log);
  const board = new QuiesceBoard(pool);
  const startup = startupContext(log, runner);
  let agent: QuiesceAgent | undefined;
  if (servesController(config)) {
    const copy = {
      pool,
      volumes,
      board,
      freezeBudgetMs: config.freezeBudgetMs,
      freezeWaitMs: FREEZE_WAIT_MS,
      requester: `controller on ${os.hostname()}`,
    };
    const inUseHere = async (image: string): Promise<string | undefined> => {
      const loops = await loopsBackedBy(kernelHost, startup, image);
      return loops.length > 0 ? `attached as ${loops.map((l) => l.path).join(', ')}` : undefined;
    };
    const controller = controllerService({ ...copy, config, snapshots, nodes, capacity, inUseHere });
    const group = groupService({ ...copy, snapshots });
    server.addService(
      proto.Controller.service,
      buildService<ControllerHandlers>('Controller', proto.Controller.service, controller, deps),
    );
    server.addService(
      proto.GroupController.service,
      buildService<GroupControllerHandlers>('GroupController', proto.GroupController.service, group, deps),
    );
  }
  if (servesNode(config)) {
    const nodeId = config.nodeId;
    if (nodeId === undefined) throw new Error('the node service needs --nodeid');
    await nodes.register(nodeId, config.poolName, config.maxVolumesPerNode);
    const nodeDeps: NodeDeps = {
      nodeId,
      poolName: config.poolName,
      maxVolumesPerNode: config.maxVolumesPerNode,
      loopDirectIo: config.loopDirectIo,
      volumes,
      nodes,
      host: kernelHost,
      poolRoot: pool.root,
    };
    await thawLeftovers(nodeDeps, startup);
    agent = new QuiesceAgent(nodeDeps, board, inflight, runner, log);
    await agent.start();
    const node = nodeService(nodeDeps);
    server.addService(proto.Node.service, buildService<NodeHandlers>('Node', proto.Node.service, node, deps));
  }

  await listen(server, config.endpoint, log);
  let metricsServer: http.Server | undefined;
  if (metrics && config.metricsAddress) {
    metricsServer = await serveMetrics(metrics, config.metricsAddress, () => readiness.problem(), log);
  }
  log.info(
    {
      endpoint: config.endpoint,
      pool: pool.root,
      poolName: config.poolName,
      version: driverVersion(),
      metrics: config.metricsAddress,
    },
    'loopvol is serving',
  );

  return {
    pool,
    inFlightCalls: () => active,
    async stop() {
      if (active > 0) log.info({ inFlight: active }, 'waiting for calls in flight');
      metricsServer?.close();
      await stop(server, config.endpoint, config.shutdownTimeoutMs, log);
      await agent?.stop();
    },
  };
}
