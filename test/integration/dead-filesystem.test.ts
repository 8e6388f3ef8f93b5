/**
 * A volume whose filesystem the kernel shut down (after I/O errors: a pool that failed under it), with
 * real loop devices and mounts (root only; `xfs_io -x -c 'shutdown -f'` does what the kernel does on
 * such errors, for xfs and ext4). Every look at an xfs's files then fails with EIO, and an ext4's mount
 * shows `shutdown`; statfs still answers for both. The volume must be reported abnormal, never used
 * (publish, repeat stage, growth), and still torn down cleanly, so its pod can go and the next stage
 * checks it: what was synced before the shutdown is there afterwards. The same for an ext4 that an
 * error turned read-only (errors=remount-ro; on recent kernels its mount shows `emergency_ro`, not `ro`).
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { type MountEntry, parseMountInfo } from '../../src/host/mounts.js';
import { isRoot, leaksUnder, MiB, sha256, writeRandom } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

/** The visible mount at `mountPoint`, as the driver reads mountinfo, or undefined. */
async function mountAt(mountPoint: string): Promise<MountEntry | undefined> {
  const table = parseMountInfo(await fs.readFile('/proc/self/mountinfo', 'utf8'));
  return table.filter((m) => m.mountPoint === mountPoint).at(-1);
}

/** The super options of the mount at `mountPoint`, or undefined. */
const superOptions = async (mountPoint: string) => (await mountAt(mountPoint))?.superOptions;

describe.skipIf(!isRoot())('a volume whose filesystem the kernel stopped', () => {
  let d: DriverProcess;
  let base: string;
  beforeAll(async () => {
    base = await env.dir('dead-fs');
    d = await env.driver({ dir: base });
  });

  /** A volume staged at its staging path and published at pod 1, with the calls the kubelet makes. */
  async function volume(name: string, fsType: string) {
    const cap = mountCap(fsType);
    const created = await d.clients.controller.CreateVolume({
      name,
      capacity_range: { required_bytes: String(320 * MiB) },
      volume_capabilities: [cap],
    });
    const id = created.volume?.volume_id ?? '';
    const staging = path.join(base, `staging-${name}`);
    const target = (n: number): string => path.join(base, `pod-${n}`, id);
    await fs.mkdir(staging, { recursive: true });
    await fs.mkdir(path.dirname(target(1)), { recursive: true });
    await fs.mkdir(path.dirname(target(2)), { recursive: true });
    const publish_context = (
      await d.clients.controller.ControllerPublishVolume({
        volume_id: id,
        node_id: 'node-1',
        volume_capability: cap,
      })
    ).publish_context;
    const v = {
      id,
      staging,
      target,
      stage: () =>
        d.clients.node.NodeStageVolume({
          volume_id: id,
          staging_target_path: staging,
          volume_capability: cap,
          publish_context,
        }),
      publish: (n: number) =>
        d.clients.node.NodePublishVolume({
          volume_id: id,
          staging_target_path: staging,
          target_path: target(n),
          volume_capability: cap,
          publish_context,
        }),
      unpublish: (n: number) => d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target(n) }),
      unstage: () => d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging }),
      stats: async () =>
        (await d.clients.node.NodeGetVolumeStats({ volume_id: id, volume_path: target(1) })).volume_condition,
      /** ControllerExpandVolume, then NodeExpandVolume at pod 1: the node's answer. */
      grow: async (): Promise<string> => {
        const capacity_range = { required_bytes: String(400 * MiB) };
        await d.clients.controller.ControllerExpandVolume({
          volume_id: id,
          capacity_range,
          volume_capability: cap,
        });
        return codeOf(
          d.clients.node.NodeExpandVolume({
            volume_id: id,
            volume_path: target(1),
            staging_target_path: staging,
            capacity_range,
            volume_capability: cap,
          }),
        );
      },
      /** Unpublished and unstaged, with no mount and no device of the image left (unstage twice: OK). */
      tearDown: async () => {
        await v.unpublish(1);
        await v.unstage();
        expect(await v.unstage()).toEqual({});
        expect(await leaksUnder(path.join(d.poolDir, 'volumes', id))).toEqual({ mounts: [], loops: [] });
        expect(await superOptions(staging)).toBeUndefined();
      },
      /** Staged and published again (checked at the stage): healthy, holding `file` with `sum`; then gone. */
      staysWith: async (file: string, sum: string) => {
        await v.stage();
        await v.publish(1);
        expect(await sha256(path.join(target(1), file))).toBe(sum);
        expect(await v.stats()).toMatchObject({ abnormal: false });
        await v.unpublish(1);
        await v.unstage();
        await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
        await d.clients.controller.DeleteVolume({ volume_id: id });
        expect(await leaksUnder(base)).toEqual({ mounts: [], loops: [] });
      },
    };
    await v.stage();
    await v.publish(1);
    return v;
  }

  it.each(['xfs', 'ext4'])(
    '%s shut down: reported abnormal, never used, torn down, and checked at the next stage with its data',
    async (fsType) => {
      const v = await volume(`pvc-dead-${fsType}`, fsType);
      if (fsType === 'ext4') expect(await superOptions(v.staging)).toContain('errors=remount-ro');
      const sum = await writeRandom(path.join(v.target(1), 'kept'), 8, 17); // written and synced
      expect(await v.stats()).toMatchObject({ abnormal: false });

      execFileSync('xfs_io', ['-x', '-c', 'shutdown -f', v.staging]);
      // A shut-down ext4 answers lstat and statfs; only its mount's `shutdown` shows it, which kernels
      // 5.10 and 6.1 do not show (6.18 does). There, it is only taken down and checked again.
      if (fsType === 'ext4' && !(await superOptions(v.staging))?.includes('shutdown')) {
        await v.tearDown();
        await v.staysWith('kept', sum);
        return;
      }

      const condition = await v.stats();
      expect(condition?.abnormal).toBe(true);
      expect(condition?.message).toMatch(/does not answer/);
      // The repeat of the stage that made it and a growth: refused, not OK.
      const staged = await errorOf(v.stage());
      expect(staged.code).toBe('FAILED_PRECONDITION');
      expect(staged.details).toMatch(/does not answer/);
      expect(await v.grow()).toBe('FAILED_PRECONDITION');
      // The pod goes: unpublish answers OK. Its successor on this node is not given the dead filesystem.
      await v.unpublish(1);
      expect(await superOptions(v.target(1))).toBeUndefined();
      const published = await errorOf(v.publish(2));
      expect(published.code).toBe('FAILED_PRECONDITION');
      expect(published.details).toMatch(/does not answer/);
      expect(await superOptions(v.target(2))).toBeUndefined();
      await v.tearDown();
      await v.staysWith('kept', sum); // its journal replayed, checked, grown
    },
  );

  // The second time with errors=remount-ro as the superblock's own default (tune2fs -e): the kernel then
  // shows no errors= in the mount, and the filesystem counts as stopped all the same.
  it.each([false, true])(
    'ext4 turned read-only by an error (remount-ro the superblock default: %s): reported abnormal, not used, torn down, checked at the next stage',
    async (byDefault) => {
      const v = await volume(`pvc-dead-ext4-error-${String(byDefault)}`, 'ext4');
      if (byDefault) {
        await v.tearDown();
        execFileSync('tune2fs', ['-e', 'remount-ro', path.join(d.poolDir, 'volumes', v.id, 'disk.img')], {
          stdio: 'ignore',
        });
        await v.stage();
        await v.publish(1);
      }
      const sum = await writeRandom(path.join(v.target(1), 'kept'), 8, 23);
      const source = (await mountAt(v.staging))?.source;
      // What ext4 does when it finds an inconsistency (its test hook: ext4_error).
      await fs.writeFile(`/sys/fs/ext4/${path.basename(source ?? 'none')}/trigger_fs_error`, 'test error');
      // 5.10 and 6.1 stop it a moment after the error, not within it. 6.1 (and 6.18 with emergency_ro)
      // leaves the filesystem's rw in place, and 6.1 shows nothing in the mount at all.
      let condition = await v.stats();
      for (let i = 0; i < 100 && condition?.abnormal !== true; i++) {
        await new Promise((r) => setTimeout(r, 50));
        condition = await v.stats();
      }
      expect(condition?.abnormal).toBe(true);
      expect(condition?.message).toMatch(/went read-only|does not answer/);
      expect(await v.grow()).toBe('FAILED_PRECONDITION');
      // The pod goes; its successor on this node is not given the stopped filesystem.
      await v.unpublish(1);
      const published = await errorOf(v.publish(2));
      expect(published.code).toBe('FAILED_PRECONDITION');
      expect(published.details).toMatch(/does not answer/);
      expect(await superOptions(v.target(2))).toBeUndefined();
      await v.tearDown();
      await v.staysWith('kept', sum); // e2fsck -p repairs what the error marked
    },
  );

  it('ext4 with an error count in a superblock marked clean: checked in full at its stage, then healthy', async () => {
    const v = await volume('pvc-ext4-old-errors', 'ext4');
    const sum = await writeRandom(path.join(v.target(1), 'kept'), 4, 29);
    await v.tearDown();
    // As another tool or an imported image may leave it: e2fsck -p alone calls it clean and keeps the count.
    execFileSync(
      'debugfs',
      ['-w', '-R', 'ssv error_count 3', path.join(d.poolDir, 'volumes', v.id, 'disk.img')],
      {
        stdio: 'ignore',
      },
    );
    await v.staysWith('kept', sum);
  });

  it('a read-only staging of an ext4 whose superblock counts errors is published as it is (it is never checked)', async () => {
    const v = await volume('pvc-ext4-ro-old-errors', 'ext4');
    const sum = await writeRandom(path.join(v.target(1), 'kept'), 4, 31);
    await v.tearDown();
    const image = path.join(d.poolDir, 'volumes', v.id, 'disk.img');
    execFileSync('debugfs', ['-w', '-R', 'ssv error_count 3', image], { stdio: 'ignore' });
    const c = d.clients.controller;
    const cap = mountCap('ext4', 'MULTI_NODE_READER_ONLY'); // staged read-only, without journal replay
    await c.ControllerUnpublishVolume({ volume_id: v.id, node_id: 'node-1' });
    const { publish_context } = await c.ControllerPublishVolume({
      volume_id: v.id,
      node_id: 'node-1',
      volume_capability: cap,
      readonly: true,
    });
    const req = { volume_id: v.id, staging_target_path: v.staging, volume_capability: cap, publish_context };
    await d.clients.node.NodeStageVolume(req);
    expect(await d.clients.node.NodeStageVolume(req)).toEqual({}); // the repeat too
    expect((await mountAt(v.staging))?.options).toContain('ro');
    await d.clients.node.NodePublishVolume({ ...req, target_path: v.target(1) });
    expect(await sha256(path.join(v.target(1), 'kept'))).toBe(sum);
    expect(await v.stats()).toMatchObject({ abnormal: false });
    await v.unpublish(1);
    await v.unstage();
    await c.ControllerUnpublishVolume({ volume_id: v.id, node_id: 'node-1' });
    await c.DeleteVolume({ volume_id: v.id });
    expect(await leaksUnder(base)).toEqual({ mounts: [], loops: [] });
  });
});
