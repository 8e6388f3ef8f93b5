import { describe, expect, it } from 'vitest';
import { chooseSize } from '../../src/csi/create-volume.js';
import { parseMutableParameters, parseVolumeParameters } from '../../src/csi/parameters.js';
import {
  MiB,
  parseCapability,
  parseMountFlags,
  parseRange,
  requirePath,
  topologyAdmits,
} from '../../src/csi/validate.js';
import { CsiError } from '../../src/errors.js';
import type { VolumeCapability__Output } from '../../src/gen/csi/v1/VolumeCapability.js';

function kindOf(fn: () => unknown): string {
  try {
    fn();
    return 'ok';
  } catch (err) {
    return err instanceof CsiError ? err.kind : `not a CsiError: ${String(err)}`;
  }
}

const cap = (over: Partial<VolumeCapability__Output>): VolumeCapability__Output => ({
  access_mode: { mode: 'SINGLE_NODE_WRITER' },
  access_type: 'mount',
  mount: { fs_type: '', mount_flags: [], volume_mount_group: '' },
  ...over,
});

describe('parseCapability', () => {
  it.each([
    ['SINGLE_NODE_WRITER', 'ok'],
    ['SINGLE_NODE_READER_ONLY', 'ok'],
    ['SINGLE_NODE_SINGLE_WRITER', 'ok'],
    ['SINGLE_NODE_MULTI_WRITER', 'ok'],
    ['MULTI_NODE_READER_ONLY', 'ok'],
    ['MULTI_NODE_SINGLE_WRITER', 'invalid_argument'],
    ['MULTI_NODE_MULTI_WRITER', 'invalid_argument'],
    ['UNKNOWN', 'invalid_argument'],
  ] as const)('access mode %s → %s', (mode, expected) => {
    expect(kindOf(() => parseCapability(cap({ access_mode: { mode } }), 'c'))).toBe(expected);
  });

  it('reads block and mount access and the filesystem', () => {
    expect(parseCapability(cap({ access_type: 'block', block: {}, mount: null }), 'c')).toEqual({
      accessType: 'block',
      mode: 'SINGLE_NODE_WRITER',
      fsType: '',
      mountFlags: [],
    });
    expect(
      parseCapability(
        cap({ mount: { fs_type: 'xfs', mount_flags: ['noatime'], volume_mount_group: '' } }),
        'c',
      ),
    ).toMatchObject({
      accessType: 'mount',
      fsType: 'xfs',
      mountFlags: ['noatime'],
    });
  });

  it.each([
    ['missing capability', null],
    ['no access mode', cap({ access_mode: null })],
    ['no access type', cap({ access_type: undefined, mount: null })],
    [
      'an unsupported filesystem',
      cap({ mount: { fs_type: 'vfat', mount_flags: [], volume_mount_group: '' } }),
    ],
  ])('refuses %s', (_what, c) => {
    expect(kindOf(() => parseCapability(c, 'c'))).toBe('invalid_argument');
  });
});

describe('parseMountFlags', () => {
  it('accepts ordinary options and splits comma lists, honouring quotes', () => {
    expect(
      parseMountFlags([
        'noatime',
        'nodiratime,discard',
        'commit=30',
        'context="system_u:object_r:a_t:s0:c1,c2"',
      ]),
    ).toEqual(['noatime', 'nodiratime', 'discard', 'commit=30', 'context="system_u:object_r:a_t:s0:c1,c2"']);
  });
  it.each([
    'bind',
    'rbind',
    'remount',
    'move',
    'loop',
    'offset=4096',
    'X-mount.mkdir',
    'x-systemd.automount',
    'journal_path=/dev/sda',
    'logdev=/dev/sdb',
    'device=/dev/sdc',
    'rshared',
    'helper=foo',
    'user',
    'a b',
    'opt\\x',
    '"unbalanced',
    'noatime,bind',
  ])('refuses %j', (flag) => {
    expect(kindOf(() => parseMountFlags([flag]))).toBe('invalid_argument');
  });
});

describe('sizes', () => {
  it('parses ranges and refuses required above limit', () => {
    expect(parseRange(null)).toEqual({ requiredBytes: 0, limitBytes: 0 });
    expect(parseRange({ required_bytes: '5', limit_bytes: '0' })).toEqual({
      requiredBytes: 5,
      limitBytes: 0,
    });
    expect(kindOf(() => parseRange({ required_bytes: '10', limit_bytes: '5' }))).toBe('out_of_range');
    expect(kindOf(() => parseRange({ required_bytes: '-1', limit_bytes: '0' }))).toBe('invalid_argument');
    expect(kindOf(() => parseRange({ required_bytes: '99999999999999999999', limit_bytes: '0' }))).toBe(
      'out_of_range',
    );
  });

  it.each([
    // [required, limit, min, default, source, expected]
    [0, 0, MiB, 1024 * MiB, undefined, 1024 * MiB],
    [0, 100 * MiB, MiB, 1024 * MiB, undefined, 100 * MiB],
    [1, 0, MiB, 1024 * MiB, undefined, MiB],
    [MiB + 1, 0, MiB, 1024 * MiB, undefined, 2 * MiB],
    [10 * MiB, 0, 300 * MiB, 1024 * MiB, undefined, 300 * MiB],
    [0, 0, MiB, 1024 * MiB, 50 * MiB, 50 * MiB],
    [80 * MiB, 0, MiB, 1024 * MiB, 50 * MiB, 80 * MiB],
    // Requests round up, limits down (issue 18.6): a limit alone that is not a whole MiB still fits.
    [0, 3 * MiB + 5, MiB, 1024 * MiB, undefined, 3 * MiB],
    [0, MiB + 1, MiB, 1024 * MiB, undefined, MiB],
    [0, 2 * MiB - 1, MiB, 1024 * MiB, undefined, MiB],
    [MiB - 1, 0, MiB, 1024 * MiB, undefined, MiB],
    [MiB - 1, MiB, MiB, 1024 * MiB, undefined, MiB],
    [2 * MiB, 2 * MiB, MiB, 1024 * MiB, undefined, 2 * MiB],
    [MiB + 1, 3 * MiB - 1, MiB, 1024 * MiB, undefined, 2 * MiB],
  ])(
    'chooseSize(%d, %d, min %d, default %d, source %s) = %d',
    (required, limit, min, def, source, expected) => {
      expect(chooseSize({ requiredBytes: required, limitBytes: limit }, min, def, source)).toBe(expected);
    },
  );

  it.each([
    [10 * MiB, 100 * MiB, 300 * MiB, undefined],
    [MiB + 1, MiB + 100, MiB, undefined],
    [10 * MiB, 0, MiB, 50 * MiB],
    [0, 10 * MiB, MiB, 50 * MiB],
    [0, 1, MiB, undefined], // a limit of one byte holds no volume
    [0, MiB - 1, MiB, undefined],
    [MiB + 1, MiB + 1, MiB, undefined], // required = limit, not a whole MiB
    [2 * MiB + 1, 3 * MiB - 1, MiB, undefined],
  ])('chooseSize(%d, %d, min %d, source %s) is OUT_OF_RANGE', (required, limit, min, source) => {
    expect(
      kindOf(() => chooseSize({ requiredBytes: required, limitBytes: limit }, min, 1024 * MiB, source)),
    ).toBe('out_of_range');
  });
});

describe('parameters', () => {
  it('reads the known keys and keeps the provisioner metadata as labels', () => {
    expect(
      parseVolumeParameters({
        'csi.storage.k8s.io/fstype': 'xfs',
        allocation: 'preallocate',
        'csi.storage.k8s.io/pvc/name': 'data',
        'csi.storage.k8s.io/pv/name': 'pvc-1',
      }),
    ).toEqual({
      fsType: 'xfs',
      allocation: 'preallocate',
      labels: { 'pvc/name': 'data', 'pv/name': 'pvc-1' },
    });
    expect(parseVolumeParameters({ 'csi.storage.k8s.io/fstype': '' }).fsType).toBeUndefined();
  });
  it.each<Record<string, string>>([
    { speed: 'fast' },
    { allocation: 'lazy' },
    { 'csi.storage.k8s.io/fstype': 'zfs' },
  ])('refuses %j', (p) => {
    expect(kindOf(() => parseVolumeParameters(p))).toBe('invalid_argument');
  });
  it('takes allocation as a mutable parameter and nothing else', () => {
    expect(parseMutableParameters({ allocation: 'sparse' })).toEqual({ allocation: 'sparse' });
    expect(kindOf(() => parseMutableParameters({ XXX_FakeKey: 'x' }))).toBe('invalid_argument');
  });
});

describe('paths and topology', () => {
  it('wants absolute paths', () => {
    expect(requirePath('/a/b/../c', 'p')).toBe('/a/c');
    expect(kindOf(() => requirePath('relative/x', 'p'))).toBe('invalid_argument');
    expect(kindOf(() => requirePath('', 'p'))).toBe('invalid_argument');
    expect(kindOf(() => requirePath('/a\0b', 'p'))).toBe('invalid_argument');
    expect(kindOf(() => requirePath(`/${'x'.repeat(256)}`, 'p'))).toBe('invalid_argument');
    expect(kindOf(() => requirePath(`/a${'/b'.repeat(2100)}`, 'p'))).toBe('invalid_argument');
    expect(requirePath(`/${'x'.repeat(255)}`, 'p')).toHaveLength(256);
  });
  it('admits this pool by requisite, else preferred', () => {
    const seg = (pool: string) => ({ segments: { 'loopvol.csi.io/pool': pool } });
    expect(topologyAdmits(null, 'p1')).toBe(true);
    expect(topologyAdmits({ requisite: [], preferred: [] }, 'p1')).toBe(true);
    expect(topologyAdmits({ requisite: [seg('p2'), seg('p1')], preferred: [] }, 'p1')).toBe(true);
    expect(topologyAdmits({ requisite: [seg('p2')], preferred: [seg('p1')] }, 'p1')).toBe(false);
    expect(topologyAdmits({ requisite: [], preferred: [seg('p2')] }, 'p1')).toBe(false);
    expect(topologyAdmits({ requisite: [{ segments: { zone: 'a' } }], preferred: [] }, 'p1')).toBe(false);
  });
});
