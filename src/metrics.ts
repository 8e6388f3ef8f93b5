/** Prometheus /metrics, /healthz (ready: what Probe says) and /livez (alive) on --metrics-address. */
import http from 'node:http';
import type { Logger } from 'pino';
import { collectDefaultMetrics, Gauge, Histogram, Registry } from 'prom-client';
import type { CallObserver } from './server/call.js';

export class Metrics implements CallObserver {
  readonly registry = new Registry();
  private readonly rpc: Histogram;

  constructor(
    capacity?: () => Promise<{ totalBytes: number; availableBytes: number; freeBytes: number }>,
    quarantined?: () => Promise<number>,
  ) {
    collectDefaultMetrics({ register: this.registry, prefix: 'loopvol_' });
    this.rpc = new Histogram({
      name: 'loopvol_rpc_duration_seconds',
      help: 'CSI calls by service, method and final gRPC code',
      labelNames: ['service', 'method', 'code'],
      buckets: [0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60],
      registers: [this.registry],
    });
    if (capacity) {
      const gauge = new Gauge({
        name: 'loopvol_pool_bytes',
        help: 'Pool space: total and free on its filesystem, and available to new volumes after promises to sparse ones',
        labelNames: ['kind'],
        registers: [this.registry],
        async collect() {
          const c = await capacity();
          gauge.set({ kind: 'total' }, c.totalBytes);
          gauge.set({ kind: 'free' }, c.freeBytes);
          gauge.set({ kind: 'available' }, c.availableBytes);
        },
      });
    }
    if (quarantined) {
      const gauge = new Gauge({
        name: 'loopvol_quarantined_records',
        help: 'Directories in the pool quarantine/ (records that could not be read, kept for an operator); alert when above 0',
        registers: [this.registry],
        async collect() {
          gauge.set(await quarantined());
        },
      });
    }
  }

  observe(service: string, method: string, code: string, seconds: number): void {
    this.rpc.observe({ service, method, code }, seconds);
  }
}

export async function serveMetrics(
  metrics: Metrics,
  address: { host: string; port: number },
  healthProblem: () => Promise<string | undefined>,
  log: Logger,
): Promise<http.Server> {
  const server = http.createServer((req, res) => {
    const reply = (status: number, type: string, body: string): void => {
      res.writeHead(status, { 'content-type': type });
      res.end(body);
    };
    const handle = async (): Promise<void> => {
      if (req.url === '/metrics') {
        reply(200, metrics.registry.contentType, await metrics.registry.metrics());
      } else if (req.url === '/livez') {
        // Alive: the process answers. Not whether it can serve (that is /healthz, and Probe): a pool
        // that is not mounted yet must not get the process restarted over and over.
        reply(200, 'text/plain', 'alive\n');
      } else if (req.url === '/healthz') {
        const problem = await healthProblem();
        if (problem) reply(503, 'text/plain', `${problem}\n`);
        else reply(200, 'text/plain', 'ok\n');
      } else {
        reply(404, 'text/plain', 'not found\n');
      }
    };
    handle().catch((err: unknown) => {
      log.error({ err }, 'metrics request failed');
      reply(500, 'text/plain', 'error\n');
    });
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(address.port, address.host, () => {
      resolve();
    });
  });
  return server;
}
