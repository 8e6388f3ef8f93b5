/**
 * Wires one driver process: the pool, the services its --mode serves, the gRPC server on the endpoint,
 * and the optional metrics server; and takes them down again.
 *
 * A process whose pool is not there or does not answer serves Identity meanwhile (pool-open.ts).
 */
import type http from 'node:http';
import * as grpc from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { type Config, servesController, servesNode } from './config.js';
import { identityService } from './csi/identity.js';
import { snapshotMetadataRefusing } from './csi/snapshot-metadata.js';
import { CLEANUP_MS, ExecRunner, type Runner } from './exec/runner.js';
import { poolStats } from './audit/pool-stats.js';
import { type Reporter, startReports } from './audit/report.js';
import type { ControllerHandlers } from './gen/csi/v1/Controller.js';
import type { GroupControllerHandlers } from './gen/csi/v1/GroupController.js';
import type { IdentityHandlers } from './gen/csi/v1/Identity.js';
import type { NodeHandlers } from './gen/csi/v1/Node.js';
import type { SnapshotMetadataHandlers } from './gen/csi/v1/SnapshotMetadata.js';
import { type PoolState, Readiness } from './health.js';
import { heapSize, IdleCollector, v8FullCollection } from './idle-gc.js';
import { kernelHost } from './host/host.js';
import { Metrics, serveMetrics } from './metrics.js';
import { Capacity } from './pool/capacity.js';
import type { Pool } from './pool/pool.js';
import { openPool } from './pool-open.js';
import { refusing, serve, type Serving, stopServing } from './serving.js';
import { buildService, type CallDeps } from './server/call.js';
import { InFlight } from './server/inflight.js';
import { csiProto } from './server/proto.js';
import { awaitPredecessor } from './server/presence.js';
import { listen, stop } from './server/server.js';
import { buildStreamingService } from './server/stream.js';
import { setTelemetry } from './telemetry.js';
import { driverVersion } from './version.js';

/** How long the pool may take to answer at exit before the process is taken for blocked on it. */
const EXIT_CHECK_MS = 1_000;
export interface DriverOptions {
  runner?: Runner;
}

export interface RunningDriver {
  readonly inFlightCalls: () => number;
  stop(): Promise<void>;
  /**
   * After stop(): whether process.exit() can end the process. It waits for libuv's threads, and a
   * call, the pool's open or a look at the pool blocked on a pool that hangs holds one of them.
   */
  exitsCleanly(): Promise<boolean>;
}

export async function startDriver(
  config: Config,
  log: Logger,
  options: DriverOptions = {},
): Promise<RunningDriver> {
  // A node plugin's successor on the same host (a new container) takes over its locks at once, once
  // its predecessor is gone (one still finishing its calls holds what it works on): the role names
  // the presence it waited on. Any other lock of this host's containers is judged as another host's
  // (taken once unchanged for a lease), never taken at once.
  const presence =
    servesNode(config) && config.nodeId !== undefined && config.endpoint.kind === 'unix'
      ? await awaitPredecessor(config.endpoint.path, { ...config, nodeId: config.nodeId }, log)
      : undefined;
  const role = presence?.role;
  const runner = options.runner ?? new ExecRunner();
  const openOptions = { create: config.createPool, lock: role ? { role } : {}, runner };
  const inflight = new InFlight();
  let state: PoolState = { missing: 'The pool is not open yet' };
  let stopping = false;
  let serving: Serving | undefined;
  const opening = await openPool(config.poolDir, config.poolName, log, openOptions, {
    opened: async (pool, how) => {
      // Ready only once every service is there to serve it; nothing of it runs on once stopping began.
      const served = await serve(config, pool, log, runner, inflight);
      if (stopping) {
        await stopServing(served);
        return;
      }
      serving = served;
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
  const collect = v8FullCollection();
  const collector = collect
    ? new IdleCollector({ collect, heapSize, inFlight: () => active, log })
    : undefined;
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
        collector?.callEnded();
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
  collector?.start();
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
      stopping = true;
      collector?.stop();
      const halted = opening.stop();
      reporter?.stop();
      serving?.discarding?.stop();
      serving?.reserving?.stop();
      if (active > 0) log.info({ inFlight: active }, 'waiting for calls in flight');
      metricsServer?.close();
      await stop(server, config.endpoint, config.shutdownTimeoutMs, log);
      // Calls cancelled at the timeout undo what they did (a rollback has CLEANUP_MS of its own):
      // exiting first would leave their devices attached and their leases held.
      for (const until = Date.now() + CLEANUP_MS; active > 0 && Date.now() < until;)
        await new Promise((r) => setTimeout(r, 50));
      if (active > 0) log.warn({ inFlight: active }, 'calls were still undoing their work at exit');
      await halted;
      await stopServing(serving);
      if (metrics) setTelemetry(undefined);
      await presence?.leave();
    },
    async exitsCleanly() {
      if (active > 0 || opening.pending()) return false;
      return readiness.answers(EXIT_CHECK_MS);
    },
  };
}
