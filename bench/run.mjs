#!/usr/bin/env node
// loopvol benchmarks: each number next to its floor (the same work done by the tools themselves), measured
// in the same run, interleaved, so the ratio means something on a noisy machine.
//
//   npm run bench -- [results.json] [--quick] [--only=rpc,stage,lifecycle,many,control,resources,data,snapshots]
//
// Needs root, loop devices, mkfs.ext4/xfs and fio. Cleans up every loop device, mount and file it made.
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { dataPath } from './data.mjs';
import { many } from './many.mjs';
import {
  GiB,
  MiB,
  REPO,
  capOf,
  cleanup,
  median,
  mk,
  now,
  p95,
  round,
  sh,
  stageAndPublish,
  startDriver,
} from './lib.mjs';
import { resources } from './resources.mjs';
import { rpc } from './rpc.mjs';
import { stage } from './stage.mjs';

const PARTS = ['rpc', 'stage', 'lifecycle', 'many', 'control', 'resources', 'data', 'snapshots'];
const args = process.argv.slice(2);
const QUICK = args.includes('--quick');
const only = args
  .find((a) => a.startsWith('--only='))
  ?.slice('--only='.length)
  .split(',');
const bad = only?.filter((p) => !PARTS.includes(p)) ?? [];
if (bad.length > 0 || args.includes('--help')) {
  console.error(`usage: npm run bench -- [results.json] [--quick] [--only=${PARTS.join(',')}]`);
  process.exit(bad.length > 0 ? 2 : 0);
}
const OUT = args.find((a) => !a.startsWith('--')) ?? path.join(REPO, 'bench', 'results.json');
const REPS = QUICK ? 3 : 9;

// ---------------------------------------------------------------------------------------------
// Provision-to-writable and teardown, against the same steps run by hand.

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
    else sh(`mkfs.${kind}`, ['-q', '-K', dev]);
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
  try {
    for (const kind of ['ext4', 'xfs', 'btrfs', 'block']) {
      for (const size of QUICK ? [1 * GiB] : [1 * GiB, 10 * GiB]) {
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
  } finally {
    await d.stop();
  }
  results.lifecycle = rows;
  console.table(rows);
}

// ---------------------------------------------------------------------------------------------
// Control-plane throughput (the per-call floor is bench/rpc.mjs).

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

async function controlPlane(dir, results) {
  const d = await startDriver(dir);
  const rows = [];
  let have = 0;
  const OPS = QUICK ? 100 : 400;
  try {
    for (const poolSize of QUICK ? [0, 1000] : [0, 1000, 10000]) {
      await populate(d, poolSize - have, have);
      have = poolSize;
      const row = { bench: 'create+delete ops/s', poolVolumes: poolSize };
      for (const c of [1, 8, 32]) row[`concurrency${c}`] = await throughput(d, c, OPS);
      rows.push(row);
    }
    const t0 = now();
    const page = await d.c.controller.ListVolumes({ max_entries: 100 });
    rows.push({
      bench: 'ListVolumes page of 100 (ms)',
      poolVolumes: have,
      concurrency1: round(now() - t0),
      note: `${page.entries.length} entries`,
    });
  } finally {
    await d.stop();
  }
  results.controlPlane = rows;
  console.table(rows);
}

// ---------------------------------------------------------------------------------------------
// Snapshot time against data size, on a pool with reflink (XFS) and one without (ext4).

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
  const parts = {
    rpc: (sub) => rpc(sub, results, { rounds: QUICK ? 3 : 7, ops: QUICK ? 2000 : 6000 }),
    stage: (sub) => stage(sub, results, { reps: REPS }),
    lifecycle: (sub) => lifecycle(sub, results),
    many: (sub) => many(sub, results, { count: QUICK ? 16 : 64 }),
    control: (sub) => controlPlane(sub, results),
    resources: (sub) => resources(sub, results, { volumes: QUICK ? 200 : 1000 }),
    data: (sub) => dataPath(sub, results, { runtime: QUICK ? 1 : 2, rounds: QUICK ? 1 : 3 }),
    snapshots: (sub) => snapshots(sub, results),
  };
  try {
    for (const name of PARTS) {
      if (only && !only.includes(name)) continue;
      console.log(`\n== ${name}`);
      await parts[name](await mk(dir, name));
    }
  } finally {
    await cleanup(dir);
  }
  await fs.writeFile(OUT, `${JSON.stringify(results, null, 2)}\n`);
  console.log(`results written to ${OUT}`);
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
