/** mkfs options chosen for the node's kernel: a table of kernels and of what the installed mkfs knows. */
import { describe, expect, it } from 'vitest';
import { compatArgs, kernelVersion, type MkfsKnows } from '../../src/host/mkfs-compat.js';

/** xfsprogs 6.1 (Debian 12) knows nrext64; 6.13 (Debian 13) also exchange, parent and metadir. */
const XFS_6_1: MkfsKnows = {
  features: new Set(['crc', 'finobt', 'rmapbt', 'reflink', 'inobtcount', 'bigtime', 'nrext64', 'sparse']),
};
const XFS_6_13: MkfsKnows = { features: new Set([...XFS_6_1.features, 'exchange', 'parent', 'metadir']) };
const XFS_5_10: MkfsKnows = {
  features: new Set(['crc', 'finobt', 'rmapbt', 'reflink', 'inobtcount', 'bigtime']),
};
const E2FS_1_47: MkfsKnows = { features: new Set(['metadata_csum', 'metadata_csum_seed', 'orphan_file']) };
const E2FS_1_46: MkfsKnows = { features: new Set(['metadata_csum', 'metadata_csum_seed']) };
const BTRFS_6_2: MkfsKnows = {
  features: new Set(['mixed-bg', 'extref', 'raid56', 'skinny-metadata', 'no-holes', 'raid1c34', 'zoned']),
  runtimeFeatures: new Set(['quota', 'free-space-tree']),
};

describe('kernelVersion', () => {
  it.each([
    ['6.18.44-fc-v669', [6, 18, 44]],
    ['4.18.0-553.el8_10.x86_64', [4, 18, 0]],
    ['5.10.226-214.880.amzn2.x86_64', [5, 10, 226]],
    ['5.4.0-200-generic', [5, 4, 0]],
    ['6.1', [6, 1, 0]],
  ])('%s → %j', (release, version) => {
    expect(kernelVersion(release)).toEqual(version);
  });
});

describe('compatArgs', () => {
  it.each([
    // RHEL 8 (4.18), Ubuntu 20.04 (5.4): no nrext64, bigtime or inobtcount.
    [
      'xfs',
      [4, 18, 0],
      XFS_6_13,
      ['-i', 'nrext64=0,exchange=0', '-m', 'bigtime=0,inobtcount=0,metadir=0', '-n', 'parent=0'],
    ],
    ['xfs', [5, 4, 0], XFS_6_1, ['-i', 'nrext64=0', '-m', 'bigtime=0,inobtcount=0']],
    // Amazon Linux 2 with 5.10, Ubuntu 22.04 (5.15): no nrext64.
    ['xfs', [5, 10, 0], XFS_6_1, ['-i', 'nrext64=0']],
    ['xfs', [5, 15, 0], XFS_6_13, ['-i', 'nrext64=0,exchange=0', '-n', 'parent=0', '-m', 'metadir=0']],
    // Debian 12 (6.1) with Debian 13's xfsprogs: the newest features only.
    ['xfs', [6, 1, 0], XFS_6_13, ['-i', 'exchange=0', '-n', 'parent=0', '-m', 'metadir=0']],
    ['xfs', [6, 13, 0], XFS_6_13, []],
    // An option the installed mkfs does not know is never passed (it would fail).
    ['xfs', [4, 18, 0], XFS_5_10, ['-m', 'bigtime=0,inobtcount=0']],
    ['xfs', [4, 4, 0], XFS_6_1, ['-i', 'nrext64=0', '-m', 'bigtime=0,inobtcount=0,reflink=0,rmapbt=0']],
    ['ext4', [4, 18, 0], E2FS_1_47, ['-O', '^orphan_file']],
    ['ext4', [5, 15, 0], E2FS_1_47, []],
    ['ext4', [5, 4, 0], E2FS_1_46, []],
    ['ext4', [3, 10, 0], E2FS_1_47, ['-O', '^orphan_file,^metadata_csum_seed,^metadata_csum']],
    ['btrfs', [5, 4, 0], BTRFS_6_2, []],
    ['btrfs', [4, 4, 0], BTRFS_6_2, ['-R', '^free-space-tree']],
    ['btrfs', [3, 10, 0], BTRFS_6_2, ['-R', '^free-space-tree', '-O', '^no-holes']],
  ] as const)('%s on Linux %j', (fsType, kernel, knows, args) => {
    expect(compatArgs(fsType, kernel, knows).args).toEqual(args);
  });

  it('says what it turned off and why', () => {
    expect(compatArgs('xfs', [5, 4, 0], XFS_6_1).off).toEqual([
      'nrext64 (needs Linux 5.19)',
      'bigtime (needs Linux 5.10)',
      'inobtcount (needs Linux 5.10)',
    ]);
  });
});
