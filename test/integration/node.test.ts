/**
 * The Node service with real loop devices, real mkfs and real mounts (root only): the full lifecycle
 * for each filesystem and for raw block, data that survives it, read-only that really is, refusals that
 * leave data untouched, restarts, the node-side fence, and rollback. Nothing may be left behind.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import type { DriverArgs, DriverProcess } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { cleanupUnder, isRoot, leaksUnder, MiB, SLOW, sha256, writeRandom } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const dir = (tag: string): Promise<string> => env.dir(tag);
const driver = (args: DriverArgs): Promise<DriverProcess> => env.driver(args);

/** A volume and the paths a kubelet would use for it on one node. */
class Vol {
  constructor(
    readonly d: DriverProcess,
    readonly id: string,
    readonly cap: VolumeCapability,
    readonly base: string,
  ) {}
  get staging(): string {
    return path.join(this.base, `staging-${this.id}`);
  }
  target(n = 1): string {
    return path.join(this.base, `pod-${n}`, this.id);
  }
  get image(): string {
    return path.join(this.d.poolDir, 'volumes', this.id, 'disk.img');
  }
  async stage(cap = this.cap, staging = this.staging) {
    await fs.mkdir(staging, { recursive: true });
    return this.d.clients.node.NodeStageVolume({
      volume_id: this.id,
      staging_target_path: staging,
      volume_capability: cap,
    });
  }
  async publish(n = 1, readonly = false, cap = this.cap) {
    await fs.mkdir(path.dirname(this.target(n)), { recursive: true });
    return this.d.clients.node.NodePublishVolume({
      volume_id: this.id,
      staging_target_path: this.staging,
      target_path: this.target(n),
      volume_capability: cap,
      readonly,
    });
  }
  unpublish(n = 1) {
    return this.d.clients.node.NodeUnpublishVolume({ volume_id: this.id, target_path: this.target(n) });
  }
  unstage(staging = this.staging) {
    return this.d.clients.node.NodeUnstageVolume({ volume_id: this.id, staging_target_path: staging });
  }
  async loops(): Promise<string[]> {
    return (await leaksUnder(path.dirname(this.image))).loops;
  }
}

async function makeVolume(
  d: DriverProcess,
  base: string,
  name: string,
  cap: VolumeCapability,
  size = 400 * MiB,
  params: Record<string, string> = {},
): Promise<Vol> {
  const res = await d.clients.controller.CreateVolume({
    name,
    capacity_range: { required_bytes: String(size) },
    volume_capabilities: [cap],
    parameters: params,
  });
  const id = res.volume?.volume_id ?? '';
  await d.clients.controller.ControllerPublishVolume({
    volume_id: id,
    node_id: 'node-1',
    volume_capability: cap,
  });
  return new Vol(d, id, cap, base);
}

async function isMountPoint(p: string): Promise<boolean> {
  const text = await fs.readFile('/proc/self/mountinfo', 'utf8');
  return text.split('\n').some((l) => l.split(' ')[4] === p);
}

describe.skipIf(!isRoot())('node lifecycle', () => {
  let d: DriverProcess;
  let base: string;
  beforeAll(async () => {
    base = await dir('node');
    d = await driver({ dir: base });
  });

  it.each(['ext4', 'xfs', 'btrfs'])(
    'stages, publishes and tears down %s, keeping the data',
    async (fsType) => {
      const v = await makeVolume(d, base, `pvc-life-${fsType}`, mountCap(fsType));
      await v.stage();
      await v.stage();
      expect(await isMountPoint(v.staging)).toBe(true);
      await v.publish();
      await v.publish();
      const sum = await writeRandom(path.join(v.target(), 'data.bin'), 8, 7);
      const stats = await d.clients.node.NodeGetVolumeStats({ volume_id: v.id, volume_path: v.target() });
      const bytes = stats.usage.find((u) => u.unit === 'BYTES');
      expect(Number(bytes?.total)).toBeGreaterThan(300 * MiB);
      // btrfs accounts written data at its next transaction commit, not at fsync.
      if (fsType !== 'btrfs') expect(Number(bytes?.used)).toBeGreaterThanOrEqual(8 * MiB);
      expect(stats.volume_condition?.abnormal).toBe(false);
      if (fsType !== 'btrfs')
        expect(Number(stats.usage.find((u) => u.unit === 'INODES')?.total)).toBeGreaterThan(0);

      await v.unpublish();
      await v.unpublish();
      await expect(fs.stat(v.target())).rejects.toThrow(/ENOENT/);
      await v.unstage();
      await v.unstage();
      expect(await isMountPoint(v.staging)).toBe(false);
      expect(await v.loops()).toEqual([]);

      await v.stage();
      await v.publish();
      expect(await sha256(path.join(v.target(), 'data.bin'))).toBe(sum);
      await v.unpublish();

      // Read-only publish really is read-only.
      await v.publish(2, true);
      expect(await sha256(path.join(v.target(2), 'data.bin'))).toBe(sum);
      await expect(fs.writeFile(path.join(v.target(2), 'new'), 'x')).rejects.toThrow(/EROFS/);
      expect(await codeOf(v.publish(2, false))).toBe('ALREADY_EXISTS');
      await v.unpublish(2);
      await v.unstage();
      expect(await v.loops()).toEqual([]);
    },
  );

  it('attaches loop devices with direct I/O and reuses one attachment per image', async () => {
    const v = await makeVolume(d, base, 'pvc-dio', mountCap('ext4'), 64 * MiB);
    await v.stage();
    const loops = await v.loops();
    expect(loops).toHaveLength(1);
    const dev = (loops[0] ?? '').split(' ')[0]?.replace('/dev/', '') ?? '';
    expect((await fs.readFile(`/sys/block/${dev}/loop/dio`, 'utf8')).trim()).toBe('1');
    await v.unstage();
  });

  it('stages and publishes a raw block volume, read-only as the access mode says', async () => {
    const v = await makeVolume(d, base, 'pvc-block', blockCap(), 32 * MiB);
    await v.stage();
    await v.stage();
    await v.publish();
    await v.publish();
    expect((await fs.stat(v.target())).isBlockDevice()).toBe(true);
    const payload = Buffer.alloc(MiB, 0x5a);
    const handle = await fs.open(v.target(), 'r+');
    await handle.write(payload, 0, payload.length, 4 * MiB);
    await handle.sync();
    await handle.close();
    const stats = await d.clients.node.NodeGetVolumeStats({ volume_id: v.id, volume_path: v.target() });
    expect(stats.usage[0]).toMatchObject({ unit: 'BYTES', total: String(32 * MiB) });
    await v.unpublish();
    await expect(fs.stat(v.target())).rejects.toThrow(/ENOENT/);

    await v.publish(2, true);
    const ro = await fs.open(v.target(2), 'r');
    const back = Buffer.alloc(MiB);
    await ro.read(back, 0, MiB, 4 * MiB);
    await ro.close();
    expect(back.equals(payload)).toBe(true);
    // A read-only publish binds the staged device itself, read-only (the runtime's device rule enforces it).
    const line = (await fs.readFile('/proc/self/mountinfo', 'utf8'))
      .split('\n')
      .find((l) => l.split(' ')[4] === v.target(2));
    expect(line?.split(' ')[5]?.split(',')).toContain('ro');
    expect(await v.loops()).toHaveLength(1);
    await v.unpublish(2);
    expect(await v.loops()).toHaveLength(1);
    await v.unstage();
    expect(await v.loops()).toEqual([]);

    // Staged read-only (a reader's access mode): the device itself refuses writes.
    const reader = blockCap('SINGLE_NODE_READER_ONLY');
    await v.stage(reader);
    await v.publish(3, true, reader);
    const rw = await fs.open(v.target(3), 'r+');
    await expect(rw.write(payload, 0, 4096, 0)).rejects.toThrow(/EPERM|EROFS|EACCES/);
    await rw.close();
    await v.unpublish(3);
    await v.unstage();
    expect(await v.loops()).toEqual([]);
  });

  it('shows a block reader on this node what a writer wrote: one device, one cache (spec: NodePublishVolume)', async () => {
    const cap = blockCap('SINGLE_NODE_MULTI_WRITER');
    const v = await makeVolume(d, base, 'pvc-block-coherent', cap, 16 * MiB);
    await v.stage();
    await v.publish(1, false);
    await v.publish(2, true);
    const reader = await fs.open(v.target(2), 'r');
    const writer = await fs.open(v.target(1), 'r+');
    const seen = Buffer.alloc(4096);
    for (const fill of [0x11, 0x22, 0x33]) {
      await reader.read(seen, 0, 4096, 8 * MiB); // cached by the reader's device, if it had its own
      await writer.write(Buffer.alloc(4096, fill), 0, 4096, 8 * MiB);
      await writer.sync();
      await reader.read(seen, 0, 4096, 8 * MiB);
      expect(seen.every((b) => b === fill)).toBe(true);
    }
    await reader.close();
    await writer.close();
    await v.unpublish(2);
    await v.unpublish(1);
    await v.unstage();
    expect(await v.loops()).toEqual([]);
  });

  it('follows the spec table for a second target and for arguments that changed', async () => {
    const v = await makeVolume(d, base, 'pvc-targets', mountCap('ext4'), 64 * MiB);
    expect(await codeOf(v.publish())).toBe('FAILED_PRECONDITION'); // not staged yet
    expect(
      await codeOf(
        d.clients.node.NodePublishVolume({
          volume_id: v.id,
          target_path: v.target(),
          volume_capability: v.cap,
          staging_target_path: '',
        }),
      ),
    ).toBe('FAILED_PRECONDITION');
    await v.stage();
    expect(await codeOf(v.stage(mountCap('xfs')))).toBe('ALREADY_EXISTS');
    expect(await codeOf(v.stage(mountCap('ext4'), path.join(base, 'elsewhere')))).toBe('FAILED_PRECONDITION');
    // Staged as ext4: another fs_type at a new target asks for what the volume is not ("exceeds
    // capabilities"); at the target already published, it is an incompatible repeat.
    expect(await codeOf(v.publish(1, false, mountCap('xfs')))).toBe('FAILED_PRECONDITION');
    await expect(fs.stat(v.target(1))).rejects.toThrow(/ENOENT/);
    await v.publish(1);
    expect(await codeOf(v.publish(1, false, mountCap('xfs')))).toBe('ALREADY_EXISTS');
    expect(await codeOf(v.publish(1, false, mountCap('')))).toBe('OK');
    expect(await codeOf(v.publish(2, false, mountCap('xfs', 'SINGLE_NODE_MULTI_WRITER')))).toBe(
      'FAILED_PRECONDITION',
    );
    expect(await codeOf(v.publish(2))).toBe('FAILED_PRECONDITION'); // SINGLE_NODE_WRITER: one target
    const multi = mountCap('ext4', 'SINGLE_NODE_MULTI_WRITER');
    await v.publish(3, false, multi);
    expect(await codeOf(v.unstage())).toBe('FAILED_PRECONDITION'); // still published
    await v.unpublish(1);
    await v.unpublish(3);
    await v.unstage();
    expect(await v.loops()).toEqual([]);
  });

  it('refuses a device holding another filesystem and leaves it byte for byte intact', async () => {
    const v = await makeVolume(d, base, 'pvc-otherfs', mountCap('xfs'), 320 * MiB);
    await v.stage();
    await v.publish();
    await writeRandom(path.join(v.target(), 'keep.bin'), 4, 11);
    await v.unpublish();
    await v.unstage();
    const before = await sha256(v.image);
    const e = await errorOf(v.stage(mountCap('ext4')));
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain('xfs');
    expect(await sha256(v.image)).toBe(before);
    expect(await v.loops()).toEqual([]);
    expect(await isMountPoint(v.staging)).toBe(false);
  });

  it('refuses a partition table, and a volume that held data without a filesystem', async () => {
    const pt = await makeVolume(d, base, 'pvc-mbr', mountCap('ext4'), 16 * MiB);
    const mbr = Buffer.alloc(512);
    mbr.set([0, 0, 0, 0, 0x83, 0, 0, 0], 446);
    mbr.writeUInt32LE(2048, 454);
    mbr.writeUInt32LE(16384, 458);
    mbr[510] = 0x55;
    mbr[511] = 0xaa;
    await fs.writeFile(pt.image, mbr, { flag: 'r+' });
    const before = await sha256(pt.image);
    const e = await errorOf(pt.stage());
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain('partition table');
    expect(await sha256(pt.image)).toBe(before);

    const raw = await makeVolume(d, base, 'pvc-raw-then-fs', blockCap(), 16 * MiB);
    await raw.stage();
    await raw.unstage();
    const e2 = await errorOf(raw.stage(mountCap('ext4')));
    expect(e2.code).toBe('FAILED_PRECONDITION');
    expect(e2.details).toContain('not formatted');
    expect(await raw.loops()).toEqual([]);
  });

  it('rolls back what a failed stage did', async () => {
    const v = await makeVolume(d, base, 'pvc-badflag', mountCap('ext4'), 32 * MiB);
    const bad = mountCap('ext4', 'SINGLE_NODE_WRITER', ['data=nonsense']);
    const e = await errorOf(v.stage(bad));
    expect(e.code).toBe('INTERNAL');
    expect(e.details).toContain('data=nonsense');
    expect(await v.loops()).toEqual([]);
    expect(await isMountPoint(v.staging)).toBe(false);
    expect(await fs.readdir(path.join(d.poolDir, 'volumes', v.id, 'leases')).catch(() => [])).toEqual([]);
    await v.stage();
    await v.unstage();
  });

  it('mounts an XFS clone beside its source on the same node', async () => {
    const src = await makeVolume(d, base, 'pvc-xfs-src', mountCap('xfs'), 320 * MiB);
    await src.stage();
    await src.publish();
    const sum = await writeRandom(path.join(src.target(), 'f.bin'), 4, 3);
    const clone = await d.clients.controller.CreateVolume({
      name: 'pvc-xfs-clone',
      volume_capabilities: [mountCap('xfs')],
      volume_content_source: { volume: { volume_id: src.id } },
    });
    const cid = clone.volume?.volume_id ?? '';
    await d.clients.controller.ControllerPublishVolume({
      volume_id: cid,
      node_id: 'node-1',
      volume_capability: mountCap('xfs'),
    });
    const c = new Vol(d, cid, mountCap('xfs'), base);
    await c.stage();
    await c.publish();
    expect(await sha256(path.join(c.target(), 'f.bin'))).toBe(sum);
    for (const x of [c, src]) {
      await x.unpublish();
      await x.unstage();
    }
  });

  it('creates loop devices through /dev/loop-control when the existing ones are taken', async () => {
    const count = 12; // more than the loop0–loop7 a machine starts with
    const vols = await Promise.all(
      Array.from({ length: count }, (_, i) => makeVolume(d, base, `pvc-many-${i}`, blockCap(), 4 * MiB)),
    );
    for (const v of vols) await v.stage();
    const devices = new Set<string>();
    for (const v of vols) for (const l of await v.loops()) devices.add(l.split(' ')[0] ?? '');
    expect(devices.size).toBe(count);
    for (const v of vols) await v.unstage();
    for (const v of vols) expect(await v.loops()).toEqual([]);
  });

  it('refuses to mount at the root or inside the pool', async () => {
    const v = await makeVolume(d, base, 'pvc-paths', mountCap('ext4'), 16 * MiB);
    for (const bad of ['/', d.poolDir, path.join(d.poolDir, 'volumes'), path.dirname(d.poolDir)]) {
      expect(
        await codeOf(
          d.clients.node.NodeStageVolume({
            volume_id: v.id,
            staging_target_path: bad,
            volume_capability: v.cap,
          }),
        ),
        bad,
      ).toBe('INVALID_ARGUMENT');
    }
    await v.stage();
    expect(
      await codeOf(
        d.clients.node.NodePublishVolume({
          volume_id: v.id,
          staging_target_path: v.staging,
          target_path: path.join(d.poolDir, 'x'),
          volume_capability: v.cap,
        }),
      ),
    ).toBe('INVALID_ARGUMENT');
    await v.unstage();
    expect(await v.loops()).toEqual([]);
  });

  it('answers stats errors by the spec', async () => {
    const v = await makeVolume(d, base, 'pvc-stats', mountCap('ext4'), 32 * MiB);
    expect(
      await codeOf(
        d.clients.node.NodeGetVolumeStats({
          volume_id: 'vol-ffffffffffffffffffffffffffffffff',
          volume_path: '/tmp',
        }),
      ),
    ).toBe('NOT_FOUND');
    expect(
      await codeOf(d.clients.node.NodeGetVolumeStats({ volume_id: v.id, volume_path: 'some/path' })),
    ).toBe('NOT_FOUND');
    expect(
      await codeOf(
        d.clients.node.NodeGetVolumeStats({ volume_id: v.id, volume_path: path.join(base, 'nothing-here') }),
      ),
    ).toBe('NOT_FOUND');
    expect(await codeOf(d.clients.node.NodeGetVolumeStats({ volume_id: v.id }))).toBe('INVALID_ARGUMENT');
    await v.stage();
    await v.publish();
    await fs.rename(v.image, `${v.image}.away`);
    const sick = await d.clients.node.NodeGetVolumeStats({ volume_id: v.id, volume_path: v.target() });
    await fs.rename(`${v.image}.away`, v.image);
    expect(sick.volume_condition?.abnormal).toBe(true);
    expect(sick.volume_condition?.message).toContain('missing');
    await v.unpublish();
    await v.unstage();
  });
});

describe.skipIf(!isRoot())('restarts and crashes', () => {
  it('a restarted plugin serves and tears down what its predecessor set up', async () => {
    const base = await dir('restart');
    const a = await driver({ dir: base });
    const v = await makeVolume(a, base, 'pvc-restart', mountCap('ext4'), 64 * MiB);
    await v.stage();
    await v.publish();
    const sum = await writeRandom(path.join(v.target(), 'x.bin'), 2, 5);
    await a.stop('SIGKILL');
    const b = await driver({ dir: base });
    const w = new Vol(b, v.id, v.cap, base);
    await w.stage();
    await w.publish();
    expect(
      (await b.clients.node.NodeGetVolumeStats({ volume_id: v.id, volume_path: w.target() })).volume_condition
        ?.abnormal,
    ).toBe(false);
    expect(await sha256(path.join(w.target(), 'x.bin'))).toBe(sum);
    expect(await w.loops()).toHaveLength(1);
    await w.unpublish();
    await w.unstage();
    expect(await leaksUnder(base)).toEqual({ loops: [], mounts: [] });
  });

  it.each(['stage:attached', 'stage:formatted', 'stage:mounted'])(
    'a NodeStageVolume killed at %s is completed by its retry',
    async (point) => {
      const base = await dir('stagecrash');
      const a = await driver({ dir: base, env: { LOOPVOL_FAILPOINT: point } });
      const v = await makeVolume(a, base, 'pvc-stagecrash', mountCap('ext4'), 64 * MiB);
      expect(await codeOf(v.stage())).not.toBe('OK');
      const b = await driver({ dir: base });
      const w = new Vol(b, v.id, v.cap, base);
      await w.stage();
      await w.publish();
      await fs.writeFile(path.join(w.target(), 'ok'), 'ok');
      expect(await w.loops()).toHaveLength(1);
      await w.unpublish();
      await w.unstage();
      expect(await leaksUnder(base)).toEqual({ loops: [], mounts: [] });
    },
  );

  it('a mkfs cut short is made again, never kept: a half-made XFS does not become the volume', async () => {
    const base = await dir('mkfscut');
    // mkfs.xfs marks its superblock "in progress" first and clears it last: this one is killed after
    // writing everything else, which blkid still reports as xfs and the kernel refuses to mount. Asked
    // what it knows (no arguments), it answers as the real one.
    const bin = path.join(base, 'bin');
    await fs.mkdir(bin);
    await fs.writeFile(
      path.join(bin, 'mkfs.xfs'),
      `#!/bin/sh\n[ $# -eq 0 ] && exec /usr/sbin/mkfs.xfs\nfor a; do dev=$a; done\n/usr/sbin/mkfs.xfs "$@" && xfs_db -x -c 'sb 0' -c 'write inprogress 1' "$dev" >/dev/null\nkill -9 $$\n`,
      { mode: 0o755 },
    );
    const a = await driver({ dir: base, env: { PATH: `${bin}:${process.env.PATH ?? ''}` } });
    const v = await makeVolume(a, base, 'pvc-mkfscut', mountCap('xfs'), 300 * MiB);
    expect(await codeOf(v.stage())).not.toBe('OK');
    await a.stop();
    const b = await driver({ dir: base });
    const w = new Vol(b, v.id, v.cap, base);
    await w.stage();
    expect(await b.waitForLog((l) => l.includes('formatting again over an unfinished mkfs'))).toBe(true);
    await w.publish();
    await fs.writeFile(path.join(w.target(), 'ok'), 'ok');
    await w.unpublish();
    await w.unstage();
    expect(await leaksUnder(base)).toEqual({ loops: [], mounts: [] });
  });

  it.each(['xfs', 'btrfs'] as const)(
    'a %s stage killed between its mount and its growth is grown by the retry',
    async (fsType) => {
      const base = await dir(`growcut-${fsType}`);
      const a = await driver({ dir: base });
      const v = await makeVolume(a, base, `pvc-growcut-${fsType}`, mountCap(fsType), 300 * MiB);
      await v.stage();
      await v.unstage();
      await a.clients.controller.ControllerExpandVolume({
        volume_id: v.id,
        capacity_range: { required_bytes: String(600 * MiB) },
        volume_capability: v.cap,
      });
      await a.stop();
      // xfs and btrfs grow once mounted: this stage dies right after its mount.
      const b = await driver({ dir: base, env: { LOOPVOL_FAILPOINT: 'stage:mounted' } });
      expect(await codeOf(new Vol(b, v.id, v.cap, base).stage())).not.toBe('OK');
      const c = await driver({ dir: base });
      const w = new Vol(c, v.id, v.cap, base);
      await w.stage();
      const st = await fs.statfs(w.staging);
      expect(st.blocks * st.bsize).toBeGreaterThan(500 * MiB);
      await w.unstage();
      expect(await leaksUnder(base)).toEqual({ loops: [], mounts: [] });
    },
  );

  it('a used XFS whose initialized marker went missing is kept, whatever its formatting record says', async () => {
    const base = await dir('markerlost');
    const a = await driver({ dir: base });
    const v = await makeVolume(a, base, 'pvc-markerlost', mountCap('xfs'), 300 * MiB);
    await v.stage();
    await v.publish();
    await fs.writeFile(path.join(v.target(), 'precious'), 'data');
    await v.unpublish();
    await v.unstage();
    // An operator moved it, or a network filesystem's client briefly does not see it.
    const marker = path.join(a.poolDir, 'volumes', v.id, 'initialized');
    await fs.stat(path.join(a.poolDir, 'volumes', v.id, 'formatting'));
    await fs.rename(marker, `${marker}.aside`);
    await v.stage();
    await v.publish();
    expect(await fs.readFile(path.join(v.target(), 'precious'), 'utf8')).toBe('data');
    expect(a.logs().some((l) => l.includes('formatting again over an unfinished mkfs'))).toBe(false);
    await v.unpublish();
    await v.unstage();
    expect(await leaksUnder(base)).toEqual({ loops: [], mounts: [] });
  });

  it('a mkfs does not outlive a driver killed by SIGKILL, and the retry formats the volume', async () => {
    const base = await dir('mkfsorphan');
    // mkfs.btrfs writes through a descriptor that does not keep others out: left running, it would
    // write over the filesystem the retry makes. This one waits before it formats.
    const bin = path.join(base, 'bin');
    const pidFile = path.join(base, 'mkfs.pid');
    await fs.mkdir(bin);
    await fs.writeFile(
      path.join(bin, 'mkfs.btrfs'),
      `#!/bin/sh\ncase "$*" in *list-all*) exec /usr/sbin/mkfs.btrfs "$@";; esac\necho $$ > ${pidFile}\nsleep 2\nexec /usr/sbin/mkfs.btrfs "$@"\n`,
      { mode: 0o755 },
    );
    const a = await driver({ dir: base, env: { PATH: `${bin}:${process.env.PATH ?? ''}` } });
    const v = await makeVolume(a, base, 'pvc-mkfsorphan', mountCap('btrfs'), 128 * MiB);
    const staging = codeOf(v.stage());
    let pid = 0;
    for (let i = 0; i < 600 * SLOW && !pid; i++) {
      pid = Number((await fs.readFile(pidFile, 'utf8').catch(() => '')).trim());
      if (!pid) await new Promise((r) => setTimeout(r, 50));
    }
    expect(pid).toBeGreaterThan(0);
    await a.stop('SIGKILL');
    expect(await staging).not.toBe('OK');
    await new Promise((r) => setTimeout(r, 300));
    // Gone, or dead and waiting for the host's init to reap it.
    const state = await fs.readFile(`/proc/${pid}/status`, 'utf8').catch(() => 'State: gone');
    expect(/^State:\s+(\S+)/m.exec(state)?.[1]).toMatch(/^(gone|Z)$/);
    const b = await driver({ dir: base });
    const w = new Vol(b, v.id, v.cap, base);
    await w.stage();
    await w.publish();
    await fs.writeFile(path.join(w.target(), 'ok'), 'ok');
    await new Promise((r) => setTimeout(r, 2_500)); // as long as the killed mkfs would have waited
    expect(await fs.readFile(path.join(w.target(), 'ok'), 'utf8')).toBe('ok');
    await w.unpublish();
    await w.unstage();
    expect(await leaksUnder(base)).toEqual({ loops: [], mounts: [] });
  });
});

describe.skipIf(!isRoot())('the node-side fence', () => {
  it('lets several nodes read a MULTI_NODE_READER_ONLY volume, read-only, and keeps writers out', async () => {
    const base = await dir('readers');
    const n1 = await driver({ dir: base });
    const n2 = await env.nodePlugin(base, 'node-2');
    const writer = await makeVolume(n1, base, 'pvc-shared-ro', mountCap('ext4'), 64 * MiB);
    await writer.stage();
    await writer.publish();
    const sum = await writeRandom(path.join(writer.target(), 'shared.bin'), 2, 21);
    await writer.unpublish();
    await writer.unstage();
    await n1.clients.controller.ControllerUnpublishVolume({ volume_id: writer.id, node_id: 'node-1' });

    const ro = mountCap('ext4', 'MULTI_NODE_READER_ONLY');
    const readers = [
      new Vol(n1, writer.id, ro, path.join(base, 'r1')),
      new Vol(n2, writer.id, ro, path.join(base, 'r2')),
    ];
    for (const [i, node] of ['node-1', 'node-2'].entries()) {
      await n1.clients.controller.ControllerPublishVolume({
        volume_id: writer.id,
        node_id: node,
        volume_capability: ro,
        readonly: true,
      });
      const r = readers[i];
      if (!r) throw new Error('no reader');
      await r.stage();
      await r.publish(1, true);
      expect(await sha256(path.join(r.target(), 'shared.bin'))).toBe(sum);
      await expect(fs.writeFile(path.join(r.target(), 'x'), 'x')).rejects.toThrow(/EROFS/);
    }
    // Both "nodes" share this host; each stages on a read-only loop device of its own.
    const loops = await readers[0]?.loops();
    expect(loops).toHaveLength(2);
    for (const l of loops ?? []) {
      const dev = l.split(' ')[0]?.replace('/dev/', '') ?? '';
      expect((await fs.readFile(`/sys/block/${dev}/ro`, 'utf8')).trim()).toBe('1');
    }
    const rwOnNode2 = new Vol(n2, writer.id, mountCap('ext4'), path.join(base, 'w2'));
    expect(await codeOf(rwOnNode2.stage())).toBe('FAILED_PRECONDITION');
    for (const r of readers) {
      await r.unpublish();
      await r.unstage();
    }
    expect(await readers[0]?.loops()).toEqual([]);
  });

  it('formats a blank volume first staged read-only, then mounts it read-only', async () => {
    const base = await dir('blank-ro');
    const n1 = await driver({ dir: base });
    const v = await makeVolume(
      n1,
      base,
      'pvc-blank-ro',
      mountCap('xfs', 'SINGLE_NODE_READER_ONLY'),
      320 * MiB,
    );
    await v.stage();
    await v.publish();
    await expect(fs.writeFile(path.join(v.target(), 'x'), 'x')).rejects.toThrow(/EROFS/);
    const st = await n1.clients.node.NodeGetVolumeStats({ volume_id: v.id, volume_path: v.target() });
    expect(st.volume_condition?.abnormal).toBe(false);
    await v.unpublish();
    await v.unstage();
    expect(await v.loops()).toEqual([]);
  });

  it('keeps a second node off a staged volume until the first releases it', async () => {
    const base = await dir('fence');
    const n1 = await driver({ dir: base });
    const n2 = await env.nodePlugin(base, 'node-2');
    const v = await makeVolume(n1, base, 'pvc-fenced', mountCap('ext4'), 64 * MiB);
    await v.stage();
    const other = new Vol(n2, v.id, v.cap, path.join(base, 'n2'));
    const e = await errorOf(other.stage());
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain('node-1');
    await v.unstage();
    await n1.clients.controller.ControllerUnpublishVolume({ volume_id: v.id, node_id: 'node-1' });
    await n1.clients.controller.ControllerPublishVolume({
      volume_id: v.id,
      node_id: 'node-2',
      volume_capability: v.cap,
    });
    await other.stage();
    expect(await codeOf(v.stage())).toBe('FAILED_PRECONDITION');
    await other.unstage();
  });

  it("releases a dead node's hold once the CO unpublished it and the node confirms, back up", async () => {
    const base = await dir('deadnode');
    const n1 = await env.nodePlugin(base, 'node-1');
    const ctl = await driver({ dir: base, mode: 'controller' });
    const n2 = await env.nodePlugin(base, 'node-2');
    const cap = mountCap('ext4');
    const id =
      (
        await ctl.clients.controller.CreateVolume({
          name: 'pvc-dead',
          volume_capabilities: [cap],
          capacity_range: { required_bytes: String(64 * MiB) },
        })
      ).volume?.volume_id ?? '';
    await ctl.clients.controller.ControllerPublishVolume({
      volume_id: id,
      node_id: 'node-1',
      volume_capability: cap,
    });
    const v1 = new Vol(n1, id, cap, path.join(base, 'n1'));
    await v1.stage();
    // node-1 dies: its process is gone and (as after a reboot) its mount and loop device with it.
    await n1.stop('SIGKILL');
    await cleanupUnder(path.join(base, 'n1'));
    const loops = await leaksUnder(path.join(base, 'pool'));
    await cleanupUnder(path.join(base, 'pool'));
    expect(loops.loops).toHaveLength(1);
    const v2 = new Vol(n2, id, cap, path.join(base, 'n2'));
    expect(await codeOf(v2.stage())).toBe('FAILED_PRECONDITION');
    await ctl.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
    await ctl.clients.controller.ControllerPublishVolume({
      volume_id: id,
      node_id: 'node-2',
      volume_capability: cap,
    });
    // Held until node-1 confirms it holds nothing: silence alone proves nothing (a hung plugin's
    // mounts still write). node-1 comes back (rebooted: nothing mounted) and confirms at once.
    const first = await errorOf(v2.stage());
    expect(first.code).toBe('FAILED_PRECONDITION');
    expect(first.details).toMatch(/node-1 has confirmed/);
    await env.nodePlugin(base, 'node-1');
    let staged = false;
    for (let i = 0; i < 60 && !staged; i++) {
      await new Promise((r) => setTimeout(r, 250));
      staged = (await codeOf(v2.stage())) === 'OK';
    }
    expect(staged).toBe(true);
    await v2.unstage();
  });
});
