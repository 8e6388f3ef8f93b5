// Per-call cost: Probe and NodeGetCapabilities calls per second, loopvol against the bare grpc-js
// server (bench/bare-server.mjs), both running, measured in alternation round after round. The load
// comes from two worker threads (one client alone cannot keep a server busy), and each server's CPU
// time per call is read from /proc, which machine noise moves less than the rate.
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Worker } from 'node:worker_threads';
import { median, now, procStats, round, startBare, startDriver, startReference } from './lib.mjs';

const WORKER = path.join(path.dirname(fileURLToPath(import.meta.url)), 'load-worker.mjs');

function loaders(endpoint, n) {
  const ws = Array.from({ length: n }, () => new Worker(WORKER, { workerData: { endpoint } }));
  return {
    /** Calls per second of `method` at `concurrency` spread over the workers. */
    async rate(method, concurrency, ops) {
      const t0 = now();
      const per = Math.max(1, Math.floor(concurrency / ws.length));
      const active = concurrency === 1 ? ws.slice(0, 1) : ws;
      await Promise.all(
        active.map(
          (w) =>
            new Promise((resolve) => {
              w.once('message', resolve);
              w.postMessage({
                method,
                concurrency: concurrency === 1 ? 1 : per,
                ops: Math.ceil(ops / active.length),
              });
            }),
        ),
      );
      return (Math.ceil(ops / active.length) * active.length) / ((now() - t0) / 1000);
    },
    async close() {
      await Promise.all(
        ws.map((w) => {
          const exited = new Promise((r) => w.once('exit', r));
          w.postMessage({ method: 'close' });
          return exited;
        }),
      );
    },
  };
}

const DEPLOYED = ['--metrics-address=127.0.0.1:39392', '--log-level=info'];

/**
 * `driverArgs`: loopvol as deployed (the manifests' --metrics-address and --log-level=info), so the
 * per-call metrics and the log level check are part of what is measured.
 */
export async function rpc(dir, results, { rounds, ops, driverArgs = DEPLOYED }) {
  const d = await startDriver(dir, driverArgs);
  const bare = await startBare(dir);
  const reference = await startReference(dir).catch(async (err) => {
    await Promise.all([d.stop(), bare.stop()]);
    throw err;
  });
  const servers = [
    ['loopvol', d, loaders(d.endpoint, 2)],
    ['bare', bare, loaders(bare.endpoint, 2)],
  ];
  if (reference) servers.push(['hostpath', reference, loaders(reference.endpoint, 2)]);
  const methods = ['Probe', 'NodeGetCapabilities'];
  const samples = {};
  const push = (key, v) => (samples[key] ??= []).push(v);
  try {
    // Warm up: until the JIT has settled, the first rounds run at half speed.
    for (let i = 0; i < 3; i++)
      for (const [, , l] of servers) for (const m of methods) await l.rate(m, 32, ops);
    for (let r = 0; r < rounds; r++) {
      for (const m of methods) {
        for (const c of [1, 32]) {
          const n = c === 1 ? Math.ceil(ops / 4) : ops;
          const order = r % 2 ? [...servers].reverse() : servers;
          for (const [who, s, l] of order) {
            const cpu0 = (await procStats(s.proc.pid)).cpuSeconds;
            push(`${m}|${c}|${who}`, await l.rate(m, c, n));
            const cpu1 = (await procStats(s.proc.pid)).cpuSeconds;
            push(`${m}|${c}|${who}|cpu`, ((cpu1 - cpu0) * 1e6) / n);
          }
        }
      }
    }
  } finally {
    for (const [, s, l] of servers) {
      await l.close();
      await s.stop();
    }
  }
  const rows = [];
  for (const m of methods) {
    for (const c of [1, 32]) {
      const drv = median(samples[`${m}|${c}|loopvol`]);
      const flr = median(samples[`${m}|${c}|bare`]);
      const ref = median(samples[`${m}|${c}|hostpath`] ?? []);
      rows.push({
        call: m,
        concurrency: c,
        'loopvol calls/s': Math.round(drv),
        'bare calls/s': Math.round(flr),
        ratio: round(drv / flr, 2),
        'loopvol CPU µs/call': Math.round(median(samples[`${m}|${c}|loopvol|cpu`])),
        'bare CPU µs/call': Math.round(median(samples[`${m}|${c}|bare|cpu`])),
        ...(reference && {
          'hostpath calls/s': Math.round(ref),
          'loopvol / hostpath': round(drv / ref, 2),
          'hostpath CPU µs/call': Math.round(median(samples[`${m}|${c}|hostpath|cpu`])),
        }),
        goal: c === 32 ? 'ratio >= 0.9' : '',
        rounds,
      });
    }
  }
  results.rpc = rows;
  console.table(rows);
}
