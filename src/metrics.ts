/**
 * Prometheus /metrics, /healthz (ready: what Probe says) and /livez (alive) on --metrics-address.
 * The README's metrics table lists every series; names follow Prometheus conventions (base units in
 * the name, _total for counters).
 */
import http from 'node:http';
import type { Logger } from 'pino';
import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { Finding } from './audit/findings.js';
import type { PoolStats } from './audit/pool-stats.js';
import type { CallObserver } from './server/call.js';
import type { CopyPurpose, Telemetry } from './telemetry.js';

/** How long one scan of the pool serves scrapes (a scan reads every record and image). */
const POOL_SCAN_TTL_MS = 10_000;

export class Metrics implements CallObserver, Telemetry {
  readonly registry = new Registry();
  private readonly rpc: Histogram;
  private readonly inFlight: Gauge;
  private readonly abortedCalls: Counter;
  private readonly lockWait: Histogram;
  private readonly freezes: Counter;
  private readonly freezeDuration: Histogram;
  private readonly copyBytes: Counter;
  private readonly copyDuration: Histogram;
  private readonly findings: Gauge;
  private readonly kindsSeen = { pool: new Set<string>(), host: new Set<string>() };

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
    this.inFlight = new Gauge({
      name: 'loopvol_operations_in_flight',
      help: 'CSI calls running now, by service and method',
      labelNames: ['service', 'method'],
      registers: [this.registry],
    });
    this.abortedCalls = new Counter({
      name: 'loopvol_rpc_aborted_total',
      help: 'Calls answered ABORTED (another operation on the same volume was running; the CO retries), by service and method',
      labelNames: ['service', 'method'],
      registers: [this.registry],
    });
    this.lockWait = new Histogram({
      name: 'loopvol_lock_wait_seconds',
      help: 'Time spent waiting for a pool lock, by outcome: acquired, or busy (the call gave up with ABORTED)',
      labelNames: ['outcome'],
      buckets: [0.001, 0.01, 0.05, 0.2, 0.5, 1, 2, 10, 60, 120],
      registers: [this.registry],
    });
    this.freezes = new Counter({
      name: 'loopvol_freezes_total',
      help: 'Filesystems this node froze, by reason: copy (the instant of a snapshot or clone) or fence (for good, after a force-detach)',
      labelNames: ['reason'],
      registers: [this.registry],
    });
    this.freezeDuration = new Histogram({
      name: 'loopvol_freeze_duration_seconds',
      help: 'How long a filesystem stayed frozen for a copy, from freeze to thaw',
      buckets: [0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60],
      registers: [this.registry],
    });
    this.copyBytes = new Counter({
      name: 'loopvol_copy_bytes_total',
      help: 'Bytes read and written by image copies, by purpose (snapshot, clone, restore) and method (reflink copies 0 bytes, sparse-copy)',
      labelNames: ['purpose', 'method'],
      registers: [this.registry],
    });
    this.copyDuration = new Histogram({
      name: 'loopvol_copy_duration_seconds',
      help: 'How long image copies took, by purpose and method',
      labelNames: ['purpose', 'method'],
      buckets: [0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 1800],
      registers: [this.registry],
    });
    this.findings = new Gauge({
      name: 'loopvol_check_findings',
      help: 'What loopvol check finds, by scope (pool: the controller; host: the node plugin) and kind, as of the last look (at start, then every few minutes); see the README for each kind',
      labelNames: ['scope', 'kind'],
      registers: [this.registry],
    });
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

  begin(service: string, method: string): void {
    this.inFlight.inc({ service, method });
  }

  observe(service: string, method: string, code: string, seconds: number): void {
    this.rpc.observe({ service, method, code }, seconds);
    this.inFlight.dec({ service, method });
    if (code === 'ABORTED') this.abortedCalls.inc({ service, method });
  }

  lockWaited(seconds: number, acquired: boolean): void {
    this.lockWait.observe({ outcome: acquired ? 'acquired' : 'busy' }, seconds);
  }

  froze(reason: 'copy' | 'fence'): void {
    this.freezes.inc({ reason });
  }

  thawed(seconds: number): void {
    this.freezeDuration.observe(seconds);
  }

  copied(purpose: CopyPurpose, method: string, bytes: number, seconds: number): void {
    this.copyBytes.inc({ purpose, method }, bytes);
    this.copyDuration.observe({ purpose, method }, seconds);
  }

  /** What the last check found, for `scope` (the pool, or this host): replaces what it said before. */
  setFindings(scope: 'pool' | 'host', findings: readonly Finding[]): void {
    // A kind no longer found goes to 0, rather than keep its old count.
    const seen = this.kindsSeen[scope];
    for (const kind of seen) this.findings.set({ scope, kind }, 0);
    for (const f of findings) {
      seen.add(f.kind);
      this.findings.inc({ scope, kind: f.kind });
    }
  }

  /**
   * The pool in numbers (the controller): volumes and snapshots by state, provisioned and allocated
   * bytes, and, unless `perVolume` is false (very large pools), each volume's allocated bytes.
   */
  watchPool(stats: () => Promise<PoolStats | undefined>, perVolume: boolean): void {
    let cached: { at: number; value: Promise<PoolStats | undefined> } | undefined;
    const scan = (): Promise<PoolStats | undefined> => {
      if (!cached || performance.now() - cached.at > POOL_SCAN_TTL_MS) {
        const value = stats().catch(() => undefined);
        cached = { at: performance.now(), value };
      }
      return cached.value;
    };
    const byState = (name: string, help: string, pick: (s: PoolStats) => Map<string, number>): void => {
      const gauge: Gauge = new Gauge({
        name,
        help,
        labelNames: ['state'],
        registers: [this.registry],
        async collect() {
          const s = await scan();
          gauge.reset();
          if (s) for (const [state, n] of pick(s)) gauge.set({ state }, n);
        },
      });
    };
    byState(
      'loopvol_volumes',
      'Volumes in the pool by state: ready, creating, unreadable (record cannot be read), no-image, no-record, unfinished',
      (s) => s.volumes,
    );
    byState('loopvol_snapshots', 'Snapshots in the pool by state (as loopvol_volumes)', (s) => s.snapshots);
    const bytesGauge = (name: string, help: string, pick: (s: PoolStats) => Record<string, number>): void => {
      const gauge: Gauge = new Gauge({
        name,
        help,
        labelNames: ['kind'],
        registers: [this.registry],
        async collect() {
          const s = await scan();
          gauge.reset();
          if (s) for (const [kind, n] of Object.entries(pick(s))) gauge.set({ kind }, n);
        },
      });
    };
    bytesGauge(
      'loopvol_pool_provisioned_bytes',
      'Sizes of the images in the pool (what they may grow to), by kind: volume, snapshot',
      (s) => s.provisionedBytes,
    );
    bytesGauge(
      'loopvol_pool_allocated_bytes',
      'Bytes the images in the pool occupy on its filesystem, by kind: volume, snapshot',
      (s) => s.allocatedBytes,
    );
    if (!perVolume) return;
    const gauge: Gauge = new Gauge({
      name: 'loopvol_volume_allocated_bytes',
      help: "Bytes a volume's image occupies in the pool, with the PVC it was made for (--per-volume-metrics=false turns this off)",
      labelNames: ['volume_id', 'pvc_namespace', 'pvc_name'],
      registers: [this.registry],
      async collect() {
        const s = await scan();
        gauge.reset();
        for (const v of s?.perVolume ?? []) {
          gauge.set(
            { volume_id: v.id, pvc_namespace: v.pvcNamespace, pvc_name: v.pvcName },
            v.allocatedBytes,
          );
        }
      },
    });
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
