// What the benchmarks share: the driver and the bare server over their sockets, clients, statistics,
// and cleanup of exactly what a benchmark made.
import { execFileSync, spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import { csiProto } from '../dist/server/proto.js';

export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
export const MiB = 2 ** 20;
export const GiB = 2 ** 30;

export const sh = (cmd, argv) =>
  execFileSync(cmd, argv, { encoding: 'utf8', env: { ...process.env, LC_ALL: 'C' } });
export const now = () => performance.now();
export const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  if (s.length === 0) return NaN;
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
};
export const p95 = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.ceil(s.length * 0.95) - 1)];
};
export const round = (x, d = 1) => Math.round(x * 10 ** d) / 10 ** d;
export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * Channel options of the bench's clients: a failed connect is tried again within a quarter second,
 * not after grpc-js's 1 s growing by 1.6 each time, which could keep a poll for a slow start from
 * seeing the driver for seconds after it listened.
 */
export const CHANNEL_OPTIONS = {
  'grpc.initial_reconnect_backoff_ms': 100,
  'grpc.max_reconnect_backoff_ms': 250,
};

/** Promise-returning CSI clients (Identity, Controller, Node) on `endpoint`. */
export function client(endpoint) {
  const v1 = csiProto().csi.v1;
  const creds = grpc.credentials.createInsecure();
  const closers = [];
  const make = (Ctor) => {
    const c = new Ctor(endpoint, creds, CHANNEL_OPTIONS);
    closers.push(() => c.close());
    return new Proxy(
      {},
      {
        get: (_t, m) => (req) =>
          new Promise((resolve, reject) =>
            c[m](req, { deadline: new Date(Date.now() + 600_000) }, (err, res) =>
              err ? reject(err) : resolve(res),
            ),
          ),
      },
    );
  };
  return {
    identity: make(v1.Identity),
    controller: make(v1.Controller),
    node: make(v1.Node),
    close: () => closers.forEach((f) => f()),
  };
}

async function waitServing(c) {
  for (let i = 0; i < 400; i++) {
    try {
      await c.identity.GetPluginInfo({});
      return;
    } catch {
      await sleep(25);
    }
  }
  throw new Error('the server did not start');
}

function stopper(proc) {
  return async () => {
    if (proc.exitCode !== null || proc.pid === undefined) return;
    const exited = new Promise((r) => proc.once('exit', r));
    proc.kill('SIGTERM');
    await exited;
  };
}

/** The Node flags the driver runs with where it is deployed: `npm start` and the image's entrypoint. */
export const DEPLOYED_NODE_ARGS = ['--max-semi-space-size=1'];
/** The environment the image and `npm start` give the driver (Dockerfile): one glibc malloc arena. */
export const DEPLOYED_ENV = { MALLOC_ARENA_MAX: '1' };

/**
 * The real driver (dist/main.js), in a process of its own, serving a pool in `dir`/pool. With
 * `logs: true` its JSON log lines are collected in `lines` (pass --log-level=debug in `extra` to get
 * every command it runs, with its duration). `repo`: another checkout's build (bench/ab.mjs).
 * `nodeArgs` and `env` (over this process's; a variable given as undefined is left out): the Node flags
 * and environment it runs with, by default as deployed.
 */
export async function startDriver(
  dir,
  extra = [],
  nodeArgs = DEPLOYED_NODE_ARGS,
  { logs = false, repo = REPO, env = DEPLOYED_ENV } = {},
) {
  const socket = path.join(dir, `csi-${Math.random().toString(36).slice(2)}.sock`);
  const proc = spawn(
    process.execPath,
    [
      ...nodeArgs,
      path.join(repo, 'dist', 'main.js'),
      `--endpoint=unix://${socket}`,
      '--nodeid=bench-node',
      `--pool-dir=${path.join(dir, 'pool')}`,
      '--log-level=warn',
      '--max-volumes-per-node=100000',
      ...extra,
    ],
    { stdio: ['ignore', logs ? 'pipe' : 'ignore', 'inherit'], env: { ...process.env, ...env } },
  );
  const lines = [];
  if (logs) {
    let rest = '';
    proc.stdout.setEncoding('utf8');
    proc.stdout.on('data', (chunk) => {
      const parts = (rest + chunk).split('\n');
      rest = parts.pop();
      for (const l of parts) if (l.startsWith('{')) lines.push(JSON.parse(l));
    });
  }
  const c = client(`unix://${socket}`);
  await waitServing(c);
  const stop = stopper(proc);
  return {
    proc,
    c,
    lines,
    endpoint: `unix://${socket}`,
    pool: path.join(dir, 'pool'),
    async stop() {
      c.close();
      await stop();
    },
  };
}

/** A CSI server other than loopvol, started on a socket of its own under `dir`: `argv(socket)` runs it. */
async function startServer(dir, prefix, argv, env = {}) {
  const socket = path.join(dir, `${prefix}-${Math.random().toString(36).slice(2)}.sock`);
  const [cmd, ...args] = argv(socket);
  const proc = spawn(cmd, args, { stdio: ['ignore', 'ignore', 'inherit'], env: { ...process.env, ...env } });
  const failed = new Promise((_, reject) => proc.once('error', reject));
  failed.catch(() => {}); // an error after it serves is the stop's business
  const c = client(`unix://${socket}`);
  const stop = stopper(proc);
  try {
    await Promise.race([waitServing(c), failed]);
  } catch (err) {
    c.close();
    await stop();
    throw new Error(`${cmd} did not serve on ${socket}: ${err.message}`);
  }
  return {
    proc,
    c,
    endpoint: `unix://${socket}`,
    async stop() {
      c.close();
      await stop();
    },
  };
}

/** The floor of a call: bench/bare-server.mjs, constant answers on the same proto. */
export function startBare(dir, nodeArgs = DEPLOYED_NODE_ARGS, env = DEPLOYED_ENV) {
  return startServer(
    dir,
    'bare',
    (socket) => [
      process.execPath,
      ...nodeArgs,
      path.join(REPO, 'bench', 'bare-server.mjs'),
      `unix://${socket}`,
    ],
    env,
  );
}

/**
 * The Go reference driver (kubernetes-csi/csi-driver-host-path's hostpathplugin), when
 * LOOPVOL_BENCH_REFERENCE names a binary of it built outside this repository (bench/README.md says
 * how); undefined otherwise.
 */
const REFERENCE = process.env.LOOPVOL_BENCH_REFERENCE || undefined;

export async function startReference(dir) {
  if (!REFERENCE) return undefined;
  const state = path.join(dir, 'hostpath-state');
  await fs.mkdir(state, { recursive: true });
  return startServer(dir, 'hostpath', (socket) => [
    REFERENCE,
    `--endpoint=unix://${socket}`,
    '--nodeid=bench-node',
    `--statedir=${state}`,
  ]);
}

/** RSS (MiB) and CPU seconds of a process. */
export async function procStats(pid) {
  const status = await fs.readFile(`/proc/${pid}/status`, 'utf8');
  const rss = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? 0) * 1024;
  const stat = await fs.readFile(`/proc/${pid}/stat`, 'utf8');
  const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  const ticks = Number(f[11]) + Number(f[12]);
  return { rssMiB: round(rss / MiB), cpuSeconds: round(ticks / 100, 2) };
}

/** Calls per second of `fn` from `concurrency` callers, `ops` calls in all. */
export async function rpcRate(fn, concurrency, ops) {
  let next = 0;
  const t0 = now();
  await Promise.all(
    Array.from({ length: concurrency }, async () => {
      while (next++ < ops) await fn();
    }),
  );
  return ops / ((now() - t0) / 1000);
}

export const capOf = (kind) =>
  kind === 'block'
    ? { block: {}, access_mode: { mode: 'SINGLE_NODE_WRITER' } }
    : { mount: { fs_type: kind, mount_flags: [] }, access_mode: { mode: 'SINGLE_NODE_WRITER' } };

export async function mk(dir, name) {
  const p = path.join(dir, name);
  await fs.mkdir(p, { recursive: true });
  return p;
}

/** Loop devices whose backing file lies under `dir`. */
export async function loopsUnder(dir) {
  const out = [];
  for (const name of await fs.readdir('/sys/block')) {
    if (!name.startsWith('loop')) continue;
    const backing = await fs.readFile(`/sys/block/${name}/loop/backing_file`, 'utf8').catch(() => '');
    if (backing.startsWith(`${dir}/`)) out.push(`/dev/${name}`);
  }
  return out;
}

/** Mount points at or under `dir`, deepest first. */
export async function mountsUnder(dir) {
  return (await fs.readFile('/proc/self/mountinfo', 'utf8'))
    .split('\n')
    .map((l) => l.split(' ')[4])
    .filter((m) => m && (m === dir || m.startsWith(`${dir}/`)))
    .sort((a, b) => b.length - a.length);
}

/** Unmounts and detaches exactly what lives under `dir`, then removes it. */
export async function cleanup(dir) {
  for (const m of await mountsUnder(dir)) {
    try {
      sh('umount', [m]);
    } catch {
      sh('umount', ['-l', m]);
    }
  }
  for (const dev of await loopsUnder(dir)) {
    try {
      sh('losetup', ['--detach', dev]);
    } catch {
      /* gone */
    }
  }
  await fs.rm(dir, { recursive: true, force: true });
}

/** NodeStageVolume then NodePublishVolume, as the kubelet calls them. */
export async function stageAndPublish(d, id, cap, staging, target) {
  await d.c.node.NodeStageVolume({ volume_id: id, staging_target_path: staging, volume_capability: cap });
  await d.c.node.NodePublishVolume({
    volume_id: id,
    staging_target_path: staging,
    target_path: target,
    volume_capability: cap,
  });
}

/**
 * One volume through NodeStageVolume and NodeUnstageVolume on `d`, staged at `staging`: CreateVolume
 * and ControllerPublishVolume before, ControllerUnpublishVolume and DeleteVolume after, untimed.
 * Returns the volume's id and the two calls' times in ms.
 */
export async function stageUnstage(d, name, cap, sizeBytes, staging) {
  const v = await d.c.controller.CreateVolume({
    name,
    capacity_range: { required_bytes: String(sizeBytes) },
    volume_capabilities: [cap],
  });
  const id = v.volume.volume_id;
  const pub = await d.c.controller.ControllerPublishVolume({
    volume_id: id,
    node_id: 'bench-node',
    volume_capability: cap,
  });
  await fs.mkdir(staging, { recursive: true });
  const t0 = now();
  await d.c.node.NodeStageVolume({
    volume_id: id,
    staging_target_path: staging,
    volume_capability: cap,
    publish_context: pub.publish_context,
    volume_context: v.volume.volume_context,
  });
  const t1 = now();
  await d.c.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
  const t2 = now();
  await d.c.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'bench-node' });
  await d.c.controller.DeleteVolume({ volume_id: id });
  return { id, stageMs: t1 - t0, unstageMs: t2 - t1 };
}

/**
 * One volume through every call of its life on `d`, as the CO and the kubelet make them: CreateVolume,
 * ControllerPublishVolume, NodeStageVolume, NodePublishVolume, then NodeUnpublishVolume,
 * NodeUnstageVolume, ControllerUnpublishVolume, DeleteVolume. Returns each call's time in ms, by name.
 */
export async function lifecycleTimes(d, name, cap, sizeBytes, dir) {
  const ms = {};
  const timed = async (call, fn) => {
    const t0 = now();
    const out = await fn();
    ms[call] = now() - t0;
    return out;
  };
  const { controller: cs, node: ns } = d.c;
  const v = await timed('CreateVolume', () =>
    cs.CreateVolume({
      name,
      capacity_range: { required_bytes: String(sizeBytes) },
      volume_capabilities: [cap],
    }),
  );
  const id = v.volume.volume_id;
  const pub = await timed('ControllerPublishVolume', () =>
    cs.ControllerPublishVolume({ volume_id: id, node_id: 'bench-node', volume_capability: cap }),
  );
  const staging = path.join(dir, `st-${name}`);
  const target = path.join(dir, `tg-${name}`);
  await fs.mkdir(staging, { recursive: true });
  const ctx = { publish_context: pub.publish_context, volume_context: v.volume.volume_context };
  await timed('NodeStageVolume', () =>
    ns.NodeStageVolume({ volume_id: id, staging_target_path: staging, volume_capability: cap, ...ctx }),
  );
  await timed('NodePublishVolume', () =>
    ns.NodePublishVolume({
      volume_id: id,
      staging_target_path: staging,
      target_path: target,
      volume_capability: cap,
      ...ctx,
    }),
  );
  await timed('NodeUnpublishVolume', () => ns.NodeUnpublishVolume({ volume_id: id, target_path: target }));
  await timed('NodeUnstageVolume', () =>
    ns.NodeUnstageVolume({ volume_id: id, staging_target_path: staging }),
  );
  await timed('ControllerUnpublishVolume', () =>
    cs.ControllerUnpublishVolume({ volume_id: id, node_id: 'bench-node' }),
  );
  await timed('DeleteVolume', () => cs.DeleteVolume({ volume_id: id }));
  return ms;
}
