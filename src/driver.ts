/**
 * Wires one driver process: the pool, the services its --mode serves, the gRPC server on the endpoint,
 * and the optional metrics server; and takes them down again.
 */
import type http from 'node:http';
import * as grpc from '@grpc/grpc-js';
import type { Logger } from 'pino';
import { type Config, servesController, servesNode } from './config.js';
import { identityService } from './csi/identity.js';
import { csiProto } from './csi/proto.js';
import { ExecRunner, type Runner } from './exec/runner.js';
import type { ControllerHandlers } from './gen/csi/v1/Controller.js';
import type { GroupControllerHandlers } from './gen/csi/v1/GroupController.js';
import type { IdentityHandlers } from './gen/csi/v1/Identity.js';
import type { NodeHandlers } from './gen/csi/v1/Node.js';
import { readinessProblem } from './health.js';
import { Metrics, serveMetrics } from './metrics.js';
import { Pool } from './pool/pool.js';
import { buildService, type CallDeps, type Methods } from './server/call.js';
import { InFlight } from './server/inflight.js';
import { listen, stop } from './server/server.js';
import { driverVersion } from './version.js';

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
  const pool = await Pool.open(config.poolDir, config.poolName, log);
  const runner = options.runner ?? new ExecRunner();
  const metrics = config.metricsAddress ? new Metrics() : undefined;
  let active = 0;
  const deps: CallDeps = {
    log,
    runner,
    inflight: new InFlight(),
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

  const proto = csiProto().csi.v1;
  const server = new grpc.Server({ 'grpc.max_receive_message_length': 4 * 1024 * 1024 });
  server.addService(
    proto.Identity.service,
    buildService<IdentityHandlers>(
      'Identity',
      proto.Identity.service,
      identityService({ config, pool, version: driverVersion() }),
      deps,
    ),
  );
  if (servesController(config)) {
    const controller: Methods<ControllerHandlers> = {};
    const group: Methods<GroupControllerHandlers> = {};
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
    const node: Methods<NodeHandlers> = {};
    server.addService(proto.Node.service, buildService<NodeHandlers>('Node', proto.Node.service, node, deps));
  }

  await listen(server, config.endpoint, log);
  let metricsServer: http.Server | undefined;
  if (metrics && config.metricsAddress) {
    metricsServer = await serveMetrics(
      metrics,
      config.metricsAddress,
      () => readinessProblem(pool, config.mode),
      log,
    );
  }
  log.info(
    {
      endpoint: config.endpoint,
      mode: config.mode,
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
    },
  };
}
