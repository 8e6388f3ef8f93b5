/**
 * A pool has an identity, and nobody silently makes a second one (root only): --create-pool=false
 * waits for the pool instead of creating one, volumes carry their pool's id to the node, concurrent
 * starts agree on one pool, and a pool that disappears under a running driver is never answered as
 * "empty".
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { runMain } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { isMounted, isRoot, leaksUnder, MiB } from '../helpers/host.js';
import { createVolume, publish, stage } from '../helpers/volumes.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const poolId = async (dir: string): Promise<string> =>
  (JSON.parse(await fs.readFile(path.join(dir, 'pool.json'), 'utf8')) as { id: string }).id;

describe.skipIf(!isRoot())('a pool that is not there yet', () => {
  it('is waited for, never created, and served as soon as it appears', async () => {
    const base = await env.dir('missing');
    const poolDir = path.join(base, 'shared');
    await fs.mkdir(poolDir); // the mount point of a shared filesystem that did not mount
    const n = await env.driver({ dir: base, mode: 'node', poolDir, extra: ['--create-pool=false'] });
    const e = await errorOf(n.clients.identity.Probe({}));
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain(`no pool at ${poolDir}`);
    expect(e.details).toMatch(/shared filesystem mounted/);
    const staged = await errorOf(
      n.clients.node.NodeStageVolume({
        volume_id: 'vol-00000000000000000000000000000000',
        staging_target_path: path.join(base, 'st'),
        volume_capability: mountCap('ext4'),
        volume_context: { 'loopvol.csi.io/pool-id': 'pool-a' },
      }),
    );
    expect(staged.code).toBe('FAILED_PRECONDITION');
    expect(staged.details).toContain('pool-a');
    expect(await fs.readdir(poolDir)).toEqual([]); // nothing made
    // An operator creates the pool once; the plugin serves it without a restart.
    const made = await runMain(['create-pool', `--pool-dir=${poolDir}`]);
    expect(made.code).toBe(0);
    const id = await poolId(poolDir);
    expect(made.stdout).toContain(id);
    let ready = false;
    for (let i = 0; i < 50 && !ready; i++) {
      ready = (await codeOf(n.clients.identity.Probe({}))) === 'OK';
      if (!ready) await new Promise((r) => setTimeout(r, 200));
    }
    expect(ready).toBe(true);
    expect((await n.clients.node.NodeGetInfo({})).node_id).toBe('node-1');
    expect(await fs.readdir(path.join(poolDir, 'nodes'))).toContain('node-1.json');
  });
});

describe.skipIf(!isRoot())('a volume of one pool on a node of another', () => {
  it('is refused with both ids and the path, touching nothing', async () => {
    const base = await env.dir('two-pools');
    const a = await env.driver({
      dir: base,
      poolDir: path.join(base, 'pool-a'),
      socket: path.join(base, 'a.sock'),
    });
    // Another installation: its own plugin directory (one node plugin of a node per directory).
    const b = await env.driver({
      dir: base,
      mode: 'node',
      poolDir: path.join(base, 'pool-b'),
      socket: path.join(base, 'other-plugin', 'b.sock'),
    });
    const cap = mountCap('ext4');
    const res = await a.clients.controller.CreateVolume({
      name: 'pvc-pool-a',
      capacity_range: { required_bytes: String(16 * MiB) },
      volume_capabilities: [cap],
    });
    const volume = res.volume;
    const idA = await poolId(a.poolDir);
    expect(volume?.volume_context['loopvol.csi.io/pool-id']).toBe(idA);
    const pub = await a.clients.controller.ControllerPublishVolume({
      volume_id: volume?.volume_id ?? '',
      node_id: 'node-1',
      volume_capability: cap,
    });
    expect(pub.publish_context['loopvol.csi.io/pool-id']).toBe(idA);
    const staging = path.join(base, 'staging');
    await fs.mkdir(staging);
    const e = await errorOf(
      b.clients.node.NodeStageVolume({
        volume_id: volume?.volume_id ?? '',
        staging_target_path: staging,
        volume_capability: cap,
        volume_context: volume?.volume_context ?? {},
        publish_context: pub.publish_context,
      }),
    );
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain(idA);
    expect(e.details).toContain(await poolId(b.poolDir));
    expect(e.details).toContain(b.poolDir);
    expect(await fs.readdir(path.join(b.poolDir, 'volumes'))).toEqual([]);
    expect((await leaksUnder(base)).loops).toEqual([]);
  });
});

describe.skipIf(!isRoot())('processes starting together on an empty directory', () => {
  it('agree on one pool', async () => {
    const base = await env.dir('race-pool');
    const poolDir = path.join(base, 'pool');
    const runs = await Promise.all(
      [1, 2, 3, 4, 5, 6].map((i) => runMain(['create-pool', `--pool-dir=${poolDir}`, `--pool-name=p${i}`])),
    );
    const ids = new Set(runs.map((r) => /^pool (\S+)/.exec(r.stdout)?.[1]));
    expect(runs.map((r) => r.code)).toEqual([0, 0, 0, 0, 0, 0]);
    expect(ids.size).toBe(1);
    expect(ids.has(await poolId(poolDir))).toBe(true);
    const drivers = await Promise.all(
      ['c1', 'c2'].map((c) =>
        env.driver({ dir: base, mode: 'controller', poolDir, socket: path.join(base, `${c}.sock`) }),
      ),
    );
    for (const d of drivers) {
      expect(
        await d.waitForLog(
          (l) => l.includes('loopvol is serving') && l.includes(`"poolId":"${[...ids][0] ?? ''}"`),
        ),
      ).toBe(true);
    }
  });
});

describe.skipIf(!isRoot())('a pool that disappears under a running controller', () => {
  it('is never answered as empty: no listing, no capacity, no delete, no node registered into it', async () => {
    const base = await env.dir('vanish');
    const d = await env.driver({ dir: base });
    const cap = mountCap('ext4');
    const id =
      (
        await d.clients.controller.CreateVolume({
          name: 'pvc-vanish',
          capacity_range: { required_bytes: String(8 * MiB) },
          volume_capabilities: [cap],
        })
      ).volume?.volume_id ?? '';
    // The shared filesystem goes away: an empty directory is all that is left at the pool's path.
    execFileSync('mount', ['-t', 'tmpfs', 'gone', d.poolDir]);
    try {
      expect(await codeOf(d.clients.controller.ListVolumes({}))).toBe('UNAVAILABLE');
      expect(await codeOf(d.clients.controller.GetCapacity({}))).toBe('UNAVAILABLE');
      expect(await codeOf(d.clients.controller.DeleteVolume({ volume_id: id }))).toBe('UNAVAILABLE');
      expect(await codeOf(d.clients.controller.ControllerGetVolume({ volume_id: id }))).toBe('UNAVAILABLE');
      expect(await codeOf(d.clients.identity.Probe({}))).toBe('FAILED_PRECONDITION');
      expect(await codeOf(d.clients.node.NodeGetInfo({}))).toBe('UNAVAILABLE');
      expect(await fs.readdir(d.poolDir)).toEqual([]);
    } finally {
      execFileSync('umount', [d.poolDir]);
    }
    expect((await d.clients.controller.ListVolumes({})).entries.map((e) => e.volume?.volume_id)).toEqual([
      id,
    ]);
    await d.clients.controller.DeleteVolume({ volume_id: id });
  });
});

describe.skipIf(!isRoot())('a pool that disappears before a controller made anything', () => {
  it('answers a first CreateVolume UNAVAILABLE, not INTERNAL, and makes nothing', async () => {
    const base = await env.dir('vanish-first');
    const d = await env.driver({ dir: base });
    // Its first CreateVolume probes the pool's filesystem (in trash/), which is not there now.
    execFileSync('mount', ['-t', 'tmpfs', 'gone', d.poolDir]);
    try {
      const e = await errorOf(
        d.clients.controller.CreateVolume({
          name: 'pvc-first',
          capacity_range: { required_bytes: String(8 * MiB) },
          volume_capabilities: [mountCap('ext4')],
        }),
      );
      expect({ code: e.code, details: e.details }).toEqual({
        code: 'UNAVAILABLE',
        details: expect.stringMatching(/is gone \(no pool\.json\)/) as string,
      });
      expect(await fs.readdir(d.poolDir)).toEqual([]);
    } finally {
      execFileSync('umount', [d.poolDir]);
    }
  });
});

const fencesOf = async (poolDir: string, id: string): Promise<{ attachments: object; leases: object }> =>
  JSON.parse(await fs.readFile(path.join(poolDir, 'volumes', id, 'fences.json'), 'utf8')) as {
    attachments: object;
    leases: object;
  };

/** Hides the pool under a tmpfs (a shared filesystem unmounted); with `another`, a new pool is made there. */
async function hidePool(poolDir: string, another: boolean): Promise<void> {
  execFileSync('mount', ['-t', 'tmpfs', 'cover', poolDir]);
  if (another) expect((await runMain(['create-pool', `--pool-dir=${poolDir}`])).code).toBe(0);
}

describe.skipIf(!isRoot())('a pool hidden or replaced under a running driver', () => {
  it('ControllerUnpublishVolume is refused, not answered OK with the attachment kept', async () => {
    const base = await env.dir('replaced-ctl');
    const d = await env.driver({ dir: base });
    const cap = mountCap('ext4');
    const { id } = await createVolume(d, 'pvc-replaced-ctl', cap, 16 * MiB);
    await d.clients.controller.ControllerPublishVolume({
      volume_id: id,
      node_id: 'node-1',
      volume_capability: cap,
    });
    await hidePool(d.poolDir, true);
    let code: string;
    try {
      code = await codeOf(
        d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' }),
      );
    } finally {
      execFileSync('umount', [d.poolDir]);
    }
    expect({ code, attached: Object.keys((await fencesOf(d.poolDir, id)).attachments) }).toEqual({
      code: 'UNAVAILABLE',
      attached: ['node-1'],
    });
    await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
  });

  it.each([
    ['replaced by another pool', true],
    ['unmounted', false],
  ])('NodeUnstageVolume with the pool %s touches nothing and answers UNAVAILABLE', async (_what, another) => {
    const base = await env.dir(`hidden-node-${String(another)}`);
    const d = await env.driver({ dir: base });
    const cap = mountCap('ext4');
    const { id } = await createVolume(d, `pvc-hidden-node-${String(another)}`, cap, 32 * MiB);
    const staging = path.join(base, 'staging');
    const target = path.join(base, 'pod', 'mount');
    await stage(d, id, staging, cap);
    await publish(d, id, staging, target, cap);
    await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await hidePool(d.poolDir, another);
    const codes: string[] = [];
    let stagedStill: boolean;
    try {
      for (let i = 0; i < 2; i++)
        codes.push(
          await codeOf(d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging })),
        );
      codes.push(await codeOf(d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target })));
      stagedStill = await isMounted(staging);
    } finally {
      execFileSync('umount', [d.poolDir]);
    }
    expect({ codes, stagedStill, leases: Object.keys((await fencesOf(d.poolDir, id)).leases) }).toEqual({
      codes: ['UNAVAILABLE', 'UNAVAILABLE', 'UNAVAILABLE'],
      stagedStill: true,
      leases: ['node-1'],
    });
    // Once the pool is back, the retry finishes: unmounted, detached, the lease let go.
    await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    expect({
      leases: Object.keys((await fencesOf(d.poolDir, id)).leases),
      left: (await leaksUnder(base)).mounts,
    }).toEqual({ leases: [], left: [] });
  });
});
