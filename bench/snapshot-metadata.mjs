#!/usr/bin/env node
// Changed block tracking: GetMetadataAllocated and GetMetadataDelta of a 10 GiB volume, every byte of it
// written, with 1% of it then rewritten in random 4 KiB blocks between the two snapshots. On a pool that
// shares extents (XFS with reflink) and on one that cannot (ext4), each in a file system of its own on a
// loop device. Time and ranges per call, bytes the driver read (its own count and /proc/<pid>/io),
// with the page cache dropped before each call (cold) and not (warm).
//
//   npm run build && node bench/snapshot-metadata.mjs [results.json] [--size-gib=10] [--reps=3]
//
// Needs root, loop devices, mkfs.xfs and mkfs.ext4, and about 50 GiB free under /tmp (sparse files).
// Removes every mount, loop device and file it made.
import { execFileSync, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import { csiProto } from '../dist/server/proto.js';
import { CHANNEL_OPTIONS } from './lib.mjs';

const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const args = process.argv.slice(2);
const OUT = args.find((a) => !a.startsWith('--')) ?? path.join(REPO, 'bench', 'snapshot-metadata.json');
const opt = (name, dflt) => Number(args.find((a) => a.startsWith(`--${name}=`))?.split('=')[1] ?? dflt);
const GiB = 2 ** 30;
const MiB = 2 ** 20;
const SIZE = opt('size-gib', 10) * GiB;
const REPS = opt('reps', 3);
const CHANGED = 0.01;
const BLOCK = 4096;

const sh = (cmd, argv) => execFileSync(cmd, argv, { encoding: 'utf8', env: { ...process.env, LC_ALL: 'C' } });
const now = () => performance.now();
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) / 2)];
const round = (x, d = 1) => Math.round(x * 10 ** d) / 10 ** d;
const rchar = async (pid) =>
  Number(/rchar: (\d+)/.exec(await fs.readFile(`/proc/${pid}/io`, 'utf8'))?.[1] ?? 0);
const dropCaches = async () => {
  sh('sync', []);
  await fs.writeFile('/proc/sys/vm/drop_caches', '3\n');
};

async function scratch(dir, fsType, sizeGiB) {
  const image = path.join(dir, `${fsType}.img`);
  const mnt = path.join(dir, `mnt-${fsType}`);
  await fs.mkdir(mnt, { recursive: true });
  sh('truncate', ['-s', `${sizeGiB}G`, image]);
  const dev = sh('losetup', ['--find', '--show', image]).trim();
  if (fsType === 'xfs') sh('mkfs.xfs', ['-q', '-m', 'reflink=1', dev]);
  else sh('mkfs.ext4', ['-q', '-F', dev]);
  sh('mount', [dev, mnt]);
  return {
    pool: path.join(mnt, 'pool'),
    remove: async () => {
      try {
        sh('umount', [mnt]);
      } finally {
        sh('losetup', ['-d', dev]);
        await fs.rm(image, { force: true });
      }
    },
  };
}

async function startDriver(dir, pool) {
  const socket = path.join(dir, `csi-${Math.random().toString(36).slice(2)}.sock`);
  const proc = spawn(
    process.execPath,
    [
      path.join(REPO, 'dist', 'main.js'),
      `--endpoint=unix://${socket}`,
      '--mode=controller',
      `--pool-dir=${pool}`,
      '--log-level=info',
    ],
    { stdio: ['ignore', 'pipe', 'inherit'] },
  );
  let out = '';
  proc.stdout.on('data', (b) => (out += b.toString()));
  const v1 = csiProto().csi.v1;
  const creds = grpc.credentials.createInsecure();
  const controller = new v1.Controller(`unix://${socket}`, creds, CHANNEL_OPTIONS);
  const identity = new v1.Identity(`unix://${socket}`, creds, CHANNEL_OPTIONS);
  const metadata = new v1.SnapshotMetadata(`unix://${socket}`, creds, CHANNEL_OPTIONS);
  const unary = (c, m) => (req) =>
    new Promise((resolve, reject) =>
      c[m](req, { deadline: new Date(Date.now() + 3_600_000) }, (err, res) =>
        err ? reject(err) : resolve(res),
      ),
    );
  for (let i = 0; ; i++) {
    try {
      await unary(identity, 'GetPluginInfo')({});
      break;
    } catch (err) {
      if (i >= 200 || proc.exitCode !== null) {
        await fs.rm(socket, { force: true });
        throw new Error(`the driver did not start: ${String(err)}`);
      }
      await new Promise((r) => setTimeout(r, 50));
    }
  }
  const stream = (m, req) =>
    new Promise((resolve, reject) => {
      let ranges = 0;
      let bytes = 0;
      let messages = 0;
      const s = metadata[m](req, { deadline: new Date(Date.now() + 3_600_000) });
      s.on('data', (msg) => {
        messages++;
        for (const b of msg.block_metadata) {
          ranges++;
          bytes += Number(b.size_bytes);
        }
      });
      s.on('error', reject);
      s.on('end', () => resolve({ ranges, bytes, messages }));
    });
  return {
    pid: proc.pid,
    createVolume: unary(controller, 'CreateVolume'),
    createSnapshot: unary(controller, 'CreateSnapshot'),
    stream,
    lastLine: (method) =>
      out
        .split('\n')
        .filter((l) => l.includes(`"method":"${method}"`))
        .map((l) => JSON.parse(l))
        .at(-1),
    async stop() {
      for (const c of [controller, identity, metadata]) c.close();
      if (proc.exitCode !== null || proc.signalCode !== null) return;
      const exited = new Promise((r) => proc.once('exit', r));
      proc.kill('SIGTERM');
      await exited;
    },
  };
}

/** Fills `file` with pseudo-random bytes (one random buffer, each chunk stamped with its index). */
async function fill(file, size) {
  const buf = randomBytes(64 * MiB);
  const h = await fs.open(file, 'r+');
  try {
    for (let off = 0, i = 0; off < size; off += buf.length, i++) {
      buf.writeUInt32LE(i, 0);
      for (let k = 4096; k < buf.length; k += 4096) buf.writeUInt32LE(i ^ k, k);
      await h.write(buf, 0, Math.min(buf.length, size - off), off);
    }
    await h.sync();
  } finally {
    await h.close();
  }
}

/** Rewrites CHANGED of the volume in random 4 KiB blocks; returns the distinct blocks touched. */
async function change(file, size) {
  const blocks = size / BLOCK;
  const n = Math.round((size * CHANGED) / BLOCK);
  const touched = new Set();
  const h = await fs.open(file, 'r+');
  try {
    for (let i = 0; i < n; i++) {
      const b = Math.floor(Math.random() * blocks);
      touched.add(b);
      await h.write(randomBytes(BLOCK), 0, BLOCK, b * BLOCK);
    }
    await h.sync();
  } finally {
    await h.close();
  }
  return touched.size;
}

async function benchPool(dir, fsType) {
  const sc = await scratch(
    dir,
    fsType,
    fsType === 'xfs' ? Math.ceil((SIZE * 1.2) / GiB) + 2 : Math.ceil((SIZE * 3.2) / GiB) + 2,
  );
  let d;
  try {
    d = await startDriver(dir, sc.pool);
    const vol = await d.createVolume({
      name: `cbt-bench-${fsType}`,
      capacity_range: { required_bytes: String(SIZE) },
      volume_capabilities: [{ block: {}, access_mode: { mode: 'SINGLE_NODE_WRITER' } }],
    });
    const image = path.join(sc.pool, 'volumes', vol.volume.volume_id, 'disk.img');
    let t = now();
    await fill(image, SIZE);
    console.error(`${fsType}: filled ${SIZE / GiB} GiB in ${round((now() - t) / 1000)} s`);
    t = now();
    const a = (await d.createSnapshot({ name: `a-${fsType}`, source_volume_id: vol.volume.volume_id }))
      .snapshot;
    const snapA = round(now() - t);
    const touched = await change(image, SIZE);
    t = now();
    const b = (await d.createSnapshot({ name: `b-${fsType}`, source_volume_id: vol.volume.volume_id }))
      .snapshot;
    const snapB = round(now() - t);
    console.error(`${fsType}: snapshots ${snapA} ms and ${snapB} ms; ${touched} blocks rewritten`);
    const rows = [];
    const measure = async (call, method, req, cache) => {
      const times = [];
      let last;
      for (let i = 0; i < REPS; i++) {
        if (cache === 'cold') await dropCaches();
        const r0 = await rchar(d.pid);
        const t0 = now();
        const res = await d.stream(method, req);
        const ms = now() - t0;
        await new Promise((r) => setTimeout(r, 100));
        const line = d.lastLine(method);
        times.push(ms);
        last = { ...res, via: line?.via, bytesRead: line?.bytesRead ?? 0, rchar: (await rchar(d.pid)) - r0 };
      }
      rows.push({
        pool: fsType === 'xfs' ? 'xfs (reflink)' : 'ext4 (no reflink)',
        call,
        cache,
        via: last.via,
        medianMs: round(median(times)),
        ranges: last.ranges,
        reportedMiB: round(last.bytes / MiB, 2),
        writtenMiB: round((touched * BLOCK) / MiB, 2),
        readMiB: round(last.bytesRead / MiB, 1),
        rcharMiB: round(last.rchar / MiB, 1),
      });
      console.error(JSON.stringify(rows.at(-1)));
    };
    for (const cache of ['cold', 'warm']) {
      await measure('allocated A', 'GetMetadataAllocated', { snapshot_id: a.snapshot_id }, cache);
      await measure(
        'delta A→B',
        'GetMetadataDelta',
        { base_snapshot_id: a.snapshot_id, target_snapshot_id: b.snapshot_id },
        cache,
      );
    }
    return { rows, snapshotMs: { a: snapA, b: snapB }, touchedBlocks: touched };
  } finally {
    await d?.stop();
    await sc.remove();
  }
}

const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-bench-cbt-'));
try {
  const results = { sizeBytes: SIZE, changedFraction: CHANGED, reps: REPS, pools: {} };
  for (const fsType of ['xfs', 'ext4']) results.pools[fsType] = await benchPool(dir, fsType);
  const rows = Object.values(results.pools).flatMap((p) => p.rows);
  console.log(
    '| pool | call | cache | method | time (median) | ranges | reported | rewritten | image bytes read | driver rchar |',
  );
  console.log('|---|---|---|---|---|---|---|---|---|---|');
  for (const r of rows)
    console.log(
      `| ${r.pool} | ${r.call} | ${r.cache} | ${r.via} | ${r.medianMs} ms | ${r.ranges} | ${r.reportedMiB} MiB | ${r.call.startsWith('delta') ? `${r.writtenMiB} MiB` : '—'} | ${r.readMiB} MiB | ${r.rcharMiB} MiB |`,
    );
  await fs.writeFile(OUT, `${JSON.stringify(results, null, 2)}\n`);
} finally {
  await fs.rm(dir, { recursive: true, force: true });
}
