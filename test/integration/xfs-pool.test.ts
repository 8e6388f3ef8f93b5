/**
 * XFS volumes on an XFS pool (reflink), root only: a real XFS pool on a loop device this file makes.
 * A review found that once an image shares blocks (its first snapshot or clone), newer kernels gave its
 * direct-I/O loop device 4096-byte sectors, and the XFS in it (made on 512-byte sectors) no longer
 * mounted: the volume could never be staged again, and its restores and clones never mounted.
 */
import { execFileSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { readSys } from '../../src/host/loop.js';
import { codeOf } from '../helpers/grpc.js';
import { isRoot, MiB, scratchFilesystem, sha256, writeRandom } from '../helpers/host.js';
import { createVolume, publish, stage, teardown } from '../helpers/volumes.js';

const env = new TestEnv();
const sh = (cmd: string, args: string[]): string => execFileSync(cmd, args, { encoding: 'utf8' });
/** A 512-byte O_DIRECT read at byte 512, as a database made on 512-byte sectors does: EINVAL on 4096. */
const directRead512 = (device: string): string => {
  try {
    execFileSync('dd', [`if=${device}`, 'of=/dev/null', 'bs=512', 'skip=1', 'count=1', 'iflag=direct'], {
      stdio: 'pipe',
    });
    return 'OK';
  } catch (err) {
    // dd's first line names the error (its last is the byte count).
    return String((err as { stderr?: Buffer }).stderr ?? err).split('\n')[0] ?? 'failed';
  }
};
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

describe.skipIf(!isRoot())('XFS volumes on an XFS pool', () => {
  let d: DriverProcess;
  let base: string;
  beforeAll(async () => {
    base = await env.dir('xfs-pool');
    const scratch = await scratchFilesystem(base, 'xfs', 2048);
    env.declareOwn(scratch.mountPoint, scratch.device);
    d = await env.driver({ dir: base, poolDir: path.join(scratch.mountPoint, 'pool') });
  });

  it('stages again after its first snapshot, and its restore and clone mount with its data', async () => {
    const cap = mountCap('xfs');
    const src = await createVolume(d, 'xfs-src', cap, 320 * MiB);
    const st = (n: string) => path.join(base, `st-${n}`);
    const tg = (n: string) => path.join(base, 'pods', n, 'mount');
    const down = (id: string, n: string) => teardown(d, id, st(n), tg(n));
    await stage(d, src.id, st('src'), cap);
    await publish(d, src.id, st('src'), tg('src'), cap);
    const sum = await writeRandom(path.join(tg('src'), 'data.bin'), 16, 5);
    await down(src.id, 'src');
    const snap = await d.clients.controller.CreateSnapshot({ name: 'xfs-snap', source_volume_id: src.id });
    const snapId = snap.snapshot?.snapshot_id ?? '';
    const restored = await d.clients.controller.CreateVolume({
      name: 'xfs-restored',
      capacity_range: { required_bytes: String(320 * MiB) },
      volume_capabilities: [cap],
      volume_content_source: { snapshot: { snapshot_id: snapId } },
    });
    const cloned = await d.clients.controller.CreateVolume({
      name: 'xfs-cloned',
      capacity_range: { required_bytes: String(320 * MiB) },
      volume_capabilities: [cap],
      volume_content_source: { volume: { volume_id: src.id } },
    });
    const result: Record<string, { stage: string; sum?: string; sectors?: string }> = {};
    for (const [n, id] of [
      ['src', src.id],
      ['restored', restored.volume?.volume_id ?? ''],
      ['cloned', cloned.volume?.volume_id ?? ''],
    ] as const) {
      if (n !== 'src') {
        await d.clients.controller.ControllerPublishVolume({
          volume_id: id,
          node_id: 'node-1',
          volume_capability: cap,
        });
      }
      const code = await codeOf(stage(d, id, st(n), cap));
      if (code !== 'OK') {
        result[n] = { stage: code };
        continue;
      }
      await publish(d, id, st(n), tg(n), cap);
      const device = sh('findmnt', ['--noheadings', '--output', 'SOURCE', '--mountpoint', st(n)]).trim();
      result[n] = {
        stage: code,
        sum: await sha256(path.join(tg(n), 'data.bin')),
        sectors: sh('blockdev', ['--getss', device]).trim(), // the XFS's, 512: what it was made on
      };
      await down(id, n);
    }
    expect(result).toEqual({
      src: { stage: 'OK', sum, sectors: '512' },
      restored: { stage: 'OK', sum, sectors: '512' },
      cloned: { stage: 'OK', sum, sectors: '512' },
    });
  });

  it('stages over a leftover device that an attach killed before its sector size was set', async () => {
    // A driver killed between `losetup --find` and `losetup --sector-size` leaves the image attached at
    // the kernel's 4096 bytes. The retry reuses that device: it must get the XFS's 512 first, or every
    // mount fails and the volume can never be staged again.
    const cap = mountCap('xfs');
    const vol = await createVolume(d, 'xfs-left', cap, 320 * MiB);
    const st = path.join(base, 'st-left');
    const tg = path.join(base, 'pods', 'left', 'mount');
    await stage(d, vol.id, st, cap);
    await publish(d, vol.id, st, tg, cap);
    const sum = await writeRandom(path.join(tg, 'data.bin'), 8, 21);
    await teardown(d, vol.id, st, tg);
    await d.clients.controller.CreateSnapshot({ name: 'xfs-left-snap', source_volume_id: vol.id });
    const image = path.join(d.poolDir, 'volumes', vol.id, 'disk.img');
    const left = sh('losetup', ['--find', '--show', '--direct-io=on', image]).trim();
    const before = sh('blockdev', ['--getss', left]).trim();
    let after: object;
    // Whether the driver's teardown left the device it took over attached to this volume's image (its
    // number may serve another file's image by then: files run side by side).
    const onThisImage = (): boolean =>
      readSys(`/sys/block/${path.basename(left)}/loop/backing_file`) === image;
    let stillAttached = true;
    try {
      await stage(d, vol.id, st, cap);
      await publish(d, vol.id, st, tg, cap);
      const device = sh('findmnt', ['--noheadings', '--output', 'SOURCE', '--mountpoint', st]).trim();
      after = {
        device,
        sectors: sh('blockdev', ['--getss', device]).trim(),
        sum: await sha256(path.join(tg, 'data.bin')),
      };
      await teardown(d, vol.id, st, tg);
      stillAttached = onThisImage();
    } finally {
      // The device this test attached, when the driver did not take it over and detach it.
      if (onThisImage()) sh('losetup', ['--detach', left]);
    }
    // This kernel gives an image that shares blocks 4096-byte sectors with direct I/O (6.18 does, 6.1
    // does not): the case at hand. Where it gives 512, the leftover is reused as it is.
    expect(['512', '4096']).toContain(before);
    expect({ after, stillAttached }).toEqual({
      after: { device: left, sectors: '512', sum },
      stillAttached: false,
    });
  });

  it('keeps a raw block volume at the sector size its data was written on, after snapshots and clones', async () => {
    // What a pod wrote on 512-byte sectors (a partition table, LVM, O_DIRECT at 512) is read at other
    // offsets, or refused, on a device with 4096-byte sectors: the geometry must not change under it.
    const cap = blockCap();
    const src = await createVolume(d, 'raw-src', cap, 64 * MiB);
    const st = (n: string) => path.join(base, `raw-st-${n}`);
    const tg = (n: string) => path.join(base, 'raw-pods', n, 'dev');
    await stage(d, src.id, st('src'), cap);
    await publish(d, src.id, st('src'), tg('src'), cap);
    const first = sh('blockdev', ['--getss', tg('src')]).trim();
    const sum = await writeRandom(tg('src'), 8, 11);
    const down = (id: string, n: string) => teardown(d, id, st(n), tg(n));
    await down(src.id, 'src');
    const snap = await d.clients.controller.CreateSnapshot({ name: 'raw-snap', source_volume_id: src.id });
    const from = (name: string, source: object) =>
      d.clients.controller.CreateVolume({
        name,
        capacity_range: { required_bytes: String(64 * MiB) },
        volume_capabilities: [cap],
        volume_content_source: source,
      });
    const restored = await from('raw-restored', { snapshot: { snapshot_id: snap.snapshot?.snapshot_id } });
    const cloned = await from('raw-cloned', { volume: { volume_id: src.id } });
    const result: Record<string, { sectors: string; sum: string; directRead512: string }> = {};
    for (const [n, id] of [
      ['src', src.id],
      ['restored', restored.volume?.volume_id ?? ''],
      ['cloned', cloned.volume?.volume_id ?? ''],
    ] as const) {
      if (n !== 'src')
        await d.clients.controller.ControllerPublishVolume({
          volume_id: id,
          node_id: 'node-1',
          volume_capability: cap,
        });
      await stage(d, id, st(n), cap);
      await publish(d, id, st(n), tg(n), cap);
      const head = await fs.open(tg(n), 'r');
      const buf = Buffer.alloc(8 * MiB);
      try {
        await head.read(buf, 0, buf.length, 0);
      } finally {
        await head.close();
      }
      result[n] = {
        sectors: sh('blockdev', ['--getss', tg(n)]).trim(),
        sum: createHash('sha256').update(buf).digest('hex'),
        directRead512: directRead512(tg(n)),
      };
      await down(id, n);
    }
    expect(first).toBe('512');
    expect(result).toEqual({
      src: { sectors: first, sum, directRead512: 'OK' },
      restored: { sectors: first, sum, directRead512: 'OK' },
      cloned: { sectors: first, sum, directRead512: 'OK' },
    });
  });

  it('mounts the restore of an ext4 with 1 KiB blocks that a pod made on a raw block volume', async () => {
    // mke2fs makes 1 KiB blocks on small devices: such an ext4 does not mount on 4096-byte sectors.
    const raw = blockCap();
    const src = await createVolume(d, 'pod-ext4', raw, 64 * MiB);
    const st = (n: string) => path.join(base, `pod-ext4-st-${n}`);
    const tg = (n: string) => path.join(base, 'pod-ext4-pods', n, 'dev');
    await stage(d, src.id, st('src'), raw);
    await publish(d, src.id, st('src'), tg('src'), raw);
    sh('mkfs.ext4', ['-q', '-b', '1024', tg('src')]);
    await teardown(d, src.id, st('src'), tg('src'));
    const snap = await d.clients.controller.CreateSnapshot({
      name: 'pod-ext4-snap',
      source_volume_id: src.id,
    });
    const cap = mountCap('ext4');
    const restored = await d.clients.controller.CreateVolume({
      name: 'pod-ext4-restored',
      capacity_range: { required_bytes: String(64 * MiB) },
      volume_capabilities: [cap],
      volume_content_source: { snapshot: { snapshot_id: snap.snapshot?.snapshot_id } },
    });
    const id = restored.volume?.volume_id ?? '';
    await d.clients.controller.ControllerPublishVolume({
      volume_id: id,
      node_id: 'node-1',
      volume_capability: cap,
    });
    const code = await codeOf(stage(d, id, st('restored'), cap));
    if (code === 'OK')
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: st('restored') });
    expect(code).toBe('OK');
  });

  it('refuses a group snapshot of two raw block volumes in use (no freeze: two instants), takes one of one', async () => {
    const cap = blockCap();
    const a = await createVolume(d, 'grp-a', cap, 16 * MiB);
    const b = await createVolume(d, 'grp-b', cap, 16 * MiB);
    const st = (id: string) => path.join(base, `st-${id}`);
    await stage(d, a.id, st(a.id), cap);
    await stage(d, b.id, st(b.id), cap);
    const both = await codeOf(
      d.clients.group.CreateVolumeGroupSnapshot({ name: 'grp-both', source_volume_ids: [a.id, b.id] }),
    );
    await d.clients.node.NodeUnstageVolume({ volume_id: b.id, staging_target_path: st(b.id) });
    const one = await codeOf(
      d.clients.group.CreateVolumeGroupSnapshot({ name: 'grp-one', source_volume_ids: [a.id, b.id] }),
    );
    await d.clients.node.NodeUnstageVolume({ volume_id: a.id, staging_target_path: st(a.id) });
    expect({ both, one }).toEqual({ both: 'FAILED_PRECONDITION', one: 'OK' });
  });
});
