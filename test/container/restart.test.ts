/**
 * Phase 4 of the container run: node-1's plugin restarted the way a DaemonSet rollout restarts it —
 * the old container stopped (SIGTERM, then SIGKILL when its grace period is over), a new one started
 * with the same args and mounts — while volumes are staged and published there.
 *
 *  1. A graceful rollout: the new container unpublishes, unstages and detaches what the old one set up
 *     (its mounts stayed on the host; its loop devices stayed attached).
 *  2. A plugin that hangs while it holds a pool lock (stopped by SIGSTOP the moment the lock file
 *     appears) and is killed at the end of its grace period: the new container takes the lock over at
 *     once (it names itself by the same role, node:node-1@/csi/.lvn-<hash>), so the kubelet's retry
 *     succeeds at once.
 *  3. For a minute after that restart, no call is ABORTED.
 */
import { execFileSync } from 'node:child_process';
import { createHash, randomUUID } from 'node:crypto';
import { watch } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import { MIN_INTERVAL_MS, QUIET_MS } from '../../src/idle-gc.js';
import { codeOf, type CsiClients } from '../helpers/grpc.js';
import { isMounted, leaksUnder, MiB, sha256, writeRandom } from '../helpers/host.js';
import { Cluster, docker, report } from './cluster.js';
import { flagValue } from './plan.js';

const top = process.env.LOOPVOL_CONTAINER_TOP ?? '';
const NODE = 'node-1';
const DRIVER = 'loopvol.csi.io';

interface Vol {
  id: string;
  kind: 'ext4' | 'xfs' | 'block';
  staging: string;
  target: string;
  sum: string;
}

const capFor = (kind: Vol['kind']): VolumeCapability =>
  kind === 'block'
    ? { block: {}, access_mode: { mode: 'SINGLE_NODE_WRITER' } }
    : { mount: { fs_type: kind, mount_flags: [] }, access_mode: { mode: 'SINGLE_NODE_WRITER' } };

/**
 * Loop devices backed by `image`, judged by device and inode: sysfs shows a device attached in a
 * container as that container saw the file, relative to its bind mount (/volumes/vol-…/disk.img).
 */
async function loopsBackedBy(image: string): Promise<string[]> {
  const st = await fs.stat(image, { bigint: true });
  const majMin = `${((st.dev >> 8n) & 0xfffn) | ((st.dev >> 32n) & ~0xfffn)}:${(st.dev & 0xffn) | ((st.dev >> 12n) & ~0xffn)}`;
  const out = execFileSync('losetup', ['--list', '--json', '--output', 'NAME,BACK-MAJ:MIN,BACK-INO'], {
    encoding: 'utf8',
  });
  const devices =
    (
      JSON.parse(out || '{}') as {
        // null where losetup cannot read them (a device whose backing file's filesystem is gone)
        loopdevices?: { name: string; 'back-maj:min': string | null; 'back-ino': string | number | null }[];
      }
    ).loopdevices ?? [];
  return devices
    .filter((d) => d['back-maj:min']?.trim() === majMin && String(d['back-ino']) === String(st.ino))
    .map((d) => d.name);
}

describe.skipIf(!top)('node-1 restarted as a DaemonSet rollout restarts it', () => {
  let cluster: Cluster;
  let ctl: CsiClients;
  let n1: CsiClients;
  const vols: Vol[] = [];
  let hung: Vol | undefined;

  const image = (id: string) => path.join(cluster.pool, 'volumes', id, 'disk.img');
  const reconnect = () => {
    n1.close();
    n1 = cluster.clients(NODE);
  };

  beforeAll(async () => {
    cluster = await Cluster.load(top);
    ctl = cluster.clients('controller');
    n1 = cluster.clients(NODE);
  });
  afterAll(() => {
    ctl.close();
    n1.close();
  });

  async function provision(kind: Vol['kind']): Promise<Vol> {
    const pv = `pvc-${randomUUID()}`;
    const res = await ctl.controller.CreateVolume({
      name: pv,
      capacity_range: { required_bytes: String((kind === 'xfs' ? 320 : 64) * MiB) },
      volume_capabilities: [capFor(kind)],
    });
    const id = res.volume?.volume_id ?? '';
    const k = cluster.kubeletDir(NODE);
    const podUid = randomUUID();
    const hash = createHash('sha256').update(id).digest('hex');
    return kind === 'block'
      ? {
          id,
          kind,
          staging: path.join(k, 'plugins/kubernetes.io/csi/volumeDevices/staging', pv),
          target: path.join(k, 'plugins/kubernetes.io/csi/volumeDevices/publish', pv, podUid),
          sum: '',
        }
      : {
          id,
          kind,
          staging: path.join(k, 'plugins/kubernetes.io/csi', DRIVER, hash, 'globalmount'),
          target: path.join(k, 'pods', podUid, 'volumes/kubernetes.io~csi', pv, 'mount'),
          sum: '',
        };
  }

  const stage = async (v: Vol) => {
    await fs.mkdir(v.staging, { recursive: true });
    await n1.node.NodeStageVolume({
      volume_id: v.id,
      staging_target_path: v.staging,
      volume_capability: capFor(v.kind),
    });
  };
  const publish = async (v: Vol) => {
    await fs.mkdir(path.dirname(v.target), { recursive: true });
    await n1.node.NodePublishVolume({
      volume_id: v.id,
      staging_target_path: v.staging,
      target_path: v.target,
      volume_capability: capFor(v.kind),
    });
  };
  const attach = async (v: Vol) => {
    await ctl.controller.ControllerPublishVolume({
      volume_id: v.id,
      node_id: NODE,
      volume_capability: capFor(v.kind),
    });
    await stage(v);
    await publish(v);
  };
  /** Writes 4 MiB through the host's view of the target (a file, or the device itself). */
  const write = async (v: Vol, seed: number) => {
    if (v.kind !== 'block') {
      v.sum = await writeRandom(path.join(v.target, 'data.bin'), 4, seed);
      return;
    }
    const scratch = path.join(cluster.root, `restart-${seed}.bin`);
    v.sum = await writeRandom(scratch, 4, seed);
    const data = await fs.readFile(scratch);
    await fs.rm(scratch);
    const dev = await fs.open(v.target, 'r+');
    await dev.write(data, 0, data.length, 0);
    await dev.sync();
    await dev.close();
  };
  const read = async (v: Vol): Promise<string> => {
    if (v.kind !== 'block') return sha256(path.join(v.target, 'data.bin'));
    const dev = await fs.open(v.target, 'r');
    const buf = Buffer.alloc(4 * MiB);
    await dev.read(buf, 0, buf.length, 0);
    await dev.close();
    return createHash('sha256').update(buf).digest('hex');
  };
  /** The kubelet's and attach/detach controller's teardown, by whichever container now serves node-1. */
  const takeDown = async (v: Vol) => {
    expect(
      await codeOf(n1.node.NodeUnpublishVolume({ volume_id: v.id, target_path: v.target })),
      `unpublish ${v.kind}`,
    ).toBe('OK');
    expect(
      await codeOf(n1.node.NodeUnstageVolume({ volume_id: v.id, staging_target_path: v.staging })),
      `unstage ${v.kind}`,
    ).toBe('OK');
    expect(await isMounted(v.target)).toBe(false);
    expect(await isMounted(v.staging)).toBe(false);
    expect(await loopsBackedBy(image(v.id)), `${v.kind} detached`).toEqual([]);
    await fs.rm(v.staging, { recursive: true, force: true });
    await ctl.controller.ControllerUnpublishVolume({ volume_id: v.id, node_id: NODE });
  };
  /** Lock files in the pool that name node-1's role. */
  const roleLocks = async (): Promise<{ file: string; pidNs: string }[]> => {
    const dir = path.join(cluster.pool, 'locks');
    const out: { file: string; pidNs: string }[] = [];
    for (const f of await fs.readdir(dir)) {
      if (!f.endsWith('.lock')) continue;
      const owner = JSON.parse(await fs.readFile(path.join(dir, f), 'utf8').catch(() => '{}')) as {
        role?: string;
        pidNs?: string;
      };
      // node:<id>@<the node's presence socket>
      if (owner.role?.startsWith(`node:${NODE}@`)) out.push({ file: f, pidNs: owner.pidNs ?? '' });
    }
    return out;
  };

  it('measures the plugins after the end-to-end suite and csi-sanity, and serves /metrics and /healthz', async () => {
    const rss = async (name: string) => +((await cluster.rss(name)) / 2 ** 20).toFixed(1);
    const atOnce = new Map<string, number>();
    for (const m of cluster.members) atOnce.set(m.role, await rss(m.name));
    // Once calls stop, the driver collects what the burst left (src/idle-gc.ts): after QUIET_MS, and
    // no sooner than MIN_INTERVAL_MS after its last collection, which may have come during the suite.
    const quiet = MIN_INTERVAL_MS + QUIET_MS + 1000;
    await new Promise((r) => setTimeout(r, quiet));
    for (const m of cluster.members) {
      await report(
        `${m.role}: driver RSS after the suite and csi-sanity, at once → after ${quiet / 1000} s quiet (MiB)`,
        `${atOnce.get(m.role)} → ${await rss(m.name)}`,
      );
      // --metrics-address as the manifest sets it, reached on the pod's (container's) own address.
      const port = flagValue(m.plan.args, 'metrics-address')?.split(':').pop();
      if (!port) continue;
      const ip = await docker(['inspect', '--format', '{{.NetworkSettings.IPAddress}}', m.name]);
      expect((await fetch(`http://${ip}:${port}/healthz`)).status).toBe(200);
      const metrics = await (await fetch(`http://${ip}:${port}/metrics`)).text();
      const gauge = (name: string) =>
        Number(new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, 'm').exec(metrics)?.[1] ?? 'NaN') / 2 ** 20;
      await report(
        `${m.role}: V8 heap used / total after the suite (MiB, from /metrics)`,
        `${gauge('loopvol_nodejs_heap_size_used_bytes').toFixed(1)} / ${gauge('loopvol_nodejs_heap_size_total_bytes').toFixed(1)}`,
      );
    }
  });

  it('has ext4, xfs and block volumes staged and published on node-1, written through the host’s paths', async () => {
    for (const kind of ['ext4', 'xfs', 'block'] as const) {
      const v = await provision(kind);
      await attach(v);
      await write(v, vols.length + 7);
      vols.push(v);
    }
  });

  it('1. graceful rollout: the new container unpublishes, unstages and detaches what the old one set up', async () => {
    const old = cluster.member(NODE);
    const t0 = performance.now();
    await docker(['stop', '--time', '30', old.name], 60_000);
    await report('rollout 1: old container stopped by SIGTERM (ms)', Math.round(performance.now() - t0));
    expect(await docker(['inspect', '--format', '{{.State.ExitCode}}', old.name])).toBe('0');
    await cluster.retire(NODE);
    expect(await roleLocks(), 'a graceful stop leaves no lock').toEqual([]);
    // What the old container did outlives it, on the host.
    for (const v of vols) {
      expect(await isMounted(v.target)).toBe(true);
      expect(await loopsBackedBy(image(v.id))).toHaveLength(1);
    }
    const r = await cluster.startNode(NODE);
    await report('rollout 1: new container, engine run → Probe ready (ms)', Math.round(r.readyMs));
    reconnect();
    for (const v of vols) {
      expect(await read(v), `${v.kind} data through the host's target`).toBe(v.sum);
      await takeDown(v);
    }
  });

  it('2. a plugin hung holding a pool lock and killed: its successor takes the lock over at once', async () => {
    for (const v of vols) await attach(v);
    const v = await provision('ext4');
    hung = v;
    await ctl.controller.ControllerPublishVolume({
      volume_id: v.id,
      node_id: NODE,
      volume_capability: capFor('ext4'),
    });
    await fs.mkdir(v.staging, { recursive: true });
    const old = cluster.member(NODE);
    const pid = await cluster.hostPid(old.name);
    const pidNs = await fs.readlink(`/proc/${pid}/ns/pid`);
    const lockName = `${v.id}.lock`;
    // Stop the plugin (as a hang would) the moment its lock on the volume appears.
    const tryOnce = async (): Promise<boolean> => {
      const stop = { done: false };
      const watcher = watch(path.join(cluster.pool, 'locks'), (_event, file) => {
        if (!stop.done && file === lockName) {
          process.kill(pid, 'SIGSTOP');
          stop.done = true;
        }
      });
      const call = codeOf(stage(v));
      const settled = await Promise.race([
        call.then(() => true),
        new Promise<boolean>((r) => {
          setTimeout(() => {
            r(false);
          }, 3000);
        }),
      ]);
      watcher.close();
      if (stop.done) {
        const owner = await fs.readFile(path.join(cluster.pool, 'locks', lockName), 'utf8').catch(() => '');
        if (owner.includes(pidNs)) return true;
        process.kill(pid, 'SIGCONT');
      }
      if (!settled) await call;
      // Not caught in the window: undo and try again.
      await codeOf(n1.node.NodeUnstageVolume({ volume_id: v.id, staging_target_path: v.staging }));
      return false;
    };
    let attempts = 1;
    let caught = await tryOnce();
    while (!caught && attempts < 30) {
      attempts++;
      caught = await tryOnce();
    }
    await report('rollout 2: attempts to stop the plugin while it held a lock', attempts);
    expect(caught, 'the plugin was stopped while it held the volume’s lock').toBe(true);

    // The kernel numbers namespaces from one pool and reuses a number once its namespace is gone: a
    // successor started at once may get its predecessor's pid namespace number (seen here), and then
    // judges the lock as a dead pid of its own namespace. Holding the old namespace open, as any
    // other container started in between would, makes the successor's differ, so it must recognize
    // its predecessor by role.
    const oldNs = await fs.open(`/proc/${pid}/ns/pid`, 'r');
    // The rollout: SIGTERM (the hung plugin cannot act on it), SIGKILL after the grace period.
    const t0 = performance.now();
    await docker(['stop', '--time', '2', old.name], 60_000);
    await report(
      'rollout 2: hung container killed after a 2 s grace period (ms)',
      Math.round(performance.now() - t0),
    );
    expect(await docker(['inspect', '--format', '{{.State.ExitCode}}', old.name])).toBe('137');
    await cluster.retire(NODE);
    const left = await roleLocks();
    expect(
      left.map((l) => l.file),
      'the killed plugin left its lock behind',
    ).toContain(lockName);
    await report('rollout 2: locks left by the killed container', left.map((l) => l.file).join(' '));

    const r = await cluster.startNode(NODE).finally(() => oldNs.close());
    await report('rollout 2: new container, engine run → Probe ready (ms)', Math.round(r.readyMs));
    expect(await fs.readlink(`/proc/${await cluster.hostPid(r.member.name)}/ns/pid`)).not.toBe(pidNs);
    reconnect();
    // The kubelet retries the stage that was in flight: it must succeed now, not in 60 s.
    const t1 = performance.now();
    expect(await codeOf(stage(v))).toBe('OK');
    await report(
      'rollout 2: the interrupted NodeStageVolume retried on the new container (ms)',
      Math.round(performance.now() - t1),
    );
    await publish(v);
    await write(v, 99);
    const logs = await cluster.logs(r.member.name);
    expect(logs).toContain('the previous container of this node plugin');
    expect(await roleLocks()).toEqual([]);
  });

  it('3. answers no call ABORTED for a minute after the restart', async () => {
    const all = [...vols, ...(hung ? [hung] : [])];
    const codes: Record<string, number> = {};
    const count = (code: string) => (codes[code] = (codes[code] ?? 0) + 1);
    const until = Date.now() + 60_000;
    let cycles = 0;
    while (Date.now() < until) {
      for (const v of all) {
        count(await codeOf(n1.node.NodeGetVolumeStats({ volume_id: v.id, volume_path: v.target })));
      }
      // Every lock-taking step a kubelet makes, on one volume per round.
      const v = all[cycles % all.length];
      if (v) {
        count(await codeOf(n1.node.NodeUnpublishVolume({ volume_id: v.id, target_path: v.target })));
        count(await codeOf(n1.node.NodeUnstageVolume({ volume_id: v.id, staging_target_path: v.staging })));
        count(await codeOf(stage(v)));
        count(await codeOf(publish(v)));
      }
      cycles++;
      await new Promise((r) => setTimeout(r, 250));
    }
    await report('after rollout 2, one minute of calls (codes)', codes);
    expect(codes.ABORTED ?? 0).toBe(0);
    expect(Object.keys(codes)).toEqual(['OK']);
    for (const v of all) expect(await read(v), `${v.kind} data`).toBe(v.sum);
  });

  it('the new container takes everything down, and nothing is left', async () => {
    const all = [...vols, ...(hung ? [hung] : [])];
    for (const v of all) {
      await takeDown(v);
      await ctl.controller.DeleteVolume({ volume_id: v.id });
    }
    expect(await leaksUnder(cluster.root)).toEqual({ loops: [], mounts: [] });
  });
});
