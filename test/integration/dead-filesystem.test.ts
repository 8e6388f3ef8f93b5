/**
 * A volume whose filesystem the kernel shut down (after I/O errors: a pool that failed under it), with
 * real loop devices and mounts (root only; `xfs_io -x -c 'shutdown -f'` does what the kernel does on
 * such errors, for xfs and ext4). Every look at an xfs's files then fails with EIO, and an ext4's mount
 * shows `shutdown`; statfs still answers for both. The volume must be reported abnormal, never used
 * (publish, repeat stage, growth), and still torn down cleanly, so its pod can go and the next stage
 * checks it: what was synced before the shutdown is there afterwards.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { isRoot, leaksUnder, MiB, sha256, writeRandom } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

/** The super options of the mount at `mountPoint` (mountinfo's last field), or undefined. */
async function superOptions(mountPoint: string): Promise<string[] | undefined> {
  const lines = (await fs.readFile('/proc/self/mountinfo', 'utf8')).split('\n');
  const line = lines.filter((l) => l.split(' ')[4] === mountPoint).at(-1);
  return line?.split(' - ')[1]?.split(' ')[2]?.split(',');
}

describe.skipIf(!isRoot())('a volume whose filesystem the kernel shut down', () => {
  let d: DriverProcess;
  let base: string;
  beforeAll(async () => {
    base = await env.dir('dead-fs');
    d = await env.driver({ dir: base });
  });

  it.each(['xfs', 'ext4'])(
    '%s: reported abnormal, never used, torn down, and checked at the next stage with its data',
    async (fsType) => {
      const cap = mountCap(fsType);
      const created = await d.clients.controller.CreateVolume({
        name: `pvc-dead-${fsType}`,
        capacity_range: { required_bytes: String(320 * MiB) },
        volume_capabilities: [cap],
      });
      const id = created.volume?.volume_id ?? '';
      const staging = path.join(base, `staging-${fsType}`);
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
      const stage = () =>
        d.clients.node.NodeStageVolume({
          volume_id: id,
          staging_target_path: staging,
          volume_capability: cap,
          publish_context,
        });
      const publish = (n: number) =>
        d.clients.node.NodePublishVolume({
          volume_id: id,
          staging_target_path: staging,
          target_path: target(n),
          volume_capability: cap,
          publish_context,
        });
      const stats = async () =>
        (await d.clients.node.NodeGetVolumeStats({ volume_id: id, volume_path: target(1) })).volume_condition;

      await stage();
      await publish(1);
      if (fsType === 'ext4') expect(await superOptions(staging)).toContain('errors=remount-ro');
      const sum = await writeRandom(path.join(target(1), 'kept'), 8, 17); // written and synced
      expect(await stats()).toMatchObject({ abnormal: false });

      execFileSync('xfs_io', ['-x', '-c', 'shutdown -f', staging]);

      const condition = await stats();
      expect(condition?.abnormal).toBe(true);
      expect(condition?.message).toMatch(/does not answer/);
      // The repeat of the stage that made it and a growth: refused, not OK.
      const staged = await errorOf(stage());
      expect(staged.code).toBe('FAILED_PRECONDITION');
      expect(staged.details).toMatch(/does not answer/);
      await d.clients.controller.ControllerExpandVolume({
        volume_id: id,
        capacity_range: { required_bytes: String(400 * MiB) },
        volume_capability: cap,
      });
      expect(
        await codeOf(
          d.clients.node.NodeExpandVolume({
            volume_id: id,
            volume_path: target(1),
            staging_target_path: staging,
            capacity_range: { required_bytes: String(400 * MiB) },
            volume_capability: cap,
          }),
        ),
      ).toBe('FAILED_PRECONDITION');

      // The pod goes: unpublish answers OK. Its successor on this node is not given the dead filesystem.
      await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target(1) });
      expect(await superOptions(target(1))).toBeUndefined();
      const published = await errorOf(publish(2));
      expect(published.code).toBe('FAILED_PRECONDITION');
      expect(published.details).toMatch(/does not answer/);
      expect(await superOptions(target(2))).toBeUndefined();
      // Unstage answers OK and leaves no mount and no device of the image.
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
      expect(await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging })).toEqual(
        {},
      );
      expect(await leaksUnder(path.join(d.poolDir, 'volumes', id))).toEqual({ mounts: [], loops: [] });
      expect(await superOptions(staging)).toBeUndefined();
      expect(await superOptions(target(1))).toBeUndefined();

      // Staged again (its journal replayed, checked, grown): healthy, with what was synced.
      await stage();
      await publish(1);
      expect(await sha256(path.join(target(1), 'kept'))).toBe(sum);
      expect(await stats()).toMatchObject({ abnormal: false });
      await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target(1) });
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
      await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
      await d.clients.controller.DeleteVolume({ volume_id: id });
      expect(await leaksUnder(base)).toEqual({ mounts: [], loops: [] });
    },
  );
});
