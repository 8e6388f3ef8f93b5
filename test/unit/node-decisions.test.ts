/** The node's decisions, with a scripted runner instead of the kernel: format or not, and error paths. */
import { describe, expect, it } from 'vitest';
import { decideFormat } from '../../src/node/format.js';
import { loopOfMount } from '../../src/node/on-host.js';
import { stageMountOptions } from '../../src/node/stage.js';
import {
  checkFilesystem,
  formatDevice,
  growOnline,
  mountedFilesystemSize,
  OnlineGrowthUnsupported,
  probeDevice,
} from '../../src/host/filesystem.js';
import { type MountEntry, parseMountInfo, wentReadOnly } from '../../src/host/mounts.js';
import { DomainError } from '../../src/errors.js';
import { codeName, toStatus } from '../../src/server/status.js';
import { fakeContext, ScriptedRunner } from '../helpers/fake-runner.js';

const DEV = '/dev/loop7';

describe('probeDevice (blkid -p)', () => {
  it.each([
    [{ exitCode: 2 }, { kind: 'blank' }],
    [
      { stdout: 'DEVNAME=/dev/loop7\nUUID=x\nTYPE=ext4\nUSAGE=filesystem' },
      { kind: 'filesystem', type: 'ext4' },
    ],
    [
      { stdout: 'DEVNAME=/dev/loop7\nPTUUID=x\nPTTYPE=gpt' },
      { kind: 'other', what: 'a gpt partition table' },
    ],
    [
      { stdout: 'TYPE=crypto_LUKS\nUSAGE=crypto' },
      { kind: 'other', what: 'a crypto_LUKS signature (crypto)' },
    ],
    [{ exitCode: 8 }, { kind: 'other', what: 'several conflicting signatures' }],
  ])('%j → %j', async (result, expected) => {
    const runner = new ScriptedRunner([{ command: 'blkid', args: ['-p', '-o', 'export', DEV], ...result }]);
    expect(await probeDevice(fakeContext(runner), DEV)).toEqual(expected);
  });

  it('fails on a blkid usage error instead of guessing', async () => {
    const runner = new ScriptedRunner([{ command: 'blkid', exitCode: 4, stderr: 'bad usage' }]);
    await expect(probeDevice(fakeContext(runner), DEV)).rejects.toThrow(/blkid/);
  });
});

describe('decideFormat', () => {
  it('formats only a blank device that was never initialized', () => {
    expect(decideFormat({ kind: 'blank' }, false, '', 'ext4')).toEqual({ action: 'format', fsType: 'ext4' });
    expect(decideFormat({ kind: 'blank' }, false, 'xfs', 'ext4')).toEqual({
      action: 'format',
      fsType: 'xfs',
    });
    expect(decideFormat({ kind: 'blank' }, true, '', 'ext4').action).toBe('refuse');
  });
  it('keeps the filesystem asked for, or the one found when none was asked', () => {
    expect(decideFormat({ kind: 'filesystem', type: 'xfs' }, true, 'xfs', 'ext4')).toEqual({
      action: 'keep',
      fsType: 'xfs',
    });
    expect(decideFormat({ kind: 'filesystem', type: 'btrfs' }, true, '', 'ext4')).toEqual({
      action: 'keep',
      fsType: 'btrfs',
    });
  });
  it('makes again only the filesystem an unfinished mkfs of ours was making, on a volume never marked', () => {
    const xfs = { kind: 'filesystem', type: 'xfs' } as const;
    expect(decideFormat(xfs, false, '', 'xfs', 'xfs')).toEqual({
      action: 'format',
      fsType: 'xfs',
      force: true,
    });
    expect(decideFormat(xfs, false, 'xfs', 'ext4', 'xfs')).toEqual({
      action: 'format',
      fsType: 'xfs',
      force: true,
    });
    // Marked initialized: whatever began before, the filesystem there is the volume's.
    expect(decideFormat(xfs, true, '', 'xfs', 'xfs')).toEqual({ action: 'keep', fsType: 'xfs' });
    // Another filesystem than the one that mkfs was making is not its leftover.
    expect(decideFormat(xfs, false, '', 'xfs', 'btrfs')).toEqual({ action: 'keep', fsType: 'xfs' });
    expect(
      decideFormat({ kind: 'other', what: 'a dos partition table' }, false, '', 'xfs', 'xfs').action,
    ).toBe('refuse');
    expect(decideFormat({ kind: 'blank' }, false, '', 'xfs', 'xfs')).toEqual({
      action: 'format',
      fsType: 'xfs',
    });
  });
  it('refuses another filesystem, an unknown one, or a partition table', () => {
    expect(decideFormat({ kind: 'filesystem', type: 'xfs' }, true, 'ext4', 'ext4').action).toBe('refuse');
    expect(decideFormat({ kind: 'filesystem', type: 'vfat' }, false, '', 'ext4').action).toBe('refuse');
    expect(decideFormat({ kind: 'other', what: 'a dos partition table' }, false, '', 'ext4')).toEqual({
      action: 'refuse',
      reason: 'holds a dos partition table; it was left untouched.',
    });
  });
});

describe('formatDevice', () => {
  it('formats ext4 without discard, reserved blocks or lazy zeroing, and without force', async () => {
    const runner = new ScriptedRunner([
      {
        command: 'mkfs.ext4',
        args: ['-q', '-b', '4096', '-m', '0', '-E', 'nodiscard,assume_storage_prezeroed=1', DEV],
      },
    ]);
    await formatDevice(fakeContext(runner), 'ext4', DEV);
    expect(runner.done).toBe(true);
  });
  it('falls back when e2fsprogs predates assume_storage_prezeroed', async () => {
    const runner = new ScriptedRunner([
      { command: 'mkfs.ext4', exitCode: 1, stderr: 'Bad option(s) specified: assume_storage_prezeroed' },
      { command: 'mkfs.ext4', args: /lazy_itable_init=1/ },
    ]);
    await formatDevice(fakeContext(runner), 'ext4', DEV);
    expect(runner.done).toBe(true);
  });
  it.each([
    ['xfs', 'mkfs.xfs', ['-q', '-K', DEV]],
    ['btrfs', 'mkfs.btrfs', ['-q', '-K', DEV]],
  ] as const)('formats %s without a discard pass', async (fs, command, args) => {
    const runner = new ScriptedRunner([{ command, args }]);
    await formatDevice(fakeContext(runner), fs, DEV);
    expect(runner.done).toBe(true);
  });
  it.each([
    [
      'ext4',
      'mkfs.ext4',
      ['-q', '-F', '-b', '4096', '-m', '0', '-E', 'nodiscard,assume_storage_prezeroed=1', DEV],
    ],
    ['xfs', 'mkfs.xfs', ['-q', '-K', '-f', DEV]],
    ['btrfs', 'mkfs.btrfs', ['-q', '-K', '-f', DEV]],
  ] as const)('forces %s only when asked to, and always dies with the driver', async (fs, command, args) => {
    const runner = new ScriptedRunner([{ command, args }]);
    await formatDevice(fakeContext(runner), fs, DEV, { force: true });
    expect(runner.done).toBe(true);
    expect(runner.calls[0]?.options).toMatchObject({ detached: true, diesWithProcess: true });
  });
});

describe('checkFilesystem', () => {
  it.each([0, 1, 2])('accepts e2fsck exit %d', async (exitCode) => {
    const runner = new ScriptedRunner([{ command: 'e2fsck', args: ['-p', DEV], exitCode }]);
    await checkFilesystem(fakeContext(runner), 'ext4', DEV);
  });
  it('refuses to mount when e2fsck cannot repair unattended', async () => {
    const runner = new ScriptedRunner([{ command: 'e2fsck', exitCode: 4 }]);
    const err = await checkFilesystem(fakeContext(runner), 'ext4', DEV).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(DomainError);
    expect(codeName(toStatus(err).code)).toBe('FAILED_PRECONDITION');
  });
  it('runs nothing for xfs and btrfs', async () => {
    const runner = new ScriptedRunner([]);
    await checkFilesystem(fakeContext(runner), 'xfs', DEV);
    await checkFilesystem(fakeContext(runner), 'btrfs', DEV);
    expect(runner.calls).toEqual([]);
  });
});

describe('growth', () => {
  it('recognizes the missing CAP_SYS_RESOURCE for online ext4 growth', async () => {
    const runner = new ScriptedRunner([
      {
        command: 'resize2fs',
        exitCode: 1,
        stderr: 'resize2fs 1.47.0\nresize2fs: Permission denied to resize filesystem',
      },
    ]);
    await expect(growOnline(fakeContext(runner), 'ext4', DEV, '/mnt')).rejects.toBeInstanceOf(
      OnlineGrowthUnsupported,
    );
  });
  it('reads the size xfs and btrfs report for a mounted filesystem', async () => {
    const xfs = new ScriptedRunner([
      {
        command: 'xfs_growfs',
        args: ['-n', '/mnt'],
        stdout:
          'meta-data=/dev/loop0 isize=512 agcount=4\ndata     =                       bsize=4096   blocks=153600, imaxpct=25\n',
      },
    ]);
    expect(await mountedFilesystemSize(fakeContext(xfs), 'xfs', DEV, '/mnt')).toBe(153600 * 4096);
    const btrfs = new ScriptedRunner([
      {
        command: 'btrfs',
        stdout:
          'Label: none\n\tTotal devices 1 FS bytes used 1\n\tdevid    1 size 629145600 used 1 path /dev/loop0\n',
      },
    ]);
    expect(await mountedFilesystemSize(fakeContext(btrfs), 'btrfs', DEV, '/mnt')).toBe(629145600);
  });
});

describe('mounts', () => {
  const info = [
    '27 1 254:0 / / rw,relatime - ext4 /dev/vda rw',
    '40 27 7:3 / /var/lib/kubelet/plugins/x/globalmount rw,relatime - xfs /dev/loop3 rw,nouuid',
    '41 27 7:3 / /var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv\\040one/mount ro,relatime - xfs /dev/loop3 rw,nouuid',
    '42 27 0:6 /loop4 /var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pv/u ro,relatime - devtmpfs devtmpfs rw',
  ].join('\n');

  it('parses mountinfo, escapes included', () => {
    const m = parseMountInfo(info);
    expect(m).toHaveLength(4);
    expect(m[2]?.mountPoint).toBe('/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv one/mount');
    expect(m[2]?.options).toContain('ro');
    expect(m[1]).toMatchObject({ fsType: 'xfs', source: '/dev/loop3', root: '/' });
  });

  it('finds the loop device behind a filesystem mount and behind a device bind', () => {
    const loops = [
      {
        name: 'loop3',
        path: '/dev/loop3',
        majorMinor: '7:3',
        backingFile: '/p/a',
        backing: undefined,
        readOnly: false,
        directIo: true,
        autoclear: false,
        sizeBytes: 1,
      },
      {
        name: 'loop4',
        path: '/dev/loop4',
        majorMinor: '7:4',
        backingFile: '/p/b',
        backing: undefined,
        readOnly: true,
        directIo: true,
        autoclear: false,
        sizeBytes: 1,
      },
    ];
    const [root, staged, , device] = parseMountInfo(info);
    if (!root || !staged || !device) throw new Error('mountinfo did not parse');
    expect(loopOfMount(staged, loops)?.name).toBe('loop3');
    expect(loopOfMount(device, loops)?.name).toBe('loop4');
    expect(loopOfMount(root, loops)).toBeUndefined();
  });

  it('mounts xfs with nouuid, and read-only without journal replay', () => {
    expect(stageMountOptions('xfs', false, ['noatime'])).toEqual(['noatime', 'nouuid']);
    expect(stageMountOptions('xfs', true, [])).toEqual(['ro', 'norecovery', 'nouuid']);
    expect(stageMountOptions('ext4', true, ['rw'])).toEqual(['ro', 'noload']);
    expect(stageMountOptions('btrfs', false, [])).toEqual([]);
  });

  it('sees a filesystem the kernel turned read-only after errors, ext4 emergency_ro included', () => {
    const at = (options: string[], superOptions: string[]): MountEntry => ({
      id: 1,
      parent: 0,
      majorMinor: '7:0',
      root: '/',
      mountPoint: '/staging',
      options,
      fsType: 'ext4',
      source: '/dev/loop0',
      superOptions,
    });
    expect(wentReadOnly(at(['rw'], ['ro', 'errors=remount-ro']))).toBe(true);
    expect(wentReadOnly(at(['rw'], ['rw', 'errors=remount-ro', 'emergency_ro']))).toBe(true);
    expect(wentReadOnly(at(['ro'], ['rw', 'emergency_ro']))).toBe(true);
    expect(wentReadOnly(at(['ro'], ['ro']))).toBe(false);
    expect(wentReadOnly(at(['rw'], ['rw', 'errors=remount-ro']))).toBe(false);
  });

  it('mounts a writable ext4 read-only on errors, unless the StorageClass says how', () => {
    expect(stageMountOptions('ext4', false, [])).toEqual(['errors=remount-ro']);
    expect(stageMountOptions('ext4', false, ['noatime'])).toEqual(['noatime', 'errors=remount-ro']);
    expect(stageMountOptions('ext4', false, ['errors=continue'])).toEqual(['errors=continue']);
    expect(stageMountOptions('ext4', false, ['ro'])).toEqual(['ro']);
  });
});
