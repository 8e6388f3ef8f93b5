/**
 * Several node plugins on one host sharing one pool (DESIGN's shared pool, as tested here): a volume
 * several nodes stage at once (MULTI_NODE_READER_ONLY) has a loop device per node. While one node's
 * stage is under way (its device attached, not yet named in its lease nor mounted), another node must
 * neither reuse that device for its own staging nor detach it when it unstages: detached, its number
 * can go to another volume's image, which the first stage then mounts for its pods. Real drivers, loop
 * devices and mounts; the first node's stage is held right after its attach by a pause point.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import { readSys, trustsDiskseq } from '../../src/host/loop.js';
import { parseMountInfo } from '../../src/host/mounts.js';
import type { DriverProcess } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { isRoot, MiB, mountSource, RUN, sha256, SLOW, writeRandom } from '../helpers/host.js';
import { createVolume, publish, publishTo, stage } from '../helpers/volumes.js';
import { errorOf } from '../helpers/grpc.js';

const env = new TestEnv();
const ROUNDS = Number(process.env.LOOPVOL_TEST_ROUNDS ?? 15);
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const uuidOf = (dev: string): string =>
  execFileSync('blkid', ['-p', '-s', 'UUID', '-o', 'value', dev], { encoding: 'utf8' }).trim();

/** The backing file sysfs shows for `/dev/loopN`, or '' when it is detached. */
const backingOf = (dev: string): string =>
  readSys(`/sys/block/${path.basename(dev)}/loop/backing_file`) ?? '';

/** The disk sequence number of `/dev/loopN` where the driver trusts it (it changes at every attach), or ''. */
const diskseqOf = (dev: string): string =>
  (trustsDiskseq(os.release()) && readSys(`/sys/block/${path.basename(dev)}/diskseq`)) || '';

/** The checksum of the first 4 MiB of the raw block device bound at `target`. */
const blockSum = (target: string): string =>
  execFileSync('sh', ['-c', 'head -c 4194304 "$1" | sha256sum', 'sh', target], { encoding: 'utf8' }).split(
    ' ',
  )[0] ?? '';

/** Node `node`'s lease of volume `id`, as the pool's fence file records it. */
async function leaseOf(
  pool: string,
  id: string,
  node: string,
): Promise<{ device?: string; deviceSeq?: string }> {
  const fences = JSON.parse(await fs.readFile(path.join(pool, 'volumes', id, 'fences.json'), 'utf8')) as {
    leases: Record<string, { device?: string; deviceSeq?: string }>;
  };
  return fences.leases[node] ?? {};
}

/** The loop device (loopN) bound at `target` by a raw block publish (a bind of its device node). */
async function deviceBoundAt(target: string): Promise<string> {
  const m = parseMountInfo(await fs.readFile('/proc/self/mountinfo', 'utf8')).find(
    (e) => e.mountPoint === target,
  );
  return (m?.root ?? '').replace(/^\//, '');
}

/**
 * A controller (node-1), node a whose stages are held right after their attach for `pause` ms, node b,
 * and a multi-reader volume published read-only to both.
 */
async function sharedVolume(tag: string, cap: VolumeCapability) {
  const base = await env.dir(tag);
  const d = await env.driver({ dir: base });
  const pause = 10_000 * SLOW;
  const a = await env.driver({
    dir: base,
    socket: path.join(base, 'node-a.sock'),
    nodeId: 'node-a',
    mode: 'node',
    env: { LOOPVOL_PAUSEPOINT: `stage:attached:${pause}` },
  });
  const b = await env.nodePlugin(base, 'node-b');
  const { id } = await createVolume(d, `pvc-${tag}-${RUN}`, cap, 64 * MiB, null);
  await publishTo(d, id, ['node-a', 'node-b'], cap, true);
  return { d, a, b, id, pause };
}

/**
 * The device a's log says its stage of `id` attached, once it has, and when (epoch ms): its pause
 * begins right after.
 */
async function attachedBy(a: DriverProcess, id: string): Promise<{ dev: string; at: number }> {
  const attached = (l: string): boolean => l.includes('attached loop device') && l.includes(id);
  expect(await a.waitForLog(attached)).toBe(true);
  const line = JSON.parse(a.logs().find(attached) ?? '{}') as { device?: string; time?: string };
  const dev = line.device ?? '';
  expect(dev).toMatch(/^\/dev\/loop\d+$/);
  expect(backingOf(dev)).toContain(`/${id}/disk.img`);
  return { dev, at: Date.parse(line.time ?? '') };
}

describe.skipIf(!isRoot())('two node plugins on one host, while one of them stages a shared volume', () => {
  it("the other neither reuses nor detaches the device that stage has just attached, and the stage mounts the volume's own filesystem", async () => {
    const cap = mountCap('ext4', 'MULTI_NODE_READER_ONLY');
    const { d, a, b, id, pause } = await sharedVolume('neighbours', cap);
    const base = path.dirname(a.socket);
    // Node b formats it (its first stage), and lets it go.
    const sb = path.join(base, 'b');
    await stage(b, id, sb, cap);
    const uuid = uuidOf(await mountSource(sb));
    expect(uuid).not.toBe('');
    // Formatted through a writable device, then attached again read-only: the lease names the latter,
    // as that attachment (its number, where the kernel gives one at every attach).
    const formattedOn = path.basename(await mountSource(sb));
    const leaseB = await leaseOf(d.poolDir, id, 'node-b');
    expect(leaseB.device).toBe(formattedOn);
    const seqB = diskseqOf(formattedOn);
    if (seqB !== '') expect(leaseB.deviceSeq).toBe(seqB);
    await b.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sb });

    // Node a's stage attaches its device and is held there.
    const sa = path.join(base, 'a');
    const staging = stage(a, id, sa, cap);
    staging.catch(() => undefined); // awaited below; a failure before then is reported there
    const { dev: da, at: heldSince } = await attachedBy(a, id);

    // Meanwhile node b stages the volume on a device of its own, and unstages it, leaving a's.
    await stage(b, id, sb, cap);
    const db = await mountSource(sb);
    expect(db).toMatch(/^\/dev\/loop\d+$/);
    expect(db).not.toBe(da);
    await b.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sb });
    expect(backingOf(da)).toContain(`/${id}/disk.img`);
    expect(await b.waitForLog((l) => l.includes('left devices of the volume') && l.includes(da))).toBe(true);
    // Another volume attached now takes a free number; a's is not free.
    const other = await createVolume(d, `pvc-other-${RUN}`, mountCap('ext4'), 64 * MiB, 'node-b');
    const so = path.join(base, 'other');
    await stage(b, other.id, so, mountCap('ext4'));
    expect(await mountSource(so)).not.toBe(da);
    // All of this happened while a's stage was held (else the test proved nothing).
    expect(Date.now() - heldSince).toBeLessThan(pause);

    await staging;
    expect(await mountSource(sa)).toBe(da);
    expect(uuidOf(da)).toBe(uuid);
    expect(backingOf(da)).toContain(`/${id}/disk.img`);

    await a.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sa });
    expect(backingOf(da)).not.toContain(`/${id}/disk.img`); // the number may serve another file's image now
    await b.clients.node.NodeUnstageVolume({ volume_id: other.id, staging_target_path: so });
  });

  it("a raw block volume: the other's unstage detaches its own device, not the one that stage has just attached", async () => {
    const cap = blockCap('MULTI_NODE_READER_ONLY');
    const { d, a, b, id, pause } = await sharedVolume('neighbours-block', cap);
    const base = path.dirname(a.socket);
    const sb = path.join(base, 'b');
    await stage(b, id, sb, cap);
    const tb = path.join(base, 'pods', 'b', 'dev');
    await publish(b, id, sb, tb, cap, true);
    const db = `/dev/${await deviceBoundAt(tb)}`;
    await b.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: tb });
    expect(backingOf(db)).toContain(`/${id}/disk.img`); // still staged on b

    const sa = path.join(base, 'a');
    const staging = stage(a, id, sa, cap);
    staging.catch(() => undefined); // awaited below; a failure before then is reported there
    const { dev: da, at: heldSince } = await attachedBy(a, id);
    expect(da).not.toBe(db);
    await b.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sb });
    expect(backingOf(db)).not.toContain(`/${id}/disk.img`); // the number may serve another file's image now
    expect(backingOf(da)).toContain(`/${id}/disk.img`);
    expect(Date.now() - heldSince).toBeLessThan(pause);

    await staging;
    // a's lease names its device, with the disk sequence number it had (on kernels that show one).
    const seq = diskseqOf(da);
    const leaseA = await leaseOf(d.poolDir, id, 'node-a');
    expect(leaseA).toMatchObject({ device: path.basename(da) });
    if (seq !== '') expect(leaseA.deviceSeq).toBe(seq);
    const ta = path.join(base, 'pods', 'a', 'dev');
    await publish(a, id, sa, ta, cap, true);
    expect(`/dev/${await deviceBoundAt(ta)}`).toBe(da);
    await a.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: ta });
    await a.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sa });
    expect(backingOf(da)).not.toContain(`/${id}/disk.img`); // the number may serve another file's image now
  });
});

/** A volume written through node `n`, then let go of: its id, image and data's checksum. */
async function writtenVolume(n: DriverProcess, base: string, name: string) {
  const cap = mountCap('ext4');
  const { id, image } = await createVolume(n, name, cap, 64 * MiB);
  const staging = path.join(base, 'staging');
  const target = path.join(base, 'pod', 'vol');
  await stage(n, id, staging, cap);
  await publish(n, id, staging, target, cap);
  const sum = await writeRandom(path.join(target, 'data.bin'), 2, 1);
  await n.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
  await n.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
  const stranger = path.join(base, 'stranger.img');
  execFileSync('truncate', ['-s', '32M', stranger]);
  execFileSync('mkfs.ext4', ['-q', '-F', stranger]);
  const stageAgain = () => stage(n, id, staging, cap);
  /** Staged again, published, read; then let go of. */
  const readBack = async () => {
    await publish(n, id, staging, target, cap);
    expect(await sha256(path.join(target, 'data.bin'))).toBe(sum);
    await n.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await n.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
  };
  return { id, image, sum, staging, stranger, strangerSum: await sha256(stranger), stageAgain, readBack };
}

/** Waits until `n` says it is held at pause point `point` (after `said` characters of its stderr). */
async function heldAt(n: DriverProcess, point: string, said: number, until: number): Promise<void> {
  while (!n.stderr().slice(said).includes(`pausepoint ${point}`)) {
    expect(Date.now()).toBeLessThan(until);
    await new Promise((r) => setTimeout(r, 20));
  }
}

const mountsOf = async (dev: string, at: string) =>
  parseMountInfo(await fs.readFile('/proc/self/mountinfo', 'utf8')).filter(
    (m) => m.source === dev || m.mountPoint === at,
  );

describe.skipIf(!isRoot())('a device the stage uses, detached meanwhile by a hand or a neighbour', () => {
  const pause = 4000 * SLOW;
  const paused = (base: string, point: string) =>
    env.driver({ dir: base, env: { LOOPVOL_PAUSEPOINT: `${point}:${pause}` } });

  it('a leftover given to another image before the stage holds it: not used; a device of its own is', async () => {
    const base = await env.dir('reuse-detached');
    const n = await paused(base, 'stage:reusing');
    const v = await writtenVolume(n, base, `pvc-reuse-gone-${RUN}`);
    const leftover = execFileSync('losetup', ['--find', '--show', v.image], { encoding: 'utf8' }).trim();
    let strangerOn = '';
    try {
      const said = n.stderr().length;
      const staged = v.stageAgain();
      await heldAt(n, 'stage:reusing', said, Date.now() + pause);
      execFileSync('losetup', ['--detach', leftover]);
      execFileSync('losetup', [leftover, v.stranger]);
      strangerOn = leftover;
      await staged;
      expect(await mountSource(v.staging)).not.toBe(leftover);
      expect((await mountsOf(leftover, '')).length).toBe(0);
      expect(backingOf(leftover)).toBe(v.stranger);
      execFileSync('losetup', ['--detach', leftover]);
      strangerOn = '';
      expect(await sha256(v.stranger)).toBe(v.strangerSum); // never checked, grown or mounted
      await v.readBack();
    } finally {
      if (strangerOn !== '') execFileSync('losetup', ['--detach', strangerOn]);
    }
  });

  it('a leftover the stage holds: a detach meanwhile cannot hand its number to another image', async () => {
    const base = await env.dir('reuse-held');
    const n = await paused(base, 'stage:formatted');
    const v = await writtenVolume(n, base, `pvc-reuse-held-${RUN}`);
    const leftover = execFileSync('losetup', ['--find', '--show', v.image], { encoding: 'utf8' }).trim();
    const said = n.stderr().length;
    const staged = v.stageAgain();
    await heldAt(n, 'stage:formatted', said, Date.now() + pause);
    execFileSync('losetup', ['--detach', leftover]); // answers OK: held, it is only marked to go
    expect(() => execFileSync('losetup', [leftover, v.stranger], { stdio: 'pipe' })).toThrow();
    await staged;
    expect(await mountSource(v.staging)).toBe(leftover);
    expect(backingOf(leftover)).toBe(v.image);
    expect(readSys(`/sys/block/${path.basename(leftover)}/loop/autoclear`)).toBe('1');
    await v.readBack();
    expect(backingOf(leftover)).toBe(''); // it went with the unstage's unmount
    expect(await sha256(v.stranger)).toBe(v.strangerSum);
  });

  it('a device this stage attached, given to another image before its mount: ABORTED, that image unmounted', async () => {
    const base = await env.dir('attach-detached');
    const n = await paused(base, 'stage:formatted');
    const v = await writtenVolume(n, base, `pvc-attach-gone-${RUN}`);
    let strangerOn = '';
    try {
      const said = n.stderr().length;
      const logged = n.logs().length;
      const staged = errorOf(v.stageAgain());
      await heldAt(n, 'stage:formatted', said, Date.now() + pause);
      const line =
        n
          .logs()
          .slice(logged)
          .find((l) => l.includes('attached loop device')) ?? '{}';
      const dev = (JSON.parse(line) as { device?: string }).device ?? '';
      expect(backingOf(dev)).toBe(v.image);
      execFileSync('losetup', ['--detach', dev]);
      execFileSync('losetup', [dev, v.stranger]);
      strangerOn = dev;
      const e = await staged;
      expect({ code: e.code, details: e.details }).toEqual({
        code: 'ABORTED',
        details: `${dev} was detached meanwhile (by another process); try again.`,
      });
      expect(await mountsOf(dev, v.staging)).toEqual([]);
      execFileSync('losetup', ['--detach', dev]);
      strangerOn = '';
      await v.stageAgain();
      await v.readBack();
    } finally {
      if (strangerOn !== '') execFileSync('losetup', ['--detach', strangerOn]);
    }
  });
});

describe.skipIf(!isRoot())(
  "a neighbour's unstage that judged a leftover its own, while a stage reuses it",
  () => {
    it('the stage leaves it alone and mounts the volume on a device of its own, which reads its data', async () => {
      const base = await env.dir('neighbour-leftover');
      const d = await env.driver({ dir: base });
      const cap = mountCap('ext4', 'MULTI_NODE_READER_ONLY');
      const { id, image, sum } = await writtenVolume(d, base, `pvc-leftover-${RUN}`);
      await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
      // Node b's umount takes 3 s (a slow filesystem's), and says when it starts.
      const bin = path.join(base, 'slow-bin');
      const mark = path.join(base, 'umount-started');
      await fs.mkdir(bin);
      await fs.writeFile(
        path.join(bin, 'umount'),
        `#!/bin/sh\ntouch '${mark}'\nsleep 3\nexec /usr/bin/umount "$@"\n`,
        { mode: 0o755 },
      );
      // Node a's stages are held between their look at the device and their mount.
      const a = await env.driver({
        dir: base,
        socket: path.join(base, 'node-a.sock'),
        nodeId: 'node-a',
        mode: 'node',
        env: { LOOPVOL_PAUSEPOINT: `stage:formatted:${6000 * SLOW}` },
      });
      const b = await env.driver({
        dir: base,
        socket: path.join(base, 'node-b.sock'),
        nodeId: 'node-b',
        mode: 'node',
        env: { PATH: `${bin}:${process.env.PATH ?? ''}` },
      });
      await publishTo(d, id, ['node-a', 'node-b'], cap, true);
      const sb = path.join(base, 'b');
      await stage(b, id, sb, cap);
      // A read-only leftover of the image (an interrupted call's): b's unstage judges it its own.
      const leftover = execFileSync('losetup', ['--find', '--show', '--read-only', image], {
        encoding: 'utf8',
      }).trim();
      const unstaging = b.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sb });
      for (let i = 0; !(await fs.stat(mark).catch(() => undefined)); i++) {
        expect(i).toBeLessThan(500);
        await new Promise((r) => setTimeout(r, 10));
      }
      // While b unmounts, a stages: b's lease is there, so the leftover (which b's unstage judged its
      // own) is not a's to reuse; a attaches a device of its own, held before its mount until b is done.
      const sa = path.join(base, 'a');
      const staging = stage(a, id, sa, cap);
      staging.catch(() => undefined); // awaited below
      await unstaging;
      await staging;
      const da = await mountSource(sa);
      expect(da).not.toBe(leftover);
      expect(backingOf(da)).toBe(image);
      const ta = path.join(base, 'pod-a', 'vol');
      await publish(a, id, sa, ta, cap, true);
      expect(await sha256(path.join(ta, 'data.bin'))).toBe(sum);
      await a.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: ta });
      await a.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sa });
      expect(backingOf(da)).not.toBe(image);
      expect(backingOf(leftover)).not.toBe(image); // a's unstage, with no neighbour left, detached it too
      expect(backingOf(leftover)).not.toBe(image);
    });
  },
);

// Before the leases were read on both sides of the look (lookBesideNeighbours) and a leftover was reused
// only with no neighbour's lease on the volume, and held open while in use (held.ts), this failed
// now and then (twice in three runs at 45 rounds): a stage reused a device a neighbour's unstage was
// detaching, and answered "holds data but no filesystem signature", or a publish right after it "not
// staged". LOOPVOL_TEST_ROUNDS runs it longer.
describe.skipIf(!isRoot())('three node plugins on one host staging shared volumes at once', () => {
  it('each reads its volumes whole, answers every call (but ABORTED, retried), and leaves nothing attached', async () => {
    const base = await env.dir('neighbours-many');
    const d = await env.driver({ dir: base });
    const nodes = ['node-a', 'node-b', 'node-c'];
    const plugins = await Promise.all(nodes.map((n) => env.nodePlugin(base, n)));
    // Three filesystems and a raw block volume, written by node-1, then shared read-only.
    const vols: { id: string; cap: VolumeCapability; sum: string }[] = [];
    for (const block of [false, false, false, true]) {
      const writer = block ? blockCap() : mountCap('ext4');
      const { id } = await createVolume(d, `pvc-many-${vols.length}-${RUN}`, writer, 64 * MiB);
      const st = path.join(base, `writer-${id}`);
      const tg = path.join(base, `writer-pod-${id}`, 'vol');
      await stage(d, id, st, writer);
      await publish(d, id, st, tg, writer);
      let sum: string;
      if (block) {
        execFileSync('dd', ['if=/dev/urandom', `of=${tg}`, 'bs=1M', 'count=4', 'conv=fsync'], {
          stdio: 'ignore',
        });
        sum = blockSum(tg);
      } else {
        sum = await writeRandom(path.join(tg, 'data.bin'), 4, vols.length);
      }
      await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: tg });
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: st });
      await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
      const cap = block ? blockCap('MULTI_NODE_READER_ONLY') : mountCap('ext4', 'MULTI_NODE_READER_ONLY');
      await publishTo(d, id, nodes, cap, true);
      vols.push({ id, cap, sum });
    }
    const failures: string[] = [];
    /** A call, retried while it answers ABORTED (another call on the volume holds it). */
    const call = async (what: string, f: () => Promise<unknown>): Promise<void> => {
      for (let i = 0; ; i++) {
        try {
          await f();
          return;
        } catch (err) {
          if ((err as { code?: number }).code === 10 && i < 100) {
            await new Promise((r) => setTimeout(r, 50));
            continue;
          }
          failures.push(`${what}: ${(err as Error).message}`);
          throw err;
        }
      }
    };
    // Each node, ROUNDS times: a volume at random, staged (unless it still is), published, read, unpublished,
    // and mostly unstaged; every volume unstaged at the end.
    await Promise.all(
      plugins.map(async (p, k) => {
        const node = nodes[k] ?? '';
        const stagingOf = (id: string): string => path.join(base, `${node}-staging-${id}`);
        for (let round = 0; round < ROUNDS; round++) {
          const v = vols[Math.floor(Math.random() * vols.length)];
          if (!v) continue;
          const block = v.cap.block !== undefined;
          const tg = path.join(base, `${node}-pod-${round}`, 'vol');
          const what = (step: string): string => `${node} ${step} ${v.id} (round ${round})`;
          try {
            await call(what('stage'), () => stage(p, v.id, stagingOf(v.id), v.cap));
            await call(what('publish'), () => publish(p, v.id, stagingOf(v.id), tg, v.cap, true));
            const sum = block ? blockSum(tg) : await sha256(path.join(tg, 'data.bin'));
            if (sum !== v.sum) failures.push(`${what('read')}: checksum ${sum}, written ${v.sum}`);
            await call(what('unpublish'), () =>
              p.clients.node.NodeUnpublishVolume({ volume_id: v.id, target_path: tg }),
            );
            if (Math.random() < 0.7)
              await call(what('unstage'), () =>
                p.clients.node.NodeUnstageVolume({ volume_id: v.id, staging_target_path: stagingOf(v.id) }),
              );
          } catch {
            // recorded in failures
          }
        }
        for (const v of vols)
          await call(`${node} last unstage ${v.id}`, () =>
            p.clients.node.NodeUnstageVolume({ volume_id: v.id, staging_target_path: stagingOf(v.id) }),
          ).catch(() => undefined);
      }),
    );
    expect(failures).toEqual([]);
    const left = execFileSync('losetup', ['--list', '--noheadings', '--output', 'NAME,BACK-FILE'], {
      encoding: 'utf8',
    })
      .split('\n')
      .filter((l) => l.includes(base));
    expect(left).toEqual([]);
  });
});
