// NodeStageVolume and NodeUnstageVolume against their shell floor, per filesystem (and raw block).
//
// The driver runs at --log-level=debug so that every command it runs is in its log with its duration:
// the floor replays exactly those commands (losetup, mkfs, mount with the driver's own arguments, on a
// fresh image of the same size), and the table says where the driver's time goes: how many commands
// a call spawned, how long they took, and the rest (records, reads of /proc and /sys, gRPC).
// CreateVolume and ControllerPublishVolume run before each stage, untimed.
import fs from 'node:fs/promises';
import path from 'node:path';
import { GiB, capOf, median, now, round, sh, sleep, stageUnstage, startDriver } from './lib.mjs';

/** The commands a call ran, from the driver's debug log: [{ command, args, ms }]. */
function commandsOf(lines, method, volumeId) {
  const ids = new Set(
    lines
      .filter((l) => l.method === method && l.volume_id === volumeId && l.msg === 'call')
      .map((l) => l.reqId),
  );
  return lines.filter((l) => ids.has(l.reqId) && l.msg === 'command finished');
}

/** The floor of a stage: the driver's own losetup, mkfs and mount, on `image`; returns the device. */
function floorStage(cmds, image, staging) {
  const losetup = cmds.find((c) => c.command === 'losetup' && c.args.includes('--find'));
  const mkfs = cmds.find((c) => c.command.startsWith('mkfs.') && c.args.at(-1)?.startsWith('/dev/'));
  const mount = cmds.find((c) => c.command === 'mount');
  const driverDev = losetup.stdoutDevice;
  const dev = sh('losetup', [...losetup.args.slice(0, -1), image]).trim();
  const swap = (args) => args.map((a) => (a === driverDev ? dev : a === mount?.args.at(-1) ? staging : a));
  if (mkfs) sh(mkfs.command, swap(mkfs.args));
  if (mount) sh('mount', swap(mount.args));
  return dev;
}

async function waitLog(d, method, id) {
  for (let i = 0; i < 100; i++) {
    if (d.lines.some((l) => l.method === method && l.volume_id === id && l.msg === 'call')) return;
    await sleep(10);
  }
}

export async function stage(dir, results, { reps, kinds = ['ext4', 'xfs', 'btrfs', 'block'], sizeGiB = 1 }) {
  const d = await startDriver(dir, ['--log-level=debug'], undefined, { logs: true });
  const rows = [];
  const breakdown = [];
  try {
    for (const kind of kinds) {
      const cap = capOf(kind);
      const size = sizeGiB * GiB;
      const s = { stage: [], unstage: [], floorStage: [], floorUnstage: [], cmds: [], cmdMs: [], ucmds: [] };
      for (let i = -1; i < reps; i++) {
        // i = -1 warms the code paths and learns the commands the floor replays.
        const staging = path.join(dir, `st-${kind}-${i}`);
        const {
          id,
          stageMs: staged,
          unstageMs: unstaged,
        } = await stageUnstage(d, `stage-${kind}-${i}`, cap, size, staging);
        await waitLog(d, 'NodeUnstageVolume', id);
        const cmds = commandsOf(d.lines, 'NodeStageVolume', id);
        const ucmds = commandsOf(d.lines, 'NodeUnstageVolume', id);
        // The device the driver's losetup printed is not in the log: it is the mount's source (or, for
        // block, irrelevant: nothing else names it).
        const attach = cmds.find((c) => c.command === 'losetup' && c.args.includes('--find'));
        const mount = cmds.find((c) => c.command === 'mount');
        const mkfs = cmds.find((c) => c.command.startsWith('mkfs.') && c.args.at(-1)?.startsWith('/dev/'));
        if (attach) attach.stdoutDevice = mount ? mount.args.at(-2) : mkfs?.args.at(-1);

        // The floor, on a fresh image of the same size (as CreateVolume makes it: sparse).
        const image = path.join(dir, `floor-${kind}-${i}.img`);
        const fstaging = path.join(dir, `fst-${kind}-${i}`);
        await fs.mkdir(fstaging, { recursive: true });
        sh('truncate', ['-s', String(size), image]);
        const f0 = now();
        const dev = floorStage(cmds, image, fstaging);
        const fstaged = now() - f0;
        const f1 = now();
        if (kind !== 'block') sh('umount', [fstaging]);
        sh('losetup', ['--detach', dev]);
        const funstaged = now() - f1;
        await fs.rm(image);
        if (i < 0) {
          breakdown.push({
            kind,
            stage: cmds.map((c) => `${c.command} ${c.args.join(' ')}`),
            unstage: ucmds.map((c) => `${c.command} ${c.args.join(' ')}`),
          });
          continue;
        }
        s.stage.push(staged);
        s.unstage.push(unstaged);
        s.floorStage.push(fstaged);
        s.floorUnstage.push(funstaged);
        s.cmds.push(cmds.length);
        s.cmdMs.push(cmds.reduce((a, c) => a + c.ms, 0));
        s.ucmds.push(ucmds.length);
      }
      const row = (call, driver, floor, commands, commandMs, goal) => ({
        call,
        kind,
        'driver ms': round(median(driver)),
        'floor ms': round(median(floor)),
        ratio: round(median(driver) / median(floor), 2),
        commands: median(commands),
        'command ms': commandMs,
        goal,
      });
      rows.push(
        row('NodeStageVolume', s.stage, s.floorStage, s.cmds, round(median(s.cmdMs)), 'ratio <= 1.25'),
        row('NodeUnstageVolume', s.unstage, s.floorUnstage, s.ucmds, '', ''),
      );
    }
  } finally {
    await d.stop();
  }
  results.stage = { sizeGiB, reps, rows, commands: breakdown };
  console.table(rows);
  for (const b of breakdown)
    console.log(
      `${b.kind} stage runs:\n  ${b.stage.join('\n  ')}\n  unstage runs:\n  ${b.unstage.join('\n  ')}`,
    );
}
