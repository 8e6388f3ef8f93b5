// Memory: the driver's RSS idle and after many volumes, beside the bare grpc-js server (the least a
// Node.js CSI server holds), with Node's default flags, with flags for a small footprint, and with
// those flags and one glibc malloc arena (as deployed). The
// V8 heap (used/total) and what lies outside it (RSS minus heap: code, the proto's descriptors in
// native memory, malloc arenas, thread stacks) are read from the process itself through
// /metrics (prom-client's process and nodejs series).
/* global fetch */
import {
  capOf,
  DEPLOYED_ENV,
  DEPLOYED_NODE_ARGS,
  MiB,
  mk,
  procStats,
  round,
  rpcRate,
  sleep,
  startBare,
  startDriver,
} from './lib.mjs';
import { MIN_INTERVAL_MS, QUIET_MS } from '../dist/idle-gc.js';

/**
 * The Node flags of the image and `npm start` (see bench/README.md): a young generation of 1 MiB
 * semi-spaces instead of up to 16 MiB (V8 on 64 bits), which the driver's short-lived per-call garbage
 * never needs. No old-space limit: a limit turns a large pool into a crash.
 */
export const SMALL_FOOTPRINT = DEPLOYED_NODE_ARGS;

let port = 39480;

async function heapOf(metricsPort) {
  const text = await (await fetch(`http://127.0.0.1:${metricsPort}/metrics`)).text();
  const val = (name) => Number(new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, 'm').exec(text)?.[1] ?? NaN);
  return {
    heapUsedMiB: round(val('loopvol_nodejs_heap_size_used_bytes') / MiB),
    heapTotalMiB: round(val('loopvol_nodejs_heap_size_total_bytes') / MiB),
    externalMiB: round(val('loopvol_nodejs_external_memory_bytes') / MiB),
  };
}

async function settle(pid) {
  // RSS after the start's garbage has had a chance to go (a driver sits idle most of its life).
  await sleep(3000);
  return procStats(pid);
}

export async function resources(dir, results, { volumes = 1000 } = {}) {
  const rows = [];
  // Node's defaults, the deployed flags alone, and the flags with the deployed environment (one malloc
  // arena: DEPLOYED_ENV), each in a run of its own, one after the other. The first two leave malloc's
  // arenas at glibc's default even where this process was given the deployed environment.
  const glibcDefault = { MALLOC_ARENA_MAX: undefined, GLIBC_TUNABLES: undefined };
  for (const [flags, nodeArgs, env] of [
    ['default', [], glibcDefault],
    ['small footprint', SMALL_FOOTPRINT, glibcDefault],
    ['small footprint, one arena', SMALL_FOOTPRINT, DEPLOYED_ENV],
  ]) {
    const sub = await mk(dir, flags.replace(/\W/g, '-')); // a pool of its own: idle means empty
    const bare = await startBare(sub, nodeArgs, env);
    try {
      rows.push({ server: 'bare grpc-js', flags, state: 'idle', ...(await settle(bare.proc.pid)) });
    } finally {
      await bare.stop();
    }
    const metricsPort = port++;
    const d = await startDriver(sub, [`--metrics-address=127.0.0.1:${metricsPort}`], nodeArgs, { env });
    // A row of the driver's: its RSS and CPU after `wait`, and its V8 heap as /metrics gives it then.
    const reading = async (state, wait) => ({
      server: 'loopvol',
      flags,
      state,
      ...(await wait(d.proc.pid)),
      ...(await heapOf(metricsPort)),
    });
    try {
      rows.push(await reading('idle', settle));
      const cap = capOf('block');
      const base = `rss-${flags.replace(/\W/g, '')}`;
      for (let i = 0; i < volumes; i += 32) {
        await Promise.all(
          Array.from({ length: Math.min(32, volumes - i) }, (_, j) =>
            d.c.controller.CreateVolume({
              name: `${base}-${i + j}`,
              capacity_range: { required_bytes: String(MiB) },
              volume_capabilities: [cap],
            }),
          ),
        );
      }
      await d.c.controller.ListVolumes({});
      const burstEnded = Date.now();
      rows.push(await reading(`after ${volumes} CreateVolume + ListVolumes`, settle));
      // Once the driver collected its heap (src/idle-gc.ts: QUIET_MS without calls, at most every
      // MIN_INTERVAL_MS; its collection after the start may hold this one back that long), as the
      // container run reads it.
      const quietMs = MIN_INTERVAL_MS + QUIET_MS + 1000;
      await sleep(burstEnded + quietMs - Date.now());
      rows.push(await reading(`the same, ${quietMs / 1000} s without calls`, procStats));
      // What the flags cost in CPU: Probe from one client at c=32, CPU time of the driver per call.
      const calls = 20000;
      const cpu0 = (await procStats(d.proc.pid)).cpuSeconds;
      await rpcRate(() => d.c.identity.Probe({}), 32, calls);
      const probeCpuUs = Math.round((((await procStats(d.proc.pid)).cpuSeconds - cpu0) * 1e6) / calls);
      rows.at(-1)['Probe CPU µs/call'] = probeCpuUs;
    } finally {
      await d.stop();
    }
  }
  results.resources = { volumes, nodeFlags: SMALL_FOOTPRINT, env: DEPLOYED_ENV, rows };
  console.table(rows);
}
