#!/usr/bin/env node
// loopvol benchmarks: each number next to its floor (the same work done by the tools themselves), measured
// in the same run, interleaved, so the ratio means something on a noisy machine.
//
//   npm run bench -- [results.json] [--quick]
//
// Needs root, loop devices, mkfs.ext4/xfs and fio. Cleans up every loop device, mount and file it made.
import { execFileSync, spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import { csiProto } from '../dist/server/proto.js';

const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const args = process.argv.slice(2);
const QUICK = args.includes('--quick');
const OUT = args.find((a) => !a.startsWith('--')) ?? path.join(REPO, 'bench', 'results.json');
const MiB = 2 ** 20;
const GiB = 2 ** 30;
const REPS = QUICK ? 3 : 9;

const sh = (cmd, argv) => execFileSync(cmd, argv, { encoding: 'utf8', env: { ...process.env, LC_ALL: 'C' } });
const now = () => performance.now();
const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor((s.length - 1) / 2)];
};
const p95 = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.ceil(s.length * 0.95) - 1)];
};
const round = (x, d = 1) => Math.round(x * 10 ** d) / 10 ** d;

// ---------------------------------------------------------------------------------------------
// The driver under test, over its real socket.

function client(endpoint) {
  const v1 = csiProto().csi.v1;
  const creds = grpc.credentials.createInsecure();
  const make = (Ctor) => {
    const c = new Ctor(endpoint, creds);
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
  return { identity: make(v1.Identity), controller: make(v1.Controller), node: make(v1.Node) };
}

async function startDriver(dir, extra = []) {
  const socket = path.join(dir, `csi-${Math.random().toString(36).slice(2)}.sock`);
  const proc = spawn(
    process.execPath,
    [
      path.join(REPO, 'dist', 'main.js'),
      `--endpoint=unix://${socket}`,
      '--nodeid=bench-node',
      `--pool-dir=${path.join(dir, 'pool')}`,
      '--log-level=warn',
      '--max-volumes-per-node=100000',
      ...extra,
    ],
    { stdio: ['ignore', 'ignore', 'inherit'] },
  );
  const c = client(`unix://${socket}`);
  for (let i = 0; i < 200; i++) {
    try {
      await c.identity.GetPluginInfo({});
      break;
    } catch {
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  return {
    proc,
    c,
    pool: path.join(dir, 'pool'),
    async stop() {
      proc.kill('SIGTERM');
      await new Promise((r) => proc.once('exit', r));
    },
  };
}

function procStats(pid) {
  const status = execFileSync('cat', [`/proc/${pid}/status`], { encoding: 'utf8' });
  const rss = Number(/VmRSS:\s+(\d+)/.exec(status)?.[1] ?? 0) * 1024;
  const stat = execFileSync('cat', [`/proc/${pid}/stat`], { encoding: 'utf8' });
  const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  const ticks = Number(f[11]) + Number(f[12]);
  return { rssMiB: round(rss / MiB), cpuSeconds: round(ticks / 100, 2) };
}

// ---------------------------------------------------------------------------------------------
// 1 & 2. Provision-to-writable and teardown, against the same steps run by hand.

const capOf = (kind) =>
  kind === 'block'
    ? { block: {}, access_mode: { mode: 'SINGLE_NODE_WRITER' } }
    : { mount: { fs_type: kind, mount_flags: [] }, access_mode: { mode: 'SINGLE_NODE_WRITER' } };

/** NodeStageVolume then NodePublishVolume, as the kubelet calls them. */
async function stageAndPublish(d, id, cap, staging, target) {
  await d.c.node.NodeStageVolume({ volume_id: id, staging_target_path: staging, volume_capability: cap });
  await d.c.node.NodePublishVolume({
    volume_id: id,
    staging_target_path: staging,
    target_path: target,
    volume_capability: cap,
  });
}

async function driverCycle(d, dir, kind, size, n) {
  const cap = capOf(kind);
  const staging = path.join(dir, `st-${n}`);
  const target = path.join(dir, `pod-${n}`, 'mount');
  await fs.mkdir(staging, { recursive: true });
  await fs.mkdir(path.dirname(target), { recursive: true });
  const t0 = now();
  const v = await d.c.controller.CreateVolume({
    name: `bench-${kind}-${size}-${n}`,
    capacity_range: { required_bytes: String(size) },
    volume_capabilities: [cap],
  });
  const id = v.volume.volume_id;
  await d.c.controller.ControllerPublishVolume({
    volume_id: id,
    node_id: 'bench-node',
    volume_capability: cap,
  });
  await stageAndPublish(d, id, cap, staging, target);
  const up = now() - t0;
  const t1 = now();
  await d.c.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
  await d.c.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
  await d.c.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'bench-node' });
  await d.c.controller.DeleteVolume({ volume_id: id });
  const down = now() - t1;
  return { up, down };
}

/** The floor: the commands the driver runs, with the same options, and nothing else. */
function floorCycle(dir, kind, size, n) {
  const img = path.join(dir, `floor-${n}.img`);
  const staging = path.join(dir, `fst-${n}`);
  const target = path.join(dir, `fpod-${n}`);
  const t0 = now();
  sh('truncate', ['-s', String(size), img]);
  const dev = sh('losetup', ['--find', '--show', '--direct-io=on', img]).trim();
  if (kind === 'block') {
    sh('touch', [target]);
    sh('mount', ['--bind', dev, target]);
  } else {
    if (kind === 'ext4')
      sh('mkfs.ext4', ['-q', '-b', '4096', '-m', '0', '-E', 'nodiscard,assume_storage_prezeroed=1', dev]);
    else sh('mkfs.xfs', ['-q', '-K', dev]);
    sh('mkdir', ['-p', staging, target]);
    sh('mount', ['-t', kind, ...(kind === 'xfs' ? ['-o', 'nouuid'] : []), dev, staging]);
    sh('mount', ['--bind', staging, target]);
  }
  const up = now() - t0;
  const t1 = now();
  sh('umount', [target]);
  if (kind !== 'block') sh('umount', [staging]);
  sh('losetup', ['--detach', dev]);
  sh('rm', ['-rf', img, target, staging]);
  const down = now() - t1;
  return { up, down };
}

async function lifecycle(dir, results) {
  const d = await startDriver(dir);
  const rows = [];
  for (const kind of ['ext4', 'xfs', 'block']) {
    for (const size of [1 * GiB, 10 * GiB]) {
      const drv = { up: [], down: [] };
      const flr = { up: [], down: [] };
      await driverCycle(d, dir, kind, size, `warm-${kind}-${size}`); // warm caches and code paths
      for (let i = 0; i < REPS; i++) {
        const a = await driverCycle(d, dir, kind, size, `${kind}-${size}-${i}`);
        const b = floorCycle(dir, kind, size, `${kind}-${size}-${i}`);
        drv.up.push(a.up);
        drv.down.push(a.down);
        flr.up.push(b.up);
        flr.down.push(b.down);
      }
      for (const [what, dv, fv] of [
        ['provision-to-writable', drv.up, flr.up],
        ['teardown', drv.down, flr.down],
      ]) {
        rows.push({
          bench: what,
          kind,
          size: `${size / GiB} GiB`,
          driverMedianMs: round(median(dv)),
          driverP95Ms: round(p95(dv)),
          floorMedianMs: round(median(fv)),
          floorP95Ms: round(p95(fv)),
          ratio: round(median(dv) / median(fv), 2),
        });
      }
    }
  }
  await d.stop();
  results.lifecycle = rows;
  console.table(rows);
}

// ---------------------------------------------------------------------------------------------
// 3. Control-plane throughput, and the gRPC floor.

async function populate(d, count, start) {
  const cap = capOf('block');
  for (let i = 0; i < count; i += 64) {
    await Promise.all(
      Array.from({ length: Math.min(64, count - i) }, (_, j) =>
        d.c.controller.CreateVolume({
          name: `fill-${start + i + j}`,
          capacity_range: { required_bytes: String(MiB) },
          volume_capabilities: [cap],
        }),
      ),
    );
  }
}

async function throughput(d, concurrency, ops) {
  const cap = capOf('block');
  let next = 0;
  const t0 = now();
  await Promise.all(
    Array.from({ length: concurrency }, async (_, w) => {
      while (next < ops) {
        const n = next++;
        const v = await d.c.controller.CreateVolume({
          name: `tp-${concurrency}-${w}-${n}`,
          capacity_range: { required_bytes: String(MiB) },
          volume_capabilities: [cap],
        });
        await d.c.controller.DeleteVolume({ volume_id: v.volume.volume_id });
      }
    }),
  );
  return round((ops * 2) / ((now() - t0) / 1000));
}

async function rpcRate(fn, concurrency, ops) {
  let next = 0;
  const t0 = now();
  await Promise.all(
    Array.from({ length: concurrency }, async () => {
      while (next++ < ops) await fn();
    }),
  );
  return round(ops / ((now() - t0) / 1000));
}

async function controlPlane(dir, results) {
  const d = await startDriver(dir);
  const rows = [];
  const idle = procStats(d.proc.pid);
  let have = 0;
  const OPS = QUICK ? 100 : 400;
  for (const poolSize of QUICK ? [0, 1000] : [0, 1000, 10000]) {
    await populate(d, poolSize - have, have);
    have = poolSize;
    if (poolSize === 1000) {
      // Resources: right after 1,000 CreateVolume calls (and the throughput run on the empty pool).
      results.resources = { idle, after1000Volumes: procStats(d.proc.pid) };
    }
    const row = { bench: 'create+delete ops/s', poolVolumes: poolSize };
    for (const c of [1, 8, 32]) row[`concurrency${c}`] = await throughput(d, c, OPS);
    rows.push(row);
  }
  rows.push({
    bench: 'Probe calls/s',
    poolVolumes: have,
    concurrency1: await rpcRate(() => d.c.identity.Probe({}), 1, 500),
    concurrency8: await rpcRate(() => d.c.identity.Probe({}), 8, 2000),
    concurrency32: await rpcRate(() => d.c.identity.Probe({}), 32, 4000),
  });
  rows.push({
    bench: 'NodeGetCapabilities calls/s',
    poolVolumes: have,
    concurrency1: await rpcRate(() => d.c.node.NodeGetCapabilities({}), 1, 500),
    concurrency8: await rpcRate(() => d.c.node.NodeGetCapabilities({}), 8, 2000),
    concurrency32: await rpcRate(() => d.c.node.NodeGetCapabilities({}), 32, 4000),
  });
  const t0 = now();
  const page = await d.c.controller.ListVolumes({ max_entries: 100 });
  rows.push({
    bench: 'ListVolumes page of 100 (ms)',
    poolVolumes: have,
    concurrency1: round(now() - t0),
    note: `${page.entries.length} entries`,
  });
  await d.stop();
  results.controlPlane = rows;
  console.table(rows);
  console.table([
    { state: 'idle', ...results.resources.idle },
    { state: 'after 1,000 volumes', ...results.resources.after1000Volumes },
  ]);
}

// ---------------------------------------------------------------------------------------------
// 4. Data path: fio on a published volume against fio on a file in the pool's own filesystem.

const FIO_JOBS = [
  ['randread 4k', ['--rw=randread', '--bs=4k', '--iodepth=32']],
  ['randwrite 4k', ['--rw=randwrite', '--bs=4k', '--iodepth=32']],
  ['read 1M', ['--rw=read', '--bs=1M', '--iodepth=8']],
  ['write 1M', ['--rw=write', '--bs=1M', '--iodepth=8']],
];

function fio(file, job) {
  const out = sh('fio', [
    '--name=bench',
    `--filename=${file}`,
    '--size=512M',
    '--direct=1',
    '--ioengine=libaio',
    `--runtime=${QUICK ? 2 : 5}`,
    '--time_based',
    '--group_reporting',
    '--output-format=json',
    ...job,
  ]);
  const j = JSON.parse(out).jobs[0];
  const side = j.read.io_bytes > 0 ? j.read : j.write;
  return { iops: Math.round(side.iops), mibps: round(side.bw_bytes / MiB) };
}

async function dataPath(dir, results) {
  const rows = [];
  for (const dio of ['on', 'off']) {
    const sub = path.join(dir, `dio-${dio}`);
    await fs.mkdir(sub, { recursive: true });
    const d = await startDriver(sub, [`--loop-direct-io=${dio}`]);
    const cap = capOf('ext4');
    const v = await d.c.controller.CreateVolume({
      name: 'fio',
      capacity_range: { required_bytes: String(2 * GiB) },
      volume_capabilities: [cap],
    });
    const id = v.volume.volume_id;
    const staging = path.join(sub, 'st');
    const target = path.join(sub, 'pod', 'mount');
    await fs.mkdir(staging, { recursive: true });
    await fs.mkdir(path.dirname(target), { recursive: true });
    await stageAndPublish(d, id, cap, staging, target);
    for (const [name, job] of FIO_JOBS) {
      const vol = fio(path.join(target, 'fio.dat'), job);
      const floor = fio(path.join(sub, 'floor-fio.dat'), job);
      rows.push({
        bench: `fio ${name}`,
        loopDirectIo: dio,
        volumeIops: vol.iops,
        volumeMiBps: vol.mibps,
        floorIops: floor.iops,
        floorMiBps: floor.mibps,
        ratio: round(vol.iops / floor.iops, 2),
      });
    }
    await d.c.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await d.c.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    await d.c.controller.DeleteVolume({ volume_id: id });
    await fs.rm(path.join(sub, 'floor-fio.dat'), { force: true });
    await d.stop();
  }
  results.dataPath = rows;
  console.table(rows);
}

// ---------------------------------------------------------------------------------------------
// 5. Snapshot time against data size, on a pool with reflink (XFS) and one without (ext4).

async function snapshots(dir, results) {
  const rows = [];
  for (const fsType of ['xfs', 'ext4']) {
    const sub = path.join(dir, `snap-${fsType}`);
    await fs.mkdir(path.join(sub, 'mnt'), { recursive: true });
    const img = path.join(sub, 'poolfs.img');
    sh('truncate', ['-s', '8G', img]);
    const dev = sh('losetup', ['--find', '--show', img]).trim();
    try {
      sh(
        fsType === 'xfs' ? 'mkfs.xfs' : 'mkfs.ext4',
        fsType === 'xfs' ? ['-q', '-m', 'reflink=1', dev] : ['-q', '-F', dev],
      );
      sh('mount', [dev, path.join(sub, 'mnt')]);
      const d = await startDriver(path.join(sub, 'mnt'));
      for (const mib of QUICK ? [64, 256] : [64, 256, 1024]) {
        const v = await d.c.controller.CreateVolume({
          name: `s-${mib}`,
          capacity_range: { required_bytes: String(2 * GiB) },
          volume_capabilities: [capOf('block')],
        });
        const image = path.join(d.pool, 'volumes', v.volume.volume_id, 'disk.img');
        sh('dd', [
          'if=/dev/urandom',
          `of=${image}`,
          'bs=1M',
          `count=${mib}`,
          'conv=notrunc,fsync',
          'status=none',
        ]);
        const before = Number(sh('df', ['-B1', '--output=used', path.join(sub, 'mnt')]).split('\n')[1]);
        const t0 = now();
        const s = await d.c.controller.CreateSnapshot({
          name: `snap-${mib}`,
          source_volume_id: v.volume.volume_id,
        });
        const ms = now() - t0;
        const after = Number(sh('df', ['-B1', '--output=used', path.join(sub, 'mnt')]).split('\n')[1]);
        rows.push({
          bench: 'CreateSnapshot',
          pool: fsType === 'xfs' ? 'xfs (reflink)' : 'ext4 (copy)',
          dataMiB: mib,
          volumeMiB: 2048,
          ms: round(ms),
          diskUsedMiB: round((after - before) / MiB),
        });
        await d.c.controller.DeleteSnapshot({ snapshot_id: s.snapshot.snapshot_id });
        await d.c.controller.DeleteVolume({ volume_id: v.volume.volume_id });
      }
      await d.stop();
    } finally {
      try {
        sh('umount', [path.join(sub, 'mnt')]);
      } catch {
        /* not mounted */
      }
      sh('losetup', ['--detach', dev]);
    }
  }
  results.snapshots = rows;
  console.table(rows);
}

// ---------------------------------------------------------------------------------------------

async function main() {
  if (process.getuid?.() !== 0) throw new Error('the benchmarks need root (loop devices, mkfs, mount)');
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-bench-'));
  const results = {
    machine: {
      cpus: os.cpus().length,
      memGiB: round(os.totalmem() / GiB),
      kernel: os.release(),
      node: process.version,
    },
    startedAt: new Date().toISOString(),
    quick: QUICK,
  };
  try {
    await lifecycle(await mk(dir, 'life'), results);
    await controlPlane(await mk(dir, 'cp'), results);
    await dataPath(await mk(dir, 'data'), results);
    await snapshots(await mk(dir, 'snap'), results);
  } finally {
    await cleanup(dir);
  }
  await fs.writeFile(OUT, `${JSON.stringify(results, null, 2)}\n`);
  console.log(`results written to ${OUT}`);
}

async function mk(dir, name) {
  const p = path.join(dir, name);
  await fs.mkdir(p, { recursive: true });
  return p;
}

/** Unmounts and detaches exactly what lives under the bench directory, then removes it. */
async function cleanup(dir) {
  const mounts = (await fs.readFile('/proc/self/mountinfo', 'utf8'))
    .split('\n')
    .map((l) => l.split(' ')[4])
    .filter((m) => m && (m === dir || m.startsWith(`${dir}/`)))
    .sort((a, b) => b.length - a.length);
  for (const m of mounts) {
    try {
      sh('umount', [m]);
    } catch {
      sh('umount', ['-l', m]);
    }
  }
  for (const name of await fs.readdir('/sys/block')) {
    if (!name.startsWith('loop')) continue;
    const backing = await fs.readFile(`/sys/block/${name}/loop/backing_file`, 'utf8').catch(() => '');
    if (backing.startsWith(`${dir}/`)) {
      try {
        sh('losetup', ['--detach', `/dev/${name}`]);
      } catch {
        /* gone */
      }
    }
  }
  await fs.rm(dir, { recursive: true, force: true });
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
