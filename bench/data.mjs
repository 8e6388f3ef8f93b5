// The data path: fio in a published ext4 volume, against the same stack built by hand (sparse image →
// losetup → mkfs.ext4 → mount, the driver's own options) and against the pool's filesystem itself.
//
// The hand-built stack is the kernel's floor for what the driver builds: the volume should equal it.
// Variants of the hand-built stack, each changing one thing, show what moves the floor: loop direct
// I/O off, a loop logical sector size equal to the pool filesystem's block size, the loop queue's
// scheduler and depth, the journal mode, online discard, lazy inode-table init, and a preallocated
// image. Each loop device's /sys/block/loopN/loop/dio is read after attaching: losetup falls back to
// buffered I/O silently when the backing file's alignment does not allow direct I/O, and the table says
// so. Sparse against preallocated also matters where a block of the image is written for the first
// time (the pool filesystem allocates it then), which fio's timed jobs never see (fio lays its file out
// before timing): "first write" times 512 MiB written into a fresh stack of each kind.
import fs from 'node:fs/promises';
import path from 'node:path';
import { GiB, MiB, capOf, median, now, round, sh, stageAndPublish, startDriver } from './lib.mjs';

const JOBS = [
  ['randread 4k', ['--rw=randread', '--bs=4k']],
  ['randwrite 4k', ['--rw=randwrite', '--bs=4k']],
  ['read 1M', ['--rw=read', '--bs=1M']],
  ['write 1M', ['--rw=write', '--bs=1M']],
];

const fioArgs = (file, extra) => [
  '--name=bench',
  `--filename=${file}`,
  '--size=512M',
  '--direct=1',
  '--ioengine=libaio',
  '--group_reporting',
  '--output-format=json',
  ...extra,
];

function fio(file, job, iodepth, runtime) {
  const out = sh(
    'fio',
    fioArgs(file, [`--iodepth=${iodepth}`, `--runtime=${runtime}`, '--time_based', ...job]),
  );
  const j = JSON.parse(out).jobs[0];
  const side = j.read.io_bytes > 0 ? j.read : j.write;
  return { iops: side.iops, mibps: side.bw_bytes / MiB };
}

/** MiB/s of 512 MiB written once, sequentially, into a new file, synced at the end. */
function firstWrite(file) {
  const t = now();
  sh('fio', fioArgs(file, ['--rw=write', '--bs=1M', '--iodepth=32', '--end_fsync=1']));
  return 512 / ((now() - t) / 1000);
}

/** The driver's mkfs.ext4 and mount arguments, read from its debug log. */
function driverCommands(lines) {
  const done = lines.filter((l) => l.msg === 'command finished');
  const mkfs = done.find((l) => l.command === 'mkfs.ext4');
  const mount = done.find((l) => l.command === 'mount' && l.args.includes('ext4'));
  const losetup = done.find((l) => l.command === 'losetup' && l.args.includes('--find'));
  return { mkfs, mount, losetup };
}

/** The hand-built stacks: the driver's options, then each with one thing changed. */
function variants(cmds, poolBlock) {
  const lo = cmds.losetup.args.filter((a) => a.startsWith('--direct-io'));
  return [
    { name: 'hand-built (same options)', losetup: lo },
    { name: 'loop direct I/O off', losetup: ['--direct-io=off'] },
    { name: `loop sector size ${poolBlock}`, losetup: [...lo, `--sector-size=${poolBlock}`] },
    { name: 'scheduler mq-deadline', losetup: lo, sysfs: { 'queue/scheduler': 'mq-deadline' } },
    { name: 'queue depth 32', losetup: lo, sysfs: { 'queue/nr_requests': '32' } },
    { name: 'data=writeback', losetup: lo, mount: ['data=writeback'] },
    { name: 'mount -o discard', losetup: lo, mount: ['discard'] },
    { name: 'lazy inode-table init', losetup: lo, ext: 'nodiscard,lazy_itable_init=1' },
    { name: 'preallocated image', losetup: lo, preallocate: true },
  ];
}

const sysfsOf = async (dev, file) =>
  (await fs.readFile(`/sys/block/${path.basename(dev)}/${file}`, 'utf8').catch(() => '?')).trim();

/** A hand-built ext4 on a loop device as `v` says: returns the mount point and a teardown. */
async function handBuilt(dir, name, cmds, v) {
  const image = path.join(dir, `${name}.img`);
  const mnt = path.join(dir, name);
  await fs.mkdir(mnt, { recursive: true });
  sh(v.preallocate ? 'fallocate' : 'truncate', [v.preallocate ? '-l' : '-s', String(2 * GiB), image]);
  const dev = sh('losetup', ['--find', '--show', ...v.losetup, image]).trim();
  try {
    for (const [file, value] of Object.entries(v.sysfs ?? {})) {
      await fs.writeFile(`/sys/block/${path.basename(dev)}/${file}`, value);
    }
    const mkfs = cmds.mkfs.args.slice(0, -1);
    if (v.ext) mkfs[mkfs.indexOf('-E') + 1] = v.ext;
    sh('mkfs.ext4', [...mkfs, dev]);
    const mount = cmds.mount.args.slice(0, -2);
    const o = mount.indexOf('-o');
    if (v.mount && o >= 0) mount[o + 1] = [mount[o + 1], ...v.mount].join(',');
    else if (v.mount) mount.push('-o', v.mount.join(','));
    sh('mount', [...mount, dev, mnt]);
  } catch (err) {
    sh('losetup', ['--detach', dev]);
    await fs.rm(image);
    throw err;
  }
  return {
    mnt,
    dev,
    dio: await sysfsOf(dev, 'loop/dio'),
    sector: await sysfsOf(dev, 'queue/logical_block_size'),
    async down() {
      sh('umount', [mnt]);
      sh('losetup', ['--detach', dev]);
      await fs.rm(image);
    },
  };
}

/** First-write MiB/s into fresh stacks of each variant named, `rounds` fresh stacks each. */
async function firstWrites(dir, cmds, vs, rounds) {
  const out = {};
  for (let r = 0; r < rounds; r++) {
    for (const v of vs) {
      const h = await handBuilt(dir, 'first-write', cmds, v);
      try {
        (out[v.name] ??= []).push(firstWrite(path.join(h.mnt, 'fio.dat')));
      } finally {
        await h.down();
      }
    }
  }
  return Object.fromEntries(Object.entries(out).map(([k, xs]) => [k, round(median(xs))]));
}

export async function dataPath(dir, results, { runtime = 3, rounds = 1, depths = [1, 32] }) {
  const d = await startDriver(dir, ['--log-level=debug'], undefined, { logs: true });
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
  const vs = variants(cmds, poolBlock);
  const stacks = [];
  const rows = [];
  const variantRows = [];
  let first = {};
  try {
    stacks.push({
      name: 'volume (loopvol)',
      dir: target,
      dio: await sysfsOf(volDev, 'loop/dio'),
      sector: await sysfsOf(volDev, 'queue/logical_block_size'),
    });
    for (const variant of vs) {
      const h = await handBuilt(dir, `hand-${stacks.length}`, cmds, variant);
      stacks.push({ name: variant.name, dir: h.mnt, dio: h.dio, sector: h.sector, down: h.down });
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
        const variantRow = { job, iodepth: depth };
        stacks.forEach((s, i) => {
          const val = value(samples[i]);
          if (i > 1 && i < stacks.length - 1) {
            variantRow[s.name] = round(val / floor, 2);
            return;
          }
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
        variantRows.push(variantRow);
      }
    }
    for (const s of stacks) {
      await fs.rm(path.join(s.dir, 'fio.dat'), { force: true });
      await s.down?.();
      s.down = undefined;
    }
    first = await firstWrites(dir, cmds, [vs[0], vs.at(-1)], rounds);
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
  const dios = Object.fromEntries(stacks.map((s) => [s.name, s.dio]));
  results.dataPath = {
    runtimeSeconds: runtime,
    rounds,
    poolBlockSize: Number(poolBlock),
    rows,
    variants: variantRows,
    loopDio: dios,
    firstWriteMiBps: first,
  };
  console.table(rows);
  console.log('the hand-built stack with one thing changed, as a ratio to the hand-built stack:');
  console.table(variantRows);
  console.log('loop dio per stack:', dios);
  console.log('first write of 512 MiB into a fresh stack, MiB/s:', first);
}
