/**
 * /metrics after a real lifecycle (root only): volumes created, staged, snapshotted while in use (a
 * freeze), cloned, restored, raced (ABORTED) and deleted; every value is checked against the pool as
 * the test reads it (counts, provisioned and allocated bytes, copy bytes), not only that names exist.
 * And a long sparse copy logs its progress.
 */
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import { Writable } from 'node:stream';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { bindExec, ExecRunner } from '../../src/exec/runner.js';
import { Metrics } from '../../src/metrics.js';
import { copyImage } from '../../src/pool/images.js';
import { setTelemetry } from '../../src/telemetry.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { codeOf } from '../helpers/grpc.js';
import { isRoot, MiB, RUN } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const srv = net.createServer().listen(0, '127.0.0.1', () => {
      const p = (srv.address() as net.AddressInfo).port;
      srv.close(() => {
        resolve(p);
      });
    });
  });
}

interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

/** The samples of a Prometheus text exposition. */
function parseMetrics(text: string): Sample[] {
  const out: Sample[] = [];
  for (const line of text.split('\n')) {
    const m = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$/.exec(line);
    if (!m?.[1] || m[3] === undefined) continue;
    const labels: Record<string, string> = {};
    for (const l of (m[2] ?? '').matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1] ?? ''] = l[2] ?? '';
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return out;
}

/** The one sample of `name` whose labels include `labels`; 0 when there is none (a counter never incremented). */
function value(samples: readonly Sample[], name: string, labels: Record<string, string> = {}): number {
  const hits = samples.filter(
    (s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v),
  );
  if (hits.length > 1) throw new Error(`${name} ${JSON.stringify(labels)} matches ${hits.length} samples`);
  return hits[0]?.value ?? 0;
}

const allocated = async (file: string): Promise<number> => (await fs.stat(file)).blocks * 512;

describe.skipIf(!isRoot())('metrics', () => {
  it('match the pool after a lifecycle', async () => {
    const base = await env.dir('metrics');
    const port = await freePort();
    const d = await env.driver({
      dir: base,
      nodeId: 'node-1',
      extra: [`--metrics-address=127.0.0.1:${port}`],
    });
    const ctl = d.clients.controller;
    const create = async (name: string, cap = mountCap('ext4'), extra: object = {}) =>
      (
        await ctl.CreateVolume({
          name: `${name}-${RUN}`,
          capacity_range: { required_bytes: String(32 * MiB) },
          volume_capabilities: [cap],
          parameters: { 'csi.storage.k8s.io/pvc/name': name, 'csi.storage.k8s.io/pvc/namespace': 'apps' },
          ...extra,
        })
      ).volume?.volume_id ?? '';
    const image = (kind: 'volumes' | 'snapshots', id: string) => path.join(d.poolDir, kind, id, 'disk.img');

    // X: a filesystem in use while it is snapshotted (its node freezes it for the copy).
    const x = await create('x');
    const staging = path.join(base, 'kubelet', 'x');
    await fs.mkdir(staging, { recursive: true });
    await ctl.ControllerPublishVolume({
      volume_id: x,
      node_id: 'node-1',
      volume_capability: mountCap('ext4'),
    });
    await d.clients.node.NodeStageVolume({
      volume_id: x,
      staging_target_path: staging,
      volume_capability: mountCap('ext4'),
    });
    await ctl.CreateSnapshot({ name: `snap-x-${RUN}`, source_volume_id: x });
    await d.clients.node.NodeUnstageVolume({ volume_id: x, staging_target_path: staging });
    await ctl.ControllerUnpublishVolume({ volume_id: x, node_id: 'node-1' });

    // Y: raw block, with 3 MiB written into its image: what its copies must count, byte for byte.
    const y = await create('y', blockCap());
    const h = await fs.open(image('volumes', y), 'r+');
    await h.write(Buffer.alloc(3 * MiB, 0x5a), 0, 3 * MiB, MiB);
    await h.sync();
    await h.close();
    const allocY = await allocated(image('volumes', y));
    const snapY =
      (await ctl.CreateSnapshot({ name: `snap-y-${RUN}`, source_volume_id: y })).snapshot?.snapshot_id ?? '';
    await create('clone', blockCap(), { volume_content_source: { volume: { volume_id: y } } });
    const restored = await create('restore', blockCap(), {
      volume_content_source: { snapshot: { snapshot_id: snapY } },
    });
    // The same clone asked for five times at once: one copies, the others are ABORTED or find it made.
    const race = await Promise.all(
      Array.from({ length: 5 }, () =>
        codeOf(create('race', blockCap(), { volume_content_source: { volume: { volume_id: y } } })),
      ),
    );
    expect(race).toContain('OK');
    const abortedSeen = race.filter((c) => c === 'ABORTED').length;
    await ctl.DeleteVolume({ volume_id: restored });

    const s = parseMetrics(await (await fetch(`http://127.0.0.1:${port}/metrics`)).text());

    // Counts and bytes, against the pool as it is on disk.
    const sum = async (kind: 'volumes' | 'snapshots') => {
      const ids = await fs.readdir(path.join(d.poolDir, kind));
      let size = 0;
      let alloc = 0;
      for (const id of ids) {
        const st = await fs.stat(image(kind, id));
        size += st.size;
        alloc += st.blocks * 512;
      }
      return { n: ids.length, size, alloc };
    };
    const vols = await sum('volumes');
    const snaps = await sum('snapshots');
    expect(vols.n).toBe(4); // x, y, clone, race
    expect(value(s, 'loopvol_volumes', { state: 'ready' })).toBe(vols.n);
    expect(value(s, 'loopvol_snapshots', { state: 'ready' })).toBe(snaps.n);
    expect(value(s, 'loopvol_pool_provisioned_bytes', { kind: 'volume' })).toBe(vols.size);
    expect(value(s, 'loopvol_pool_allocated_bytes', { kind: 'volume' })).toBe(vols.alloc);
    expect(value(s, 'loopvol_pool_provisioned_bytes', { kind: 'snapshot' })).toBe(snaps.size);
    expect(value(s, 'loopvol_pool_allocated_bytes', { kind: 'snapshot' })).toBe(snaps.alloc);
    expect(
      value(s, 'loopvol_volume_allocated_bytes', { volume_id: x, pvc_namespace: 'apps', pvc_name: 'x' }),
    ).toBe(await allocated(image('volumes', x)));
    expect(s.filter((m) => m.name === 'loopvol_volume_allocated_bytes')).toHaveLength(vols.n);

    // Copies: two clones of Y (the first, and the race's one), a restore of its snapshot, two snapshots.
    expect(value(s, 'loopvol_copy_bytes_total', { purpose: 'clone', method: 'sparse-copy' })).toBe(
      2 * allocY,
    );
    expect(value(s, 'loopvol_copy_bytes_total', { purpose: 'restore', method: 'sparse-copy' })).toBe(
      await allocated(image('snapshots', snapY)),
    );
    expect(
      value(s, 'loopvol_copy_duration_seconds_count', { purpose: 'snapshot', method: 'sparse-copy' }),
    ).toBe(2);
    expect(
      value(s, 'loopvol_copy_bytes_total', { purpose: 'snapshot', method: 'sparse-copy' }),
    ).toBeGreaterThan(allocY);
    // One freeze, for the snapshot of X while it was staged, thawed after the copy.
    expect(value(s, 'loopvol_freezes_total', { reason: 'copy' })).toBe(1);
    expect(value(s, 'loopvol_freeze_duration_seconds_count')).toBe(1);
    // Calls: ABORTED as the clients saw them, nothing in flight, pool locks taken.
    expect(value(s, 'loopvol_rpc_aborted_total', { service: 'Controller', method: 'CreateVolume' })).toBe(
      abortedSeen,
    );
    const inFlight = s.filter((m) => m.name === 'loopvol_operations_in_flight');
    expect(inFlight.length).toBeGreaterThan(0);
    expect(inFlight.every((m) => m.value === 0)).toBe(true);
    expect(value(s, 'loopvol_lock_wait_seconds_count', { outcome: 'acquired' })).toBeGreaterThan(10);
    // A clean pool and host: nothing found.
    expect(s.filter((m) => m.name === 'loopvol_check_findings' && m.value > 0)).toEqual([]);
  });

  it('can leave out the per-volume series', async () => {
    const base = await env.dir('metrics-off');
    const port = await freePort();
    const d = await env.driver({
      dir: base,
      mode: 'controller',
      extra: [`--metrics-address=127.0.0.1:${port}`, '--per-volume-metrics=false'],
    });
    await d.clients.controller.CreateVolume({
      name: `off-${RUN}`,
      capacity_range: { required_bytes: String(MiB) },
      volume_capabilities: [blockCap()],
    });
    const s = parseMetrics(await (await fetch(`http://127.0.0.1:${port}/metrics`)).text());
    expect(value(s, 'loopvol_volumes', { state: 'ready' })).toBe(1);
    expect(s.some((m) => m.name === 'loopvol_volume_allocated_bytes')).toBe(false);
  });
});

describe('a long sparse copy', () => {
  it('logs how far it got at a steady interval, and counts its bytes', async () => {
    const dir = await env.dir('progress');
    const src = path.join(dir, 'src.img');
    const h = await fs.open(src, 'w');
    const chunk = Buffer.alloc(4 * MiB, 0xab);
    for (let i = 0; i < 64; i++) await h.write(chunk, 0, chunk.length, i * 2 * chunk.length); // data, holes
    await h.close();
    const lines: { msg: string; copiedBytes: number; totalBytes: number; percent: number }[] = [];
    const log = pino(
      { level: 'info' },
      new Writable({
        write(data: Buffer, _enc, done) {
          lines.push(JSON.parse(data.toString()) as (typeof lines)[number]);
          done();
        },
      }),
    );
    const metrics = new Metrics();
    setTelemetry(metrics);
    try {
      const x = bindExec(new ExecRunner(), { log, deadline: Number.POSITIVE_INFINITY });
      const r = await copyImage(x, src, path.join(dir, 'dst.img'), {
        allowCopy: true,
        purpose: 'clone',
        progressMs: 5,
      });
      expect(r.method).toBe('sparse-copy');
      const total = await allocated(src);
      const progress = lines.filter((l) => l.msg === 'copying image');
      expect(progress.length).toBeGreaterThan(0);
      for (const l of progress) {
        expect(l.totalBytes).toBe(total);
        expect(l.copiedBytes).toBeLessThanOrEqual(total);
        expect(l.percent).toBe(Math.floor((l.copiedBytes / total) * 100));
      }
      const s = parseMetrics(await metrics.registry.metrics());
      expect(value(s, 'loopvol_copy_bytes_total', { purpose: 'clone', method: 'sparse-copy' })).toBe(total);
    } finally {
      setTelemetry(undefined);
    }
  });
});
