/**
 * ControllerPublishVolume's `readonly` on the node, with real loop devices and mounts (root only): a
 * volume published read-only to a node is published to its pods read-only whatever NodePublishVolume's
 * own `readonly` says, so a pod's writes fail. A filesystem is staged as its access mode says (its
 * journal replayed on a writable device: a read-only one would hide what the journal holds); a raw
 * block volume is staged on a read-only loop device (a read-only bind of a device node still writes).
 * The node knows it from the publish context, or from the pool's attachment record without one. A
 * staging that does not match how the volume is published gets the spec's answer.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import type { DriverProcess } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { codeOf } from '../helpers/grpc.js';
import { isRoot, leaksUnder, MiB } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

type Context = Record<string, string>;

describe.skipIf(!isRoot())('a volume published read-only (ControllerPublishVolume readonly)', () => {
  let d: DriverProcess;
  let base: string;
  beforeAll(async () => {
    base = await env.dir('publish-ro');
    d = await env.driver({ dir: base });
  });

  /** A new volume and the kubelet's calls for it on node-1, with the publish context they pass on. */
  async function volume(name: string, cap: VolumeCapability, size: number) {
    const res = await d.clients.controller.CreateVolume({
      name,
      capacity_range: { required_bytes: String(size) },
      volume_capabilities: [cap],
    });
    const id = res.volume?.volume_id ?? '';
    const staging = path.join(base, `staging-${id}`);
    const target = (n: number): string => path.join(base, `pod-${n}`, id);
    const isBlock = cap.block !== undefined;
    return {
      id,
      staging,
      target,
      controllerPublish: async (readonly: boolean): Promise<Context> =>
        (
          await d.clients.controller.ControllerPublishVolume({
            volume_id: id,
            node_id: 'node-1',
            volume_capability: cap,
            readonly,
          })
        ).publish_context,
      controllerUnpublish: () =>
        d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' }),
      stage: async (publish_context: Context) => {
        await fs.mkdir(staging, { recursive: true });
        return d.clients.node.NodeStageVolume({
          volume_id: id,
          staging_target_path: staging,
          volume_capability: cap,
          publish_context,
        });
      },
      publish: async (n: number, publish_context: Context, readonly = false) => {
        await fs.mkdir(path.dirname(target(n)), { recursive: true });
        return d.clients.node.NodePublishVolume({
          volume_id: id,
          staging_target_path: staging,
          target_path: target(n),
          volume_capability: cap,
          publish_context,
          readonly,
        });
      },
      unpublish: (n: number) => d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target(n) }),
      unstage: () => d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging }),
      /** Whether the volume's one loop device on this host is read-only (sysfs `ro`). */
      deviceReadOnly: async (): Promise<boolean> => {
        const loops = (await leaksUnder(path.join(d.poolDir, 'volumes', id))).loops;
        expect(loops).toHaveLength(1);
        const dev = (loops[0] ?? '').split(' ')[0]?.replace('/dev/', '') ?? '';
        return (await fs.readFile(`/sys/block/${dev}/ro`, 'utf8')).trim() === '1';
      },
      loops: async () => (await leaksUnder(path.join(d.poolDir, 'volumes', id))).loops,
      /** NodeUnstageVolume, no loop device of it left here, then ControllerUnpublishVolume. */
      release: async () => {
        await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
        expect((await leaksUnder(path.join(d.poolDir, 'volumes', id))).loops).toEqual([]);
        await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
      },
      /** A pod's write through target `n`: the error code it ends with, or 'written'. */
      write: async (n: number): Promise<string> => {
        const file = isBlock ? target(n) : path.join(target(n), 'pod-wrote-this');
        try {
          const h = await fs.open(file, isBlock ? 'r+' : 'w');
          try {
            await h.write(Buffer.alloc(4096, 0x5a), 0, 4096, 0);
            await h.sync();
          } finally {
            await h.close();
          }
          return 'written';
        } catch (err) {
          return (err as NodeJS.ErrnoException).code ?? String(err);
        }
      },
    };
  }

  it.each(['ext4', 'xfs'])(
    'publishes a %s volume read-only to its pods, with what a writer wrote before',
    async (fsType) => {
      const v = await volume(`pvc-pub-ro-${fsType}`, mountCap(fsType), 320 * MiB);
      // A writer first: what it wrote shows through the read-only publication.
      const rw = await v.controllerPublish(false);
      await v.stage(rw);
      await v.publish(1, rw);
      await fs.writeFile(path.join(v.target(1), 'written-before'), 'data');
      await v.unpublish(1);
      await v.unstage();
      await v.controllerUnpublish();

      const ctx = await v.controllerPublish(true);
      expect(ctx['loopvol.csi.io/readonly']).toBe('true');
      await v.stage(ctx);
      await v.publish(1, ctx, false); // the pod's own readonly is false: the controller's decides
      expect(await v.write(1)).toBe('EROFS');
      expect(await fs.readFile(path.join(v.target(1), 'written-before'), 'utf8')).toBe('data');
      // Repeats are idempotent, also without the publish context: the pool's attachment record says it.
      expect(await codeOf(v.stage(ctx))).toBe('OK');
      expect(await codeOf(v.stage({}))).toBe('OK');
      expect(await codeOf(v.publish(1, ctx, false))).toBe('OK');
      expect(await codeOf(v.publish(1, {}, true))).toBe('OK');
      await v.unpublish(1);
      await v.release();
    },
  );

  it('stages a raw block volume on a read-only device and a pod cannot write it', async () => {
    const v = await volume('pvc-pub-ro-block', blockCap(), 16 * MiB);
    const ctx = await v.controllerPublish(true);
    await v.stage(ctx);
    expect(await v.deviceReadOnly()).toBe(true);
    await v.publish(1, ctx, false);
    // A read-only block device answers a write with EPERM (the kernel's code for it), not EROFS.
    expect(await v.write(1)).toBe('EPERM');
    expect(await codeOf(v.stage({}))).toBe('OK');
    expect(await codeOf(v.publish(1, ctx, false))).toBe('OK');
    await v.unpublish(1);
    await v.release();
  });

  it('answers a block staging that does not match how the volume is published by the spec', async () => {
    const v = await volume('pvc-pub-ro-mismatch-block', blockCap(), 32 * MiB);
    const rw = await v.controllerPublish(false);
    expect(rw['loopvol.csi.io/readonly']).toBe('false');
    await v.stage(rw);
    expect(await v.deviceReadOnly()).toBe(false);
    const ro = { ...rw, 'loopvol.csi.io/readonly': 'true' };
    // Staged read-write at this path; read-only asked: "volume published but is incompatible".
    expect(await codeOf(v.stage(ro))).toBe('ALREADY_EXISTS');
    // A publish of a read-only publication on a read-write device: the staging must change first.
    expect(await codeOf(v.publish(1, ro))).toBe('FAILED_PRECONDITION');
    expect(await codeOf(v.publish(1, { ...rw, 'loopvol.csi.io/readonly': 'maybe' }))).toBe(
      'INVALID_ARGUMENT',
    );
    await v.publish(1, rw);
    expect(await v.write(1)).toBe('written');
    await v.unpublish(1);
    await v.unstage();

    // The reverse: staged read-only (as a read-only publish context says), then asked read-write.
    await v.stage(ro);
    expect(await v.deviceReadOnly()).toBe(true);
    expect(await codeOf(v.stage(rw))).toBe('ALREADY_EXISTS');
    await v.release();
  });

  it('publishes read-only from a filesystem staging made before the read-only publication', async () => {
    const v = await volume('pvc-pub-ro-later', mountCap('ext4'), 32 * MiB);
    const rw = await v.controllerPublish(false);
    await v.stage(rw);
    const ro = { ...rw, 'loopvol.csi.io/readonly': 'true' };
    expect(await codeOf(v.stage(ro))).toBe('OK'); // the staging is the same either way
    await v.publish(1, ro);
    expect(await v.write(1)).toBe('EROFS');
    await v.unpublish(1);
    await v.release();
  });
});
