/**
 * Snapshots, clones, group snapshots and expansion with real data (root only): pools on an XFS with
 * reflink and on an ext4 without, checksums across every operation, disk use of the copies, and online
 * growth verified by statfs.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import type { DriverArgs, DriverProcess } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import {
  diskUsage,
  isRoot,
  leaksUnder,
  MiB,
  scratchFilesystem,
  type ScratchFs,
  sha256,
  writeRandom,
} from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const dir = (tag: string): Promise<string> => env.dir(tag);
const driver = (args: DriverArgs): Promise<DriverProcess> => env.driver(args);

/** Stage and publish a volume like a kubelet; returns the target and a teardown. */
async function use(d: DriverProcess, base: string, id: string, cap: VolumeCapability, tag: string) {
  const staging = path.join(base, `st-${tag}`);
  const target = path.join(base, `pod-${tag}`, 'mount');
  await fs.mkdir(staging, { recursive: true });
  await fs.mkdir(path.dirname(target), { recursive: true });
  await d.clients.controller.ControllerPublishVolume({
    volume_id: id,
    node_id: 'node-1',
    volume_capability: cap,
  });
  await d.clients.node.NodeStageVolume({
    volume_id: id,
    staging_target_path: staging,
    volume_capability: cap,
  });
  await d.clients.node.NodePublishVolume({
    volume_id: id,
    staging_target_path: staging,
    target_path: target,
    volume_capability: cap,
  });
  return {
    staging,
    target,
    async done() {
      await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
      await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
    },
  };
}

async function usedBytes(mountPoint: string): Promise<number> {
  const st = await fs.statfs(mountPoint);
  return (st.blocks - st.bfree) * st.bsize;
}

async function totalBytes(mountPoint: string): Promise<number> {
  const st = await fs.statfs(mountPoint);
  return st.blocks * st.bsize;
}

describe.skipIf(!isRoot()).each([
  ['xfs', true],
  ['ext4', false],
] as const)('snapshots on a pool on %s', (poolFs, reflink) => {
  let pool: ScratchFs;
  let d: DriverProcess;
  let base: string;
  let srcId = '';
  let srcUse: Awaited<ReturnType<typeof use>>;
  let sumA = '';
  let snapId = '';

  beforeAll(async () => {
    base = await dir(`snap-${poolFs}`);
    pool = await scratchFilesystem(base, poolFs, 3072);
    env.declareOwn(pool.mountPoint, pool.device);
    d = await driver({ dir: base, poolDir: path.join(pool.mountPoint, 'pool') });
    srcId =
      (
        await d.clients.controller.CreateVolume({
          name: 'src',
          volume_capabilities: [mountCap('ext4')],
          capacity_range: { required_bytes: String(256 * MiB) },
        })
      ).volume?.volume_id ?? '';
    srcUse = await use(d, base, srcId, mountCap('ext4'), 'src');
    sumA = await writeRandom(path.join(srcUse.target, 'data.bin'), 64, 1);
  });

  it('takes a snapshot of a mounted volume, frozen for the copy, costing what the copy strategy promises', async () => {
    const before = await usedBytes(pool.mountPoint);
    const res = await d.clients.controller.CreateSnapshot({ name: 'snap-a', source_volume_id: srcId });
    const s = res.snapshot;
    snapId = s?.snapshot_id ?? '';
    expect(s).toMatchObject({ source_volume_id: srcId, size_bytes: String(256 * MiB), ready_to_use: true });
    expect(Number(s?.creation_time?.seconds)).toBeGreaterThan(Date.now() / 1000 - 120);
    const cost = (await usedBytes(pool.mountPoint)) - before;
    if (reflink) {
      expect(cost).toBeLessThan(4 * MiB);
      expect(await d.waitForLog((l) => l.includes('"how":"reflink"'))).toBe(true);
    } else {
      expect(cost).toBeGreaterThan(60 * MiB);
      expect(cost).toBeLessThan(110 * MiB);
      expect(await d.waitForLog((l) => l.includes('"how":"sparse-copy"'))).toBe(true);
    }
    expect(await d.waitForLog((l) => l.includes('froze filesystems'))).toBe(true);
    // Idempotent by name; the same name for another volume is refused.
    expect(
      (await d.clients.controller.CreateSnapshot({ name: 'snap-a', source_volume_id: srcId })).snapshot
        ?.snapshot_id,
    ).toBe(snapId);
    const other =
      (
        await d.clients.controller.CreateVolume({
          name: 'other',
          volume_capabilities: [blockCap()],
          capacity_range: { required_bytes: String(16 * MiB) },
        })
      ).volume?.volume_id ?? '';
    expect(
      await codeOf(d.clients.controller.CreateSnapshot({ name: 'snap-a', source_volume_id: other })),
    ).toBe('ALREADY_EXISTS');
  });

  it('restores the data as it was, even after the source changed, into a larger volume', async () => {
    const sumB = await writeRandom(path.join(srcUse.target, 'data.bin'), 64, 2);
    expect(sumB).not.toBe(sumA);
    const restored = await d.clients.controller.CreateVolume({
      name: 'restored',
      volume_capabilities: [mountCap('ext4')],
      capacity_range: { required_bytes: String(384 * MiB) },
      volume_content_source: { snapshot: { snapshot_id: snapId } },
    });
    expect(restored.volume?.content_source?.snapshot?.snapshot_id).toBe(snapId);
    const r = await use(d, base, restored.volume?.volume_id ?? '', mountCap('ext4'), 'restored');
    expect(await sha256(path.join(r.target, 'data.bin'))).toBe(sumA);
    // Grown at stage to fill 384 MiB (the source's filesystem reports about 230 MiB).
    expect(await totalBytes(r.target)).toBeGreaterThan(330 * MiB);
    await r.done();
    expect(
      await codeOf(
        d.clients.controller.CreateVolume({
          name: 'too-small',
          volume_capabilities: [mountCap('ext4')],
          capacity_range: { required_bytes: String(128 * MiB) },
          volume_content_source: { snapshot: { snapshot_id: snapId } },
        }),
      ),
    ).toBe('OUT_OF_RANGE');
  });

  it('preallocates a volume in use without touching its data', async () => {
    const before = await sha256(path.join(srcUse.target, 'data.bin'));
    await d.clients.controller.ControllerModifyVolume({
      volume_id: srcId,
      mutable_parameters: { allocation: 'preallocate' },
    });
    expect(await diskUsage(path.join(d.poolDir, 'volumes', srcId, 'disk.img'))).toBeGreaterThanOrEqual(
      256 * MiB,
    );
    expect(await sha256(path.join(srcUse.target, 'data.bin'))).toBe(before);
  });

  it('clones a volume with its current data', async () => {
    const current = await sha256(path.join(srcUse.target, 'data.bin'));
    const clone = await d.clients.controller.CreateVolume({
      name: 'clone',
      volume_capabilities: [mountCap('ext4')],
      volume_content_source: { volume: { volume_id: srcId } },
    });
    const c = await use(d, base, clone.volume?.volume_id ?? '', mountCap('ext4'), 'clone');
    expect(await sha256(path.join(c.target, 'data.bin'))).toBe(current);
    await c.done();
  });

  it('takes a group snapshot of two volumes at one instant', async () => {
    const second =
      (
        await d.clients.controller.CreateVolume({
          name: 'second',
          volume_capabilities: [blockCap()],
          capacity_range: { required_bytes: String(16 * MiB) },
        })
      ).volume?.volume_id ?? '';
    const g = await d.clients.group.CreateVolumeGroupSnapshot({
      name: 'group-1',
      source_volume_ids: [srcId, second],
    });
    const gs = g.group_snapshot;
    expect(gs?.ready_to_use).toBe(true);
    expect(gs?.snapshots.map((s) => s.source_volume_id).sort()).toEqual([srcId, second].sort());
    expect(new Set(gs?.snapshots.map((s) => s.creation_time?.seconds)).size).toBe(1);
    const again = await d.clients.group.CreateVolumeGroupSnapshot({
      name: 'group-1',
      source_volume_ids: [second, srcId],
    });
    expect(again.group_snapshot?.group_snapshot_id).toBe(gs?.group_snapshot_id);
    const member = gs?.snapshots[0]?.snapshot_id ?? '';
    expect(await codeOf(d.clients.controller.DeleteSnapshot({ snapshot_id: member }))).toBe(
      'INVALID_ARGUMENT',
    );
    const got = await d.clients.group.GetVolumeGroupSnapshot({
      group_snapshot_id: gs?.group_snapshot_id ?? '',
    });
    expect(got.group_snapshot?.snapshots).toHaveLength(2);
    expect(
      await codeOf(
        d.clients.group.GetVolumeGroupSnapshot({
          group_snapshot_id: gs?.group_snapshot_id ?? '',
          snapshot_ids: [member],
        }),
      ),
    ).toBe('INVALID_ARGUMENT');
    await d.clients.group.DeleteVolumeGroupSnapshot({ group_snapshot_id: gs?.group_snapshot_id ?? '' });
    await d.clients.group.DeleteVolumeGroupSnapshot({ group_snapshot_id: gs?.group_snapshot_id ?? '' });
    expect(await codeOf(d.clients.controller.GetSnapshot({ snapshot_id: member }))).toBe('NOT_FOUND');
    expect(await codeOf(d.clients.group.GetVolumeGroupSnapshot({ group_snapshot_id: 'fake-vol-id' }))).toBe(
      'NOT_FOUND',
    );
  });

  it('lists, filters and pages snapshots', async () => {
    const ids = [snapId];
    for (let i = 0; i < 4; i++) {
      ids.push(
        (await d.clients.controller.CreateSnapshot({ name: `page-${i}`, source_volume_id: srcId })).snapshot
          ?.snapshot_id ?? '',
      );
    }
    const first = await d.clients.controller.ListSnapshots({ max_entries: 2 });
    expect(first.entries).toHaveLength(2);
    expect(first.next_token).not.toBe('');
    const rest = await d.clients.controller.ListSnapshots({ starting_token: first.next_token });
    expect([...first.entries, ...rest.entries].map((e) => e.snapshot?.snapshot_id).sort()).toEqual(
      [...ids].sort(),
    );
    expect(
      (await d.clients.controller.ListSnapshots({ snapshot_id: snapId })).entries.map(
        (e) => e.snapshot?.snapshot_id,
      ),
    ).toEqual([snapId]);
    expect((await d.clients.controller.ListSnapshots({ source_volume_id: srcId })).entries).toHaveLength(5);
    expect(
      (await d.clients.controller.ListSnapshots({ source_volume_id: 'vol-ffffffffffffffffffffffffffffffff' }))
        .entries,
    ).toEqual([]);
    expect((await d.clients.controller.ListSnapshots({ snapshot_id: 'none-exist-id' })).entries).toEqual([]);
    expect(await codeOf(d.clients.controller.ListSnapshots({ starting_token: 'bogus' }))).toBe('ABORTED');
    for (const id of ids.slice(1)) await d.clients.controller.DeleteSnapshot({ snapshot_id: id });
    expect((await d.clients.controller.GetSnapshot({ snapshot_id: snapId })).snapshot?.snapshot_id).toBe(
      snapId,
    );
  });

  it('keeps a snapshot usable after its source volume is deleted', async () => {
    await srcUse.done();
    await d.clients.controller.DeleteVolume({ volume_id: srcId });
    const restored = await d.clients.controller.CreateVolume({
      name: 'orphan-restore',
      volume_capabilities: [mountCap('ext4')],
      volume_content_source: { snapshot: { snapshot_id: snapId } },
    });
    const r = await use(d, base, restored.volume?.volume_id ?? '', mountCap('ext4'), 'orphan');
    expect(await sha256(path.join(r.target, 'data.bin'))).toBe(sumA);
    await r.done();
    await d.clients.controller.DeleteSnapshot({ snapshot_id: snapId });
    await d.clients.controller.DeleteSnapshot({ snapshot_id: snapId });
    expect(await leaksUnder(path.join(pool.mountPoint, 'pool'))).toEqual({ loops: [], mounts: [] });
  });
});

describe.skipIf(!isRoot())('snapshot crash safety', () => {
  it('a CreateSnapshot killed after its copy is redone once by its retry', async () => {
    const base = await dir('snapcrash');
    const a = await driver({ dir: base, env: { LOOPVOL_FAILPOINT: 'create-snapshot:image-written' } });
    const id =
      (
        await a.clients.controller.CreateVolume({
          name: 'v',
          volume_capabilities: [blockCap()],
          capacity_range: { required_bytes: String(8 * MiB) },
        })
      ).volume?.volume_id ?? '';
    expect(await codeOf(a.clients.controller.CreateSnapshot({ name: 's', source_volume_id: id }))).not.toBe(
      'OK',
    );
    const b = await driver({ dir: base });
    const s = await b.clients.controller.CreateSnapshot({ name: 's', source_volume_id: id });
    expect(await fs.readdir(path.join(base, 'pool', 'snapshots'))).toEqual([s.snapshot?.snapshot_id]);
    expect((await b.clients.controller.ListSnapshots({})).entries).toHaveLength(1);
  });
});

const hasCapSysResource = async (): Promise<boolean> => {
  const status = await fs.readFile('/proc/self/status', 'utf8');
  const hex = /CapEff:\s*([0-9a-f]+)/.exec(status)?.[1] ?? '0';
  return (BigInt(`0x${hex}`) & (1n << 24n)) !== 0n;
};

describe.skipIf(!isRoot())('expansion', () => {
  let d: DriverProcess;
  let base: string;
  beforeAll(async () => {
    base = await dir('expand');
    d = await driver({ dir: base });
  });

  async function expandMounted(fsType: string, from: number, to: number, name = `grow-${fsType}`) {
    const cap = mountCap(fsType);
    const id =
      (
        await d.clients.controller.CreateVolume({
          name,
          volume_capabilities: [cap],
          capacity_range: { required_bytes: String(from) },
        })
      ).volume?.volume_id ?? '';
    const u = await use(d, base, id, cap, name);
    const sum = await writeRandom(path.join(u.target, 'keep.bin'), 16, 9);
    const before = await totalBytes(u.target);
    const ce = await d.clients.controller.ControllerExpandVolume({
      volume_id: id,
      capacity_range: { required_bytes: String(to) },
    });
    expect(ce).toEqual({ capacity_bytes: String(to), node_expansion_required: true });
    expect(await diskUsage(path.join(d.poolDir, 'volumes', id, 'disk.img'))).toBeLessThan(to / 2); // still sparse
    return { id, cap, u, sum, before };
  }

  it.each([
    ['xfs', 320 * MiB, 640 * MiB],
    ['btrfs', 256 * MiB, 512 * MiB], // its smallest size (below 256 MiB the kernel cannot grow it)
  ])('grows a mounted %s online, verified by statfs, keeping the data', async (fsType, from, to) => {
    const { id, u, sum, before } = await expandMounted(fsType, from, to);
    const ne = await d.clients.node.NodeExpandVolume({
      volume_id: id,
      volume_path: u.target,
      capacity_range: { required_bytes: String(to) },
    });
    expect(ne.capacity_bytes).toBe(String(to));
    const after = await totalBytes(u.target);
    expect(after - before).toBeGreaterThan((to - from) * 0.9);
    expect(await sha256(path.join(u.target, 'keep.bin'))).toBe(sum);
    await d.clients.node.NodeExpandVolume({ volume_id: id, volume_path: u.target });
    expect(await totalBytes(u.target)).toBe(after);
    await u.done();
  });

  it('grows ext4 online where allowed, otherwise says so and grows it at the next stage', async () => {
    const from = 128 * MiB;
    const to = 384 * MiB;
    const { id, cap, u, sum, before } = await expandMounted('ext4', from, to);
    const expand = () =>
      d.clients.node.NodeExpandVolume({
        volume_id: id,
        volume_path: u.target,
        capacity_range: { required_bytes: String(to) },
      });
    if (await hasCapSysResource()) {
      await expand();
      expect((await totalBytes(u.target)) - before).toBeGreaterThan((to - from) * 0.9);
      await u.done();
      return;
    }
    const e = await errorOf(expand());
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain('CAP_SYS_RESOURCE');
    expect(await totalBytes(u.target)).toBe(before);
    await u.done();
    const again = await use(d, base, id, cap, 'grow-ext4-again');
    expect((await totalBytes(again.target)) - before).toBeGreaterThan((to - from) * 0.9);
    expect(await sha256(path.join(again.target, 'keep.bin'))).toBe(sum);
    await again.done();
  });

  // resize2fs leaves off a last block group too small to keep (about 6 MiB here): the stage that grew
  // it answered INTERNAL, and its retry OK, when the check after the growth allowed less than the
  // decision to grow did (a hostile tester's find).
  it.each([
    [100, 134],
    [100, 262],
  ])(
    'grows ext4 from %i to %i MiB at its next stage, short only of a last group too small to keep',
    async (from, to) => {
      const { id, cap, u, sum, before } = await expandMounted(
        'ext4',
        from * MiB,
        to * MiB,
        `grow-ext4-${to}`,
      );
      await u.done();
      const again = await use(d, base, id, cap, `grow-ext4-${to}-again`);
      expect((await totalBytes(again.target)) - before).toBeGreaterThan((to - from - 8) * MiB * 0.8);
      expect(await sha256(path.join(again.target, 'keep.bin'))).toBe(sum);
      await again.done();
    },
  );

  it('refreshes a block volume and keeps a preallocated image preallocated', async () => {
    const id =
      (
        await d.clients.controller.CreateVolume({
          name: 'grow-block',
          volume_capabilities: [blockCap()],
          capacity_range: { required_bytes: String(32 * MiB) },
          parameters: { allocation: 'preallocate' },
        })
      ).volume?.volume_id ?? '';
    const u = await use(d, base, id, blockCap(), 'grow-block');
    await d.clients.controller.ControllerExpandVolume({
      volume_id: id,
      capacity_range: { required_bytes: String(64 * MiB) },
    });
    expect(await diskUsage(path.join(d.poolDir, 'volumes', id, 'disk.img'))).toBeGreaterThanOrEqual(64 * MiB);
    const ne = await d.clients.node.NodeExpandVolume({ volume_id: id, volume_path: u.target });
    expect(ne.capacity_bytes).toBe(String(64 * MiB));
    const dev =
      (await fs.readFile('/proc/self/mountinfo', 'utf8'))
        .split('\n')
        .find((l) => l.split(' ')[4] === u.target)
        ?.split(' ')[3] ?? '';
    expect(Number(await fs.readFile(`/sys/block${dev}/size`, 'utf8')) * 512).toBe(64 * MiB);
    await u.done();
  });

  it('never shrinks (a smaller request is OK at the current size, as the spec asks), and is idempotent', async () => {
    const id =
      (
        await d.clients.controller.CreateVolume({
          name: 'no-shrink',
          volume_capabilities: [blockCap()],
          capacity_range: { required_bytes: String(64 * MiB) },
        })
      ).volume?.volume_id ?? '';
    expect(
      (
        await d.clients.controller.ControllerExpandVolume({
          volume_id: id,
          capacity_range: { required_bytes: String(32 * MiB) },
        })
      ).capacity_bytes,
    ).toBe(String(64 * MiB));
    expect(
      (
        await d.clients.controller.ControllerExpandVolume({
          volume_id: id,
          capacity_range: { required_bytes: String(64 * MiB) },
        })
      ).capacity_bytes,
    ).toBe(String(64 * MiB));
    expect(await codeOf(d.clients.controller.ControllerExpandVolume({ volume_id: id }))).toBe(
      'INVALID_ARGUMENT',
    );
    expect(
      await codeOf(
        d.clients.controller.ControllerExpandVolume({
          volume_id: 'vol-ffffffffffffffffffffffffffffffff',
          capacity_range: { required_bytes: '1' },
        }),
      ),
    ).toBe('NOT_FOUND');
  });
});
