// This checkout against another one (say a worktree of the previous commit), call for call:
//
//   npm run build && node bench/ab.mjs <other checkout, built> [ext4,xfs,btrfs,block] [rounds]
//
// Both drivers run at once, each on a pool of its own, as deployed (`npm start`'s Node flags). Each
// round provisions a volume on each (CreateVolume, ControllerPublishVolume: untimed), then times
// NodeStageVolume and NodeUnstageVolume, the two drivers taking turns, first one then the other
// first: on a shared machine whose speed drifts by 2x within minutes, only calls made side by side
// compare. Prints the median of each call per driver and their ratio (this checkout / the other).
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { GiB, REPO, capOf, cleanup, median, stageUnstage, startDriver } from './lib.mjs';

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
    const d = await startDriver(
      await fs.mkdtemp(path.join(dir, `${name}-`)),
      [],
      ['--max-semi-space-size=1'],
      {
        repo,
      },
    );
    drivers.push({ name, repo, d });
  }
  const rows = [];
  for (const kind of kindList.split(',')) {
    const cap = capOf(kind);
    const ms = { this: { stage: [], unstage: [] }, other: { stage: [], unstage: [] } };
    // Round -1 warms both up, untimed.
    for (let i = -1; i < rounds; i++) {
      for (const { name, d } of i % 2 ? drivers : [...drivers].reverse()) {
        const staging = path.join(d.pool, '..', `st-${kind}-${i}`);
        const t = await stageUnstage(d, `ab-${kind}-${i}`, cap, GiB, staging);
        if (i >= 0) {
          ms[name].stage.push(t.stageMs);
          ms[name].unstage.push(t.unstageMs);
        }
      }
    }
    for (const call of ['stage', 'unstage']) {
      const a = median(ms.this[call]);
      const b = median(ms.other[call]);
      rows.push({
        call: `Node${call === 'stage' ? 'Stage' : 'Unstage'}Volume`,
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
