// The data path: fio in a published ext4 volume, against the same stack built by hand (sparse image →
// losetup → mkfs.ext4 → mount, the driver's own options) and against the pool's filesystem itself.
//
// The hand-built stack is the kernel's floor for what the driver builds: the volume should equal it.
// Variants of the hand-built stack show what moves the floor: loop direct I/O off, and a loop logical
// sector size equal to the pool filesystem's block size. Each loop device's /sys/block/loopN/loop/dio
// is read after attaching: losetup falls back to buffered I/O silently when the backing file's
// alignment does not allow direct I/O, and the table says so.
import fs from 'node:fs/promises';
import path from 'node:path';
import { GiB, MiB, capOf, median, round, sh, stageAndPublish, startDriver } from './lib.mjs';

const JOBS = [
  ['randread 4k', ['--rw=randread', '--bs=4k']],
  ['randwrite 4k', ['--rw=randwrite', '--bs=4k']],
  ['read 1M', ['--rw=read', '--bs=1M']],
  ['write 1M', ['--rw=write', '--bs=1M']],
];

function fio(file, job, iodepth, runtime) {
  const out = sh('fio', [
    '--name=bench',
    `--filename=${file}`,
    '--size=512M',
    '--direct=1',
    '--ioengine=libaio',
    `--iodepth=${iodepth}`,
    `--runtime=${runtime}`,
    '--time_based',
    '--group_reporting',
    '--output-format=json',
    ...job,
  ]);
  const j = JSON.parse(out).jobs[0];
  const side = j.read.io_bytes > 0 ? j.read : j.write;
  return { iops: side.iops, mibps: side.bw_bytes / MiB };
}

/** The driver's mkfs.ext4 and mount arguments, read from its debug log. */
function driverCommands(lines) {
  const done = lines.filter((l) => l.msg === 'command finished');
  const mkfs = done.find((l) => l.command === 'mkfs.ext4');
  const mount = done.find((l) => l.command === 'mount' && l.args.includes('ext4'));
  const losetup = done.find((l) => l.command === 'losetup' && l.args.includes('--find'));
  return { mkfs, mount, losetup };
}

const dioOf = async (dev) =>
  (await fs.readFile(`/sys/block/${path.basename(dev)}/loop/dio`, 'utf8').catch(() => '?')).trim();
const sectorOf = async (dev) =>
  (await fs.readFile(`/sys/block/${path.basename(dev)}/queue/logical_block_size`, 'utf8')).trim();

/** A hand-built ext4 on a loop device: returns the mount point and a teardown. */
async function handBuilt(dir, name, cmds, losetupExtra) {
  const image = path.join(dir, `${name}.img`);
  const mnt = path.join(dir, name);
  await fs.mkdir(mnt, { recursive: true });
  sh('truncate', ['-s', String(2 * GiB), image]);
  const dev = sh('losetup', ['--find', '--show', ...losetupExtra, image]).trim();
  try {
    sh('mkfs.ext4', [...cmds.mkfs.args.slice(0, -1), dev]);
    sh('mount', [...cmds.mount.args.slice(0, -2), dev, mnt]);
  } catch (err) {
    sh('losetup', ['--detach', dev]);
    throw err;
  }
  return {
    mnt,
    dev,
    dio: await dioOf(dev),
    sector: await sectorOf(dev),
    async down() {
      sh('umount', [mnt]);
      sh('losetup', ['--detach', dev]);
      await fs.rm(image);
    },
  };
}

export async function dataPath(dir, results, { runtime = 3, rounds = 1, depths = [1, 32] }) {
  const d = await startDriver(dir, ['--log-level=debug'], [], { logs: true });
  const cap = capOf('ext4');
  const v = await d.c.controller.CreateVolume({
    name: 'fio',
    capacity_range: { required_bytes: String(2 * GiB) },
    volume_capabilities: [cap],
  });
  const id = v.volume.volume_id;
  const staging = path.join(dir, 'st');
  const target = path.join(dir, 'pod', 'mount');
  await fs.mkdir(staging, { recursive: true });
  await fs.mkdir(path.dirname(target), { recursive: true });
  await d.c.controller.ControllerPublishVolume({
    volume_id: id,
    node_id: 'bench-node',
    volume_capability: cap,
  });
  await stageAndPublish(d, id, cap, staging, target);
  const cmds = driverCommands(d.lines);
  const volDev = cmds.mount.args.at(-2);
  const poolBlock = sh('stat', ['-f', '-c', '%S', d.pool]).trim();
  const stacks = [];
  const rows = [];
  try {
    stacks.push({
      name: 'volume (loopvol)',
      dir: target,
      dio: await dioOf(volDev),
      sector: await sectorOf(volDev),
    });
    const losetupFlags = cmds.losetup.args.filter((a) => a.startsWith('--direct-io'));
    for (const [name, extra] of [
      ['hand-built (same options)', losetupFlags],
      ['hand-built, direct I/O off', ['--direct-io=off']],
      [`hand-built, sector ${poolBlock}`, [...losetupFlags, `--sector-size=${poolBlock}`]],
    ]) {
      const h = await handBuilt(dir, `hand-${stacks.length}`, cmds, extra);
      stacks.push({ name, dir: h.mnt, dio: h.dio, sector: h.sector, down: h.down });
    }
    const poolDir = path.join(dir, 'poolfs');
    await fs.mkdir(poolDir, { recursive: true });
    stacks.push({ name: 'pool filesystem', dir: poolDir, dio: '-', sector: '-' });

    for (const [job, args] of JOBS) {
      for (const depth of depths) {
        const samples = stacks.map(() => []);
        for (let r = 0; r < rounds; r++) {
          stacks.forEach((s, i) => samples[i].push(fio(path.join(s.dir, 'fio.dat'), args, depth, runtime)));
        }
        const value = (xs) => median(xs.map((x) => (job.endsWith('1M') ? x.mibps : x.iops)));
        const floor = value(samples[1]);
        const pool = value(samples.at(-1));
        stacks.forEach((s, i) => {
          const val = value(samples[i]);
          rows.push({
            job,
            iodepth: depth,
            stack: s.name,
            'loop dio': s.dio,
            sector: s.sector,
            value: job.endsWith('1M') ? `${round(val)} MiB/s` : `${Math.round(val)} IOPS`,
            'vs hand-built': round(val / floor, 2),
            'vs pool fs': round(val / pool, 2),
          });
        });
      }
    }
  } finally {
    for (const s of stacks) {
      await fs.rm(path.join(s.dir, 'fio.dat'), { force: true });
      await s.down?.();
    }
    await d.c.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await d.c.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    await d.c.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'bench-node' });
    await d.c.controller.DeleteVolume({ volume_id: id });
    await d.stop();
  }
  results.dataPath = { runtimeSeconds: runtime, rounds, poolBlockSize: Number(poolBlock), rows };
  console.table(rows);
}
