/**
 * Target paths a CO may get wrong, or a hostile caller may choose (real loop devices): a pod's path is
 * never the staging path, never inside another mounted volume, and unpublish removes only what the
 * driver made.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { codeOf } from '../helpers/grpc.js';
import { isMounted, isRoot, MiB } from '../helpers/host.js';
import { createVolume, publish, stage } from '../helpers/volumes.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

describe.skipIf(!isRoot())('target paths', () => {
  let d: DriverProcess;
  let base: string;
  beforeAll(async () => {
    base = await env.dir('targets');
    d = await env.driver({ dir: base });
  });

  it('a target that is the staging path: refused by publish and unpublish, the staging stays', async () => {
    const cap = mountCap('ext4');
    const { id } = await createVolume(d, 'hunt-a2', cap, 32 * MiB);
    const staging = path.join(base, 'a2-staging');
    const target = path.join(base, 'a2-pod', 'mount');
    await stage(d, id, staging, cap);
    await publish(d, id, staging, target, cap);
    // A publish "at" the staging path is answered OK, without any mount:
    const pub = await codeOf(
      d.clients.node.NodePublishVolume({
        volume_id: id,
        staging_target_path: staging,
        target_path: staging,
        volume_capability: cap,
      }),
    );
    const un = await codeOf(d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: staging }));
    const stillStaged = await isMounted(staging);
    // cleanup
    await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await d.clients.node
      .NodeUnstageVolume({ volume_id: id, staging_target_path: staging })
      .catch(() => undefined);
    expect({ pub, un, stillStaged }).toEqual({
      pub: 'INVALID_ARGUMENT',
      un: 'INVALID_ARGUMENT',
      stillStaged: true,
    });
  });

  it('unpublish removes nothing inside another volume; an empty directory of a deleted volume goes, OK', async () => {
    const cap = mountCap('ext4');
    const b = await createVolume(d, 'hunt-a3-b', cap, 32 * MiB);
    const a = await createVolume(d, 'hunt-a3-a', cap, 32 * MiB);
    const staging = path.join(base, 'a3-staging');
    const target = path.join(base, 'a3-pod', 'mount');
    await stage(d, b.id, staging, cap);
    await publish(d, b.id, staging, target, cap);
    // The pod of B keeps an empty marker file and an empty directory in its volume.
    await fs.writeFile(path.join(target, 'READY'), '');
    await fs.mkdir(path.join(target, 'spool'));
    const r1 = await codeOf(
      d.clients.node.NodeUnpublishVolume({ volume_id: a.id, target_path: path.join(target, 'READY') }),
    );
    const r2 = await codeOf(
      d.clients.node.NodeUnpublishVolume({ volume_id: a.id, target_path: path.join(target, 'spool') }),
    );
    // A pod's directory left behind by a node that went down with it mounted, its volume deleted
    // meanwhile: the kubelet removes a pod's directory only once NodeUnpublishVolume answers OK.
    const orphan = path.join(base, 'a3-orphan-pod', 'mount');
    await fs.mkdir(orphan, { recursive: true });
    const r3 = await codeOf(
      d.clients.node.NodeUnpublishVolume({
        volume_id: 'vol-00000000000000000000000000000000',
        target_path: orphan,
      }),
    );
    const left = {
      ready: await fs.stat(path.join(target, 'READY')).then(
        () => true,
        () => false,
      ),
      spool: await fs.stat(path.join(target, 'spool')).then(
        () => true,
        () => false,
      ),
      orphan: await fs.stat(orphan).then(
        () => true,
        () => false,
      ),
    };
    await d.clients.node.NodeUnpublishVolume({ volume_id: b.id, target_path: target });
    await d.clients.node.NodeUnstageVolume({ volume_id: b.id, staging_target_path: staging });
    expect({ codes: [r1, r2, r3], left }).toEqual({
      codes: ['INVALID_ARGUMENT', 'INVALID_ARGUMENT', 'OK'],
      left: { ready: true, spool: true, orphan: false },
    });
  });

  it.each(['ext4', 'btrfs'])(
    "publish refuses a target inside another volume's filesystem (%s): nothing made there, nothing exposed",
    async (fsType) => {
      const cap = mountCap('ext4');
      const capB = mountCap(fsType);
      const b = await createVolume(d, `hunt-a4-b-${fsType}`, capB, 300 * MiB);
      const a = await createVolume(d, `hunt-a4-a-${fsType}`, cap, 32 * MiB);
      const sb = path.join(base, `a4-staging-b-${fsType}`);
      const sa = path.join(base, `a4-staging-a-${fsType}`);
      await stage(d, b.id, sb, capB);
      await stage(d, a.id, sa, cap);
      await fs.writeFile(path.join(sa, 'secret-of-a'), 'a');
      const inside = path.join(sb, 'x', 'mount');
      const code = await codeOf(
        d.clients.node.NodePublishVolume({
          volume_id: a.id,
          staging_target_path: sa,
          target_path: inside,
          volume_capability: cap,
        }),
      );
      const seen = await fs.stat(path.join(inside, 'secret-of-a')).then(
        () => true,
        () => false,
      );
      await d.clients.node
        .NodeUnpublishVolume({ volume_id: a.id, target_path: inside })
        .catch(() => undefined);
      await fs.rm(path.join(sb, 'x'), { recursive: true, force: true });
      await d.clients.node.NodeUnstageVolume({ volume_id: a.id, staging_target_path: sa });
      await d.clients.node.NodeUnstageVolume({ volume_id: b.id, staging_target_path: sb });
      expect({ code, seen }).toEqual({ code: 'INVALID_ARGUMENT', seen: false });
    },
  );

  it('publish refuses a target that holds a mounted volume beneath it', async () => {
    const cap = mountCap('ext4');
    const b = await createVolume(d, 'hunt-a5-b', cap, 32 * MiB);
    const a = await createVolume(d, 'hunt-a5-a', cap, 32 * MiB);
    const sb = path.join(base, 'a5', 'staging-b');
    const sa = path.join(base, 'a5-staging-a');
    await stage(d, b.id, sb, cap);
    await stage(d, a.id, sa, cap);
    const code = await codeOf(
      d.clients.node.NodePublishVolume({
        volume_id: a.id,
        staging_target_path: sa,
        target_path: path.join(base, 'a5'),
        volume_capability: cap,
      }),
    );
    if (code === 'OK')
      await d.clients.node.NodeUnpublishVolume({ volume_id: a.id, target_path: path.join(base, 'a5') });
    await d.clients.node.NodeUnstageVolume({ volume_id: a.id, staging_target_path: sa });
    await d.clients.node.NodeUnstageVolume({ volume_id: b.id, staging_target_path: sb });
    expect(code).toBe('INVALID_ARGUMENT'); // it would have hidden staging-b under volume a
  });
});
