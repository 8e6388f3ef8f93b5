// This checkout against another one (say a worktree of the previous commit), call for call:
//
//   npm run build && node bench/ab.mjs <other checkout, built> [ext4,xfs,btrfs,block] [rounds]
//
// Both drivers run at once, each on a pool of its own, as deployed (`npm start`'s Node flags and environment). Each
// round takes a volume on each through every call of its life (CreateVolume to DeleteVolume, timed
// one by one), the two drivers taking turns, first one then the other first: on a shared machine
// whose speed drifts by 2x within minutes, only calls made side by side compare. Prints the median of
// each call per driver and their ratio (this checkout / the other), and of provision-to-writable
// (CreateVolume to NodePublishVolume) and teardown (NodeUnpublishVolume to DeleteVolume) as sums.
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import {
  DEPLOYED_NODE_ARGS,
  GiB,
  REPO,
  capOf,
  cleanup,
  lifecycleTimes,
  median,
  startDriver,
} from './lib.mjs';

const PROVISION = ['CreateVolume', 'ControllerPublishVolume', 'NodeStageVolume', 'NodePublishVolume'];
const TEARDOWN = ['NodeUnpublishVolume', 'NodeUnstageVolume', 'ControllerUnpublishVolume', 'DeleteVolume'];
const sum = (t, calls) => calls.reduce((acc, c) => acc + t[c], 0);

const [other, kindList = 'ext4,xfs,btrfs,block', roundsArg = '15'] = process.argv.slice(2);
if (!other) {
  console.error('usage: node bench/ab.mjs <other checkout, built> [kinds] [rounds]');
  process.exit(2);
}
const rounds = Number(roundsArg);
const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-bench-ab-'));
const drivers = [];
try {
  for (const [name, repo] of [
    ['this', REPO],
    ['other', path.resolve(other)],
  ]) {
    const d = await startDriver(await fs.mkdtemp(path.join(dir, `${name}-`)), [], DEPLOYED_NODE_ARGS, {
      repo,
    });
    drivers.push({ name, repo, d });
  }
  const rows = [];
  for (const kind of kindList.split(',')) {
    const cap = capOf(kind);
    const ms = { this: {}, other: {} };
    // Round -1 warms both up, untimed.
    for (let i = -1; i < rounds; i++) {
      for (const { name, d } of i % 2 ? drivers : [...drivers].reverse()) {
        const t = await lifecycleTimes(d, `ab-${kind}-${i}`, cap, GiB, path.join(d.pool, '..'));
        if (i < 0) continue;
        t['provision-to-writable'] = sum(t, PROVISION);
        t.teardown = sum(t, TEARDOWN);
        for (const [call, v] of Object.entries(t)) (ms[name][call] ??= []).push(v);
      }
    }
    for (const call of Object.keys(ms.this)) {
      const a = median(ms.this[call]);
      const b = median(ms.other[call]);
      rows.push({
        call,
        kind,
        'this ms': Math.round(a * 10) / 10,
        'other ms': Math.round(b * 10) / 10,
        'this / other': Math.round((a / b) * 100) / 100,
      });
    }
  }
  console.log(`this: ${REPO}, other: ${path.resolve(other)}; medians of ${rounds} rounds`);
  console.table(rows);
} finally {
  for (const { d } of drivers) await d.stop();
  await cleanup(dir);
}
