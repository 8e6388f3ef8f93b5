// Many at once: N volumes created, attached, staged and published concurrently on one node, then torn
// down concurrently, against the same N done by the shell floor in parallel (truncate, losetup, mkfs,
// mount, mount --bind; umount ×2, losetup -d, rm). Calls answered ABORTED are retried, as a CO does,
// and counted. Loop devices beyond the first eight are created on demand through /dev/loop-control.
import { execFile } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';
import { GiB, capOf, loopsUnder, mountsUnder, now, round, sleep, startDriver } from './lib.mjs';

const run = promisify(execFile);
const sh = async (cmd, argv) => (await run(cmd, argv, { env: { ...process.env, LC_ALL: 'C' } })).stdout;

export async function many(dir, results, { count = 64, kind = 'ext4', nodeArgs, repo } = {}) {
  const d = await startDriver(await mkdir(dir, 'driver'), [], nodeArgs, { repo });
  const cap = capOf(kind);
  const retries = {};
  const took = {}; // method -> ms of each call, retries included: where the total goes
  const call = async (svc, method, req) => {
    const started = now();
    for (let attempt = 0; ; attempt++) {
      try {
        const res = await d.c[svc][method](req);
        (took[method] ??= []).push(now() - started);
        return res;
      } catch (err) {
        if (err.code !== 10 || attempt > 100) throw err; // 10: ABORTED
        retries[method] = (retries[method] ?? 0) + 1;
        await sleep(20 + Math.random() * 30);
      }
    }
  };
  const rows = [];
  let ids = [];
  try {
    const t0 = now();
    ids = await Promise.all(
      Array.from({ length: count }, async (_, i) => {
        const v = await call('controller', 'CreateVolume', {
          name: `many-${i}`,
          capacity_range: { required_bytes: String(GiB) },
          volume_capabilities: [cap],
        });
        const id = v.volume.volume_id;
        const staging = await mkdir(dir, `st-${i}`);
        const target = path.join(await mkdir(dir, `pod-${i}`), 'mount');
        await call('controller', 'ControllerPublishVolume', {
          volume_id: id,
          node_id: 'bench-node',
          volume_capability: cap,
        });
        await call('node', 'NodeStageVolume', {
          volume_id: id,
          staging_target_path: staging,
          volume_capability: cap,
        });
        await call('node', 'NodePublishVolume', {
          volume_id: id,
          staging_target_path: staging,
          target_path: target,
          volume_capability: cap,
        });
        return { id, staging, target };
      }),
    );
    const up = now() - t0;
    const t1 = now();
    await Promise.all(
      ids.map(async ({ id, staging, target }) => {
        await call('node', 'NodeUnpublishVolume', { volume_id: id, target_path: target });
        await call('node', 'NodeUnstageVolume', { volume_id: id, staging_target_path: staging });
        await call('controller', 'ControllerUnpublishVolume', { volume_id: id, node_id: 'bench-node' });
        await call('controller', 'DeleteVolume', { volume_id: id });
      }),
    );
    const down = now() - t1;
    const leftLoops = (await loopsUnder(dir)).length;
    const leftMounts = (await mountsUnder(dir)).length;

    // The floor, in parallel.
    const f0 = now();
    const made = await Promise.all(
      Array.from({ length: count }, async (_, i) => {
        const img = path.join(dir, `floor-${i}.img`);
        const staging = await mkdir(dir, `fst-${i}`);
        const target = await mkdir(dir, `fpod-${i}`);
        await sh('truncate', ['-s', String(GiB), img]);
        const dev = (await sh('losetup', ['--find', '--show', '--direct-io=on', img])).trim();
        await sh(
          `mkfs.${kind}`,
          kind === 'ext4' ? ['-q', '-b', '4096', '-m', '0', '-E', 'nodiscard', dev] : ['-q', '-K', dev],
        );
        await sh('mount', ['-t', kind, dev, staging]);
        await sh('mount', ['--bind', staging, target]);
        return { img, dev, staging, target };
      }),
    );
    const fup = now() - f0;
    const f1 = now();
    await Promise.all(
      made.map(async ({ img, dev, staging, target }) => {
        await sh('umount', [target]);
        await sh('umount', [staging]);
        await sh('losetup', ['--detach', dev]);
        await fs.rm(img);
      }),
    );
    const fdown = now() - f1;
    rows.push({
      phase: `${count} × provision-to-writable (${kind}, 1 GiB)`,
      'driver s': round(up / 1000, 2),
      'floor s': round(fup / 1000, 2),
      ratio: round(up / fup, 2),
    });
    rows.push({
      phase: `${count} × teardown`,
      'driver s': round(down / 1000, 2),
      'floor s': round(fdown / 1000, 2),
      ratio: round(down / fdown, 2),
    });
    const perMethod = Object.entries(took).map(([method, ms]) => {
      const sorted = [...ms].sort((a, b) => a - b);
      return {
        method,
        'median ms': round(sorted[Math.floor(sorted.length / 2)], 1),
        'max ms': round(sorted.at(-1), 1),
      };
    });
    results.many = { count, kind, rows, perMethod, abortedRetries: retries, leftLoops, leftMounts };
    console.table(rows);
    console.table(perMethod);
    console.log(
      `ABORTED retries per method: ${JSON.stringify(retries)}; left behind by the driver: ${leftLoops} loop devices, ${leftMounts} mounts`,
    );
  } finally {
    await d.stop();
  }
}

async function mkdir(dir, name) {
  const p = path.join(dir, name);
  await fs.mkdir(p, { recursive: true });
  return p;
}
