/**
 * mkfs options chosen for older node kernels, for real (root only): this machine's mkfs accepts them,
 * the filesystems it makes mount here, and the features an older kernel cannot mount are off.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { bindExec, ExecRunner } from '../../src/exec/runner.js';
import { formatDevice } from '../../src/host/filesystem.js';
import { kernelVersion, mkfsCompat, type Version } from '../../src/host/mkfs-compat.js';
import { TestEnv } from '../helpers/env.js';
import { isRoot } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const sh = (cmd: string, args: string[]): string => execFileSync(cmd, args, { encoding: 'utf8' });
const x = bindExec(new ExecRunner(), { log: pino({ level: 'silent' }) });

/** What each filesystem's tool reports about the features an old kernel must not see. */
function features(fsType: string, image: string, mountPoint: string): string {
  if (fsType === 'ext4')
    return (
      sh('dumpe2fs', ['-h', image])
        .split('\n')
        .find((l) => l.startsWith('Filesystem features:')) ?? ''
    );
  if (fsType === 'xfs') return sh('xfs_info', [mountPoint]);
  return sh('btrfs', ['inspect-internal', 'dump-super', image]);
}

/** The kernels a filesystem is made for; each is mounted here, so those newer than this one are left out. */
const KERNELS: Version[] = (
  [
    [4, 18, 0], // RHEL 8
    [5, 4, 0], // Ubuntu 20.04
    [5, 10, 0], // Amazon Linux 2
    [5, 15, 0], // Ubuntu 22.04
    [6, 1, 0], // Debian 12
  ] as const
).filter((k) => {
  const [a, b] = kernelVersion();
  return k[0] < a || (k[0] === a && k[1] <= b);
});

describe.skipIf(!isRoot())('mkfs options for older kernels', () => {
  it.each(KERNELS.flatMap((k) => (['ext4', 'xfs', 'btrfs'] as const).map((fsType) => [fsType, k] as const)))(
    '%s made for Linux %j is accepted by this mkfs and mounts',
    async (fsType, kernel) => {
      const dir = await env.dir('mkfs-compat');
      const image = path.join(dir, 'disk.img');
      const mnt = path.join(dir, 'mnt');
      await fs.mkdir(mnt);
      await fs.writeFile(image, '');
      await fs.truncate(image, 320 * 2 ** 20);
      const compat = await mkfsCompat(x, fsType, kernel);
      await formatDevice(x, fsType, image, { compat: compat.args });
      const dev = sh('losetup', ['--find', '--show', image]).trim();
      try {
        sh('mount', ['-t', fsType, dev, mnt]);
        const shown = features(fsType, image, mnt);
        sh('umount', [mnt]);
        if (
          fsType === 'xfs' &&
          kernel[0] * 100 + kernel[1] < 519 &&
          compat.off.some((o) => o.startsWith('nrext64'))
        ) {
          expect(shown).toMatch(/nrext64=0/);
        }
        if (fsType === 'xfs' && kernel[0] * 100 + kernel[1] < 510) expect(shown).toMatch(/bigtime=0/);
        if (fsType === 'ext4' && kernel[0] * 100 + kernel[1] < 515) expect(shown).not.toMatch(/orphan_file/);
      } finally {
        sh('losetup', ['-d', dev]);
      }
    },
  );
});
