/**
 * What check judges, without the kernel: the ext4 superblock's freeze flag, where an image sits in the
 * pool, which loop devices leases explain, the pool's findings from an inventory, the host's findings
 * over the fake host, and the metrics the findings and observations feed.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ext4SuperblockState } from '../../src/audit/frozen.js';
import { hostFindings } from '../../src/audit/host-check.js';
import { classifyImagePath, explainedLoops } from '../../src/audit/host-look.js';
import type { Inventory, NodeInfo, VolumeInfo } from '../../src/audit/inventory.js';
import { pvcOf } from '../../src/audit/inventory.js';
import { poolFindings } from '../../src/audit/pool-check.js';
import { selfIdentity } from '../../src/audit/self.js';
import { table } from '../../src/cli/common.js';
import type { LoopDevice, MountEntry } from '../../src/host/host.js';
import { Metrics } from '../../src/metrics.js';
import { Pool } from '../../src/pool/pool.js';
import type { GroupSnapshotMeta, Lease, SnapshotMeta, VolumeMeta } from '../../src/pool/types.js';
import { FakeHost } from '../helpers/fake-host.js';
import { fakeContext, ScriptedRunner } from '../helpers/fake-runner.js';

const loop = (name: string): LoopDevice => ({
  name,
  path: `/dev/${name}`,
  majorMinor: '7:0',
  backingFile: '/pool/volumes/vol-x/disk.img',
  backing: undefined,
  readOnly: false,
  directIo: true,
  autoclear: false,
  sizeBytes: 1,
});
const mount = (source: string, mountPoint: string): MountEntry => ({
  id: 1,
  parent: 0,
  majorMinor: '7:0',
  root: '/',
  mountPoint,
  options: ['rw'],
  fsType: 'ext4',
  source,
  superOptions: ['rw'],
});
const lease = (node: string, extra: Partial<Lease> = {}): Lease => ({
  node,
  stagingPath: `/kubelet/${node}/staging`,
  accessType: 'mount',
  mode: 'SINGLE_NODE_WRITER',
  readonly: false,
  since: '2026-01-01T00:00:00Z',
  ...extra,
});

describe('ext4SuperblockState', () => {
  const sb = (compat: number, incompat: number, magic = 0xef53): Buffer => {
    const b = Buffer.alloc(1024);
    b.writeUInt16LE(magic, 0x38);
    b.writeUInt32LE(compat, 0x5c);
    b.writeUInt32LE(incompat, 0x60);
    return b;
  };
  it.each([
    ['mounted, journal needs recovery: not frozen', sb(0x4, 0x2c6), 'not-frozen'],
    ['journal flushed by a freeze: frozen', sb(0x4, 0x2c2), 'frozen'],
    ['no journal: cannot tell', sb(0, 0x2c2), 'unknown'],
    ['not ext4', sb(0x4, 0x2c2, 0x1234), 'unknown'],
    ['short read', Buffer.alloc(16), 'unknown'],
  ])('%s', (_what, buf, state) => {
    expect(ext4SuperblockState(buf)).toBe(state);
  });
});

describe('classifyImagePath', () => {
  const v = `vol-${'a'.repeat(32)}`;
  it.each([
    [`/p/volumes/${v}/disk.img`, { kind: 'volume', id: v, partial: false }],
    [`/p/volumes/${v}/disk.img.partial`, { kind: 'volume', id: v, partial: true }],
    [`/p/snapshots/snap-${'b'.repeat(32)}/disk.img`, { kind: 'snapshot', id: `snap-${'b'.repeat(32)}` }],
    [`/p/trash/${v}.abc123/disk.img`, { kind: 'trash', id: v }],
    [`/p/quarantine/${v}.2026-01-01T00-00-00-000Z/disk.img`, { kind: 'quarantine', id: v }],
  ])('%s', (p, want) => {
    expect(classifyImagePath('/p', p)).toMatchObject(want);
  });
  it.each([
    `/p/volumes/vol-nothex/disk.img`,
    `/p/volumes/${v}/meta.json`,
    `/q/volumes/${v}/disk.img`,
    '/p/disk.img',
  ])('is not an image of the pool: %s', (p) => {
    expect(classifyImagePath('/p', p)).toBeUndefined();
  });
});

describe('explainedLoops', () => {
  const loops = [loop('loop1'), loop('loop2')];
  const here = (n: string) => n === 'node-1';
  it('explains the device a lease names, and the one its staging path shows', () => {
    expect(explainedLoops(loops, [lease('node-1', { device: 'loop1' })], [], here)).toEqual(
      new Set(['loop1']),
    );
    // Another host's lease explains only what its staging path shows here.
    const m = mount('/dev/loop2', '/kubelet/node-9/staging');
    expect(explainedLoops(loops, [lease('node-9', { device: 'loop7' })], [m], here)).toEqual(
      new Set(['loop2']),
    );
    expect(explainedLoops(loops, [lease('node-9', { device: 'loop1' })], [], here)).toEqual(new Set());
  });
  it('explains every device of the volume while a stage of this host may be attaching one', () => {
    expect(explainedLoops(loops, [lease('node-1')], [], here)).toEqual(new Set(['loop1', 'loop2']));
    expect(explainedLoops(loops, [lease('node-1', { device: 'loop9' })], [], here)).toEqual(
      new Set(['loop1', 'loop2']),
    );
  });
  it('explains nothing without a lease', () => {
    expect(explainedLoops(loops, [], [mount('/dev/loop1', '/mnt')], here)).toEqual(new Set());
  });
});

const node = (name: string, extra: Partial<NodeInfo> = {}): NodeInfo => ({
  node: name,
  record: { node: name, pool: 'default', maxVolumes: 10, host: 'h', registeredAt: '' },
  heartbeatAgeSeconds: 2,
  stale: false,
  fenced: [],
  freezes: new Map(),
  damaged: [],
  ...extra,
});
const volume = (id: string, extra: Partial<VolumeInfo> = {}): VolumeInfo => ({
  id,
  dir: `/p/volumes/${id}`,
  record: { state: 'absent' },
  image: undefined,
  partial: false,
  attachments: [],
  leases: [],
  fencesDamaged: false,
  ...extra,
});
const emptyInventory = (): Inventory => ({
  volumes: [],
  snapshots: [],
  groups: [],
  quarantine: [],
  trash: [],
  nodes: new Map(),
  locks: [],
});

/** A lock a live process holds right now (a call at work). */
const heldLock = (key: string, purpose: string): Inventory['locks'][number] => ({
  key,
  file: `/p/locks/${key}.lock`,
  holder: 'process 1 on h',
  purpose,
  role: undefined,
  host: 'h',
  ageSeconds: 1,
  gone: undefined,
});

describe('poolFindings', () => {
  const opts = { trashAgeSeconds: 3600, lockStaleSeconds: 120 };
  it('reports holds of silent nodes, not of live ones', () => {
    const inv = emptyInventory();
    inv.nodes.set('live', node('live'));
    inv.nodes.set('quiet', node('quiet', { heartbeatAgeSeconds: 500, stale: true }));
    const ready = {
      state: 'ok' as const,
      value: { state: 'ready', name: 'n' } as unknown as VolumeMeta,
    };
    inv.volumes.push(
      volume('vol-1', {
        record: ready,
        image: { sizeBytes: 1, allocatedBytes: 0 },
        leases: [lease('live'), lease('quiet', { revokedAt: 't', fencedAt: 't' }), lease('removed')],
        attachments: [
          { node: 'quiet', readonly: false, accessType: 'mount', mode: 'SINGLE_NODE_WRITER', since: 't' },
        ],
      }),
    );
    const found = poolFindings(inv, opts).map((f) => `${f.kind} ${f.node ?? ''}`);
    expect(found.sort()).toEqual([
      'stale-attachment quiet',
      'stale-lease removed',
      'stale-revoked-lease quiet',
    ]);
  });
  it('tells a creation at work from an interrupted one, by its lock', () => {
    const inv = emptyInventory();
    const creating = {
      state: 'ok' as const,
      value: { state: 'creating', name: 'n' } as unknown as VolumeMeta,
    };
    inv.volumes.push(
      volume('vol-busy', { record: creating }),
      volume('vol-left', { record: creating }),
      volume('vol-killed', { record: creating }),
    );
    inv.locks.push(heldLock('vol-busy', 'CreateVolume'), {
      ...heldLock('vol-killed', 'CreateVolume'),
      gone: 'its process 7 on this host has exited',
    });
    // A lock whose holder is proven gone (killed mid-copy) hides nothing: its creation is unfinished.
    expect(poolFindings(inv, opts).map((f) => `${f.kind} ${f.volumeId ?? f.subject}`)).toEqual([
      'unfinished-creation vol-left',
      'unfinished-creation vol-killed',
      'abandoned-lock /p/locks/vol-killed.lock',
    ]);
  });
  it("tells a group snapshot's member waiting for its group's copy from an interrupted one, by the group's lock", () => {
    const inv = emptyInventory();
    const member = (group: string) => ({
      state: 'ok' as const,
      value: { state: 'creating', name: 'n', groupSnapshotId: group } as unknown as SnapshotMeta,
    });
    const snapshot = (id: string, group: string) => ({
      id,
      dir: `/p/snapshots/${id}`,
      record: member(group),
      image: undefined,
      partial: false,
    });
    inv.snapshots.push(snapshot('snap-busy', 'group-at-work'), snapshot('snap-left', 'group-gone'));
    inv.locks.push(heldLock('group-at-work', 'CreateVolumeGroupSnapshot'));
    expect(poolFindings(inv, opts).map((f) => `${f.kind} ${f.volumeId ?? ''}`)).toEqual([
      'unfinished-creation snap-left',
    ]);
    // What removes a member depends on its group: gone, unreadable, not listing it, ready, or unfinished
    // (which the controller's look discards, with its members, unless one of them cannot be read).
    const actionFor = (g: GroupSnapshotMeta | 'damaged' | undefined, extra: typeof inv.snapshots = []) => {
      const i2 = emptyInventory();
      i2.snapshots.push(snapshot('snap-left', 'group-g'), ...extra);
      if (g === 'damaged') i2.groups.push({ id: 'group-g', record: { state: 'damaged', reason: 'torn' } });
      else if (g) i2.groups.push({ id: 'group-g', record: { state: 'ok', value: g } });
      return poolFindings(i2, opts).find((f) => f.volumeId === 'snap-left')?.action ?? '';
    };
    const g = (state: string, snapshotIds = ['snap-left', 'snap-other']) =>
      ({ id: 'group-g', state, snapshotIds }) as unknown as GroupSnapshotMeta;
    const damagedSibling = {
      ...snapshot('snap-other', 'group-g'),
      record: { state: 'damaged' as const, reason: 'torn' },
    };
    expect(
      [
        actionFor(undefined),
        actionFor('damaged'),
        actionFor(g('creating', ['snap-other'])),
        actionFor(g('ready')),
        actionFor(g('creating')),
        actionFor(g('creating'), [damagedSibling]),
      ].map((a) => [
        a.includes('DeleteSnapshot of it'),
        a.includes('cannot be read'),
        a.includes('does not list it'),
        a.includes('the controller does'),
        a.includes('no retry of its create'),
      ]),
    ).toEqual([
      [true, false, false, false, false],
      [false, true, false, false, false],
      [false, false, true, false, false],
      [false, false, false, false, true],
      [false, false, false, true, false],
      [false, false, false, false, false],
    ]);
  });
  it('reports a group snapshot never finished (its members hidden), not one at work', () => {
    const inv = emptyInventory();
    const group = (id: string, state: string) => ({
      id,
      record: {
        state: 'ok' as const,
        value: { id, name: id, state, snapshotIds: ['snap-a', 'snap-b'] } as unknown as GroupSnapshotMeta,
      },
    });
    inv.groups.push(
      group('group-left', 'creating'),
      group('group-busy', 'creating'),
      group('group-done', 'ready'),
    );
    inv.locks.push(heldLock('group-busy', 'CreateVolumeGroupSnapshot'));
    expect(poolFindings(inv, opts).map((f) => `${f.kind} ${f.subject}`)).toEqual([
      'unfinished-creation groups/group-left',
    ]);
  });
  it("removes only locks of holders proven gone; reports unrenewed ones; removes old trash of the driver's names", () => {
    const inv = emptyInventory();
    const lock = { file: '', holder: 'p', purpose: '', role: undefined, host: 'h', gone: undefined };
    inv.locks.push(
      { ...lock, key: 'gone', ageSeconds: 1, gone: 'its process exited' },
      { ...lock, key: 'stale', ageSeconds: 600 },
      { ...lock, key: 'fresh', ageSeconds: 5 },
    );
    const x = `vol-${'1'.repeat(32)}.0123456789ab`;
    const y = `vol-${'2'.repeat(32)}.0123456789ab`;
    inv.trash.push({ entry: x, path: `/p/trash/${x}`, ageSeconds: 7200 });
    inv.trash.push({ entry: y, path: `/p/trash/${y}`, ageSeconds: 60 });
    // A name the driver never gives is reported, never removed.
    inv.trash.push({ entry: 'planted', path: '/p/trash/planted', ageSeconds: 7200 });
    const found = poolFindings(inv, opts);
    expect(found.map((f) => [f.kind, f.gc?.action ?? '-'])).toEqual([
      ['abandoned-lock', 'remove-lock'],
      ['stale-lock', '-'],
      ['old-trash', 'remove-trash'],
      ['old-trash', '-'],
    ]);
  });
});

describe('hostFindings over the fake host', () => {
  let dir: string;
  let pool: Pool;
  beforeAll(async () => {
    dir = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-unit-audit-'));
    pool = await Pool.open(path.join(dir, 'pool'), 'default', pino({ level: 'silent' }));
  });
  afterAll(async () => {
    await fs.rm(dir, { recursive: true, force: true });
  });

  it('tells leaks, hand mounts, fences and quarantined images apart, and what gc may remove', async () => {
    const host = new FakeHost();
    const x = fakeContext(new ScriptedRunner([]));
    const ids = ['a', 'b', 'c', 'd'].map((c) => `vol-${c.repeat(32)}`);
    const [a = '', b = '', c = '', dId = ''] = ids;
    for (const id of ids) {
      await fs.mkdir(pool.layout.volumeDir(id), { recursive: true });
      await fs.writeFile(pool.layout.volumeImage(id), 'x');
      host.content.set(pool.layout.volumeImage(id), { kind: 'filesystem', type: 'xfs', size: 1 });
    }
    const q = path.join(pool.layout.quarantineDir, `${dId}.then`);
    await fs.mkdir(q, { recursive: true });
    await fs.rename(pool.layout.volumeImage(dId), path.join(q, 'disk.img'));
    const opts = { readOnly: false, directIo: true };
    const attach = (file: string) => host.attach(x, file, undefined, opts);
    const la = await attach(pool.layout.volumeImage(a)); // staged, and bound elsewhere by hand
    const lb = await attach(pool.layout.volumeImage(b)); // leaked, mounted outside
    const lc = await attach(pool.layout.volumeImage(c)); // fenced
    const lq = await attach(path.join(q, 'disk.img')); // a quarantined image
    for (const p of ['/kubelet/a/staging', '/mnt/elsewhere', '/mnt/stray', '/kubelet/c/staging'])
      host.addPath(p);
    await host.mount(x, { fsType: 'xfs', source: la.path, target: '/kubelet/a/staging', options: [] });
    await host.bind(x, '/kubelet/a/staging', '/mnt/elsewhere', []);
    await host.mount(x, { fsType: 'xfs', source: lb.path, target: '/mnt/stray', options: ['ro'] });
    await host.mount(x, { fsType: 'xfs', source: lc.path, target: '/kubelet/c/staging', options: [] });
    const me = await selfIdentity();
    const inv = {
      volumes: [
        volume(a, { leases: [lease('node-1', { stagingPath: '/kubelet/a/staging', device: la.name })] }),
        volume(b),
        volume(c, { leases: [lease('node-1', { device: lc.name, revokedAt: 't', fencedAt: 't' })] }),
      ],
      nodes: new Map([
        [
          'node-1',
          node('node-1', {
            record: { node: 'node-1', pool: 'p', maxVolumes: 1, host: me.host, registeredAt: '' },
            fenced: [
              { volumeId: c, device: lc.path, backingDev: '', backingIno: '', bootId: me.bootId, at: 't' },
              // Another volume's fence on the device number a has now: not a's.
              { volumeId: dId, device: la.path, backingDev: '', backingIno: '', bootId: me.bootId, at: 't' },
            ],
          }),
        ],
      ]),
    };
    const check = await hostFindings(pool, inv, host, x, { kubeletDir: '/kubelet', probeFrozen: false });
    expect(check.findings.map((f) => [f.kind, f.subject, f.gc?.action ?? f.gcSkipped ?? '-'])).toEqual([
      ['mount-outside-kubelet', '/mnt/elsewhere', '-'],
      ['leaked-mount', '/mnt/stray', 'unmount'],
      ['leaked-loop-device', lb.path, 'detach'],
      ['fenced-filesystem', lc.path, '-'],
      ['leaked-loop-device', lq.path, 'its image is quarantined: decide about the record first'],
    ]);
    expect(check.findings.find((f) => f.kind === 'fenced-filesystem')?.severity).toBe('notice');
    // xfs says nothing of a freeze unless asked to try; the note says so.
    expect(check.notes.join(' ')).toMatch(/1 xfs or btrfs filesystem was not checked/);
    expect(
      host.ops.filter((o) => !o.startsWith('attach') && !o.startsWith('mount') && !o.startsWith('bind')),
    ).toEqual([]);
  });
});

describe('pvcOf', () => {
  it('reads the labels the provisioner recorded, with or without their prefix', () => {
    expect(pvcOf({ labels: { 'pvc/name': 'n', 'pvc/namespace': 'ns', 'pv/name': 'pv' } })).toEqual({
      namespace: 'ns',
      name: 'n',
      pv: 'pv',
    });
    expect(pvcOf({ labels: { 'csi.storage.k8s.io/pvc/name': 'n' } }).name).toBe('n');
  });
});

describe('table', () => {
  it('pads columns to their widest cell', () => {
    expect(
      table(
        ['A', 'LONGER'],
        [
          ['xyz', '1'],
          ['', '22'],
        ],
      ),
    ).toBe('A    LONGER\nxyz  1\n     22\n');
  });
});

describe('Metrics', () => {
  it('counts calls in flight and ABORTED answers, and replaces findings rather than adding', async () => {
    const m = new Metrics();
    m.begin('Controller', 'CreateVolume');
    m.begin('Controller', 'CreateVolume');
    m.observe('Controller', 'CreateVolume', 'ABORTED', 0.001);
    let text = await m.registry.metrics();
    expect(text).toContain('loopvol_operations_in_flight{service="Controller",method="CreateVolume"} 1');
    expect(text).toContain('loopvol_rpc_aborted_total{service="Controller",method="CreateVolume"} 1');
    const f = { scope: 'host' as const, severity: 'problem' as const, subject: 's', detail: '', action: '' };
    m.setFindings('host', [
      { ...f, kind: 'leaked-loop-device' },
      { ...f, kind: 'leaked-loop-device' },
    ]);
    m.setFindings('host', [{ ...f, kind: 'leaked-mount' }]);
    m.lockWaited(0.3, false);
    m.froze('fence');
    text = await m.registry.metrics();
    expect(text).toContain('loopvol_check_findings{scope="host",kind="leaked-loop-device"} 0');
    expect(text).toContain('loopvol_check_findings{scope="host",kind="leaked-mount"} 1');
    expect(text).toContain('loopvol_lock_wait_seconds_count{outcome="busy"} 1');
    expect(text).toContain('loopvol_freezes_total{reason="fence"} 1');
  });
});
