/**
 * The Controller service on a real pool, through the real binary: idempotency, crash recovery at every
 * step, concurrency within and across processes, pagination, capacity, the attach fence.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { CreateVolumeRequest } from '../../src/gen/csi/v1/CreateVolumeRequest.js';
import { type DriverArgs, type DriverProcess, runMain } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { diskUsage, GiB, leaksUnder, MiB, scratchFilesystem, type ScratchFs } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const dir = (tag: string): Promise<string> => env.dir(tag);
const driver = (args: DriverArgs): Promise<DriverProcess> => env.driver(args);

/** A process of `name` whose parent is `parent`, found within `ms`; its pid. */
async function childNamed(parent: number, name: string, ms: number): Promise<number> {
  const until = Date.now() + ms;
  // The parent's children as the kernel lists them (a look at every process of a busy machine can take
  // longer than a short copy), or every process where the kernel does not list them.
  const children = async (): Promise<string[]> => {
    const tids = await fs.readdir(`/proc/${parent}/task`).catch(() => []);
    const lists = await Promise.all(
      tids.map((t) => fs.readFile(`/proc/${parent}/task/${t}/children`, 'utf8').catch(() => undefined)),
    );
    if (lists.length > 0 && lists.every((l) => l !== undefined)) return lists.join(' ').split(/\s+/);
    return fs.readdir('/proc');
  };
  while (Date.now() < until) {
    for (const pid of await children()) {
      if (!/^\d+$/.test(pid)) continue;
      const status = await fs.readFile(`/proc/${pid}/status`, 'utf8').catch(() => '');
      if (
        new RegExp(`^Name:\\s+${name}$`, 'm').test(status) &&
        new RegExp(`^PPid:\\s+${parent}$`, 'm').test(status)
      )
        return Number(pid);
    }
    await new Promise((r) => setTimeout(r, 1));
  }
  throw new Error(`no ${name} started by ${parent} within ${ms} ms`);
}

/** Whether process `pid` exists and is not a zombie. */
async function isRunning(pid: number): Promise<boolean> {
  const stat = await fs.readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
  return stat !== '' && stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3) !== 'Z';
}

describe('CreateVolume and DeleteVolume', () => {
  let d: DriverProcess;
  beforeAll(async () => {
    d = await driver({ dir: await dir('ctl') });
  });

  it('creates a sparse image of the rounded-up size with its metadata beside it', async () => {
    const res = await d.clients.controller.CreateVolume({
      name: 'pvc-sparse',
      capacity_range: { required_bytes: String(100 * MiB + 1) },
      volume_capabilities: [mountCap()],
      parameters: { 'csi.storage.k8s.io/pvc/name': 'data', 'csi.storage.k8s.io/pvc/namespace': 'default' },
    });
    const v = res.volume;
    expect(v?.capacity_bytes).toBe(String(101 * MiB));
    expect(v?.accessible_topology).toEqual([{ segments: { 'loopvol.csi.io/pool': 'default' } }]);
    const volDir = path.join(d.poolDir, 'volumes', v?.volume_id ?? '');
    const st = await fs.stat(path.join(volDir, 'disk.img'));
    expect(st.size).toBe(101 * MiB);
    expect(st.blocks).toBe(0);
    const meta = JSON.parse(await fs.readFile(path.join(volDir, 'meta.json'), 'utf8')) as Record<
      string,
      unknown
    >;
    expect(meta).toMatchObject({ name: 'pvc-sparse', state: 'ready', fsType: 'ext4', allocation: 'sparse' });
    expect(meta.labels).toEqual({ 'pvc/name': 'data', 'pvc/namespace': 'default' });
    const pool = JSON.parse(await fs.readFile(path.join(d.poolDir, 'pool.json'), 'utf8')) as {
      format: number;
    };
    expect(pool.format).toBe(1);
  });

  it('is idempotent by name and refuses the same name with other arguments', async () => {
    const req = {
      name: 'pvc-twice',
      capacity_range: { required_bytes: String(10 * MiB) },
      volume_capabilities: [mountCap()],
    };
    const a = await d.clients.controller.CreateVolume(req);
    const b = await d.clients.controller.CreateVolume(req);
    expect(b.volume?.volume_id).toBe(a.volume?.volume_id);
    expect(
      await codeOf(
        d.clients.controller.CreateVolume({ ...req, capacity_range: { required_bytes: String(20 * MiB) } }),
      ),
    ).toBe('ALREADY_EXISTS');
    expect(
      await codeOf(d.clients.controller.CreateVolume({ ...req, parameters: { allocation: 'preallocate' } })),
    ).toBe('ALREADY_EXISTS');
    expect(
      await codeOf(d.clients.controller.CreateVolume({ ...req, volume_capabilities: [mountCap('xfs')] })),
    ).toBe('ALREADY_EXISTS');
  });

  it('uses the documented default size and filesystem minimums', async () => {
    const plain = await d.clients.controller.CreateVolume({
      name: 'pvc-default',
      volume_capabilities: [mountCap()],
    });
    expect(plain.volume?.capacity_bytes).toBe(String(GiB));
    const xfs = await d.clients.controller.CreateVolume({
      name: 'pvc-xfs-small',
      capacity_range: { required_bytes: String(10 * MiB) },
      volume_capabilities: [mountCap('xfs')],
    });
    expect(xfs.volume?.capacity_bytes).toBe(String(300 * MiB));
    const e = await errorOf(
      d.clients.controller.CreateVolume({
        name: 'pvc-xfs-limited',
        capacity_range: { required_bytes: String(10 * MiB), limit_bytes: String(100 * MiB) },
        volume_capabilities: [mountCap('xfs')],
      }),
    );
    expect(e.code).toBe('OUT_OF_RANGE');
    expect(e.details).toContain('at least 300 MiB');
    const block = await d.clients.controller.CreateVolume({
      name: 'pvc-block-tiny',
      capacity_range: { required_bytes: '1' },
      volume_capabilities: [blockCap()],
    });
    expect(block.volume?.capacity_bytes).toBe(String(MiB));
  });

  it.each<[string, CreateVolumeRequest, string]>([
    ['no name', { volume_capabilities: [mountCap()] }, 'INVALID_ARGUMENT'],
    ['no capabilities', { name: 'x' }, 'INVALID_ARGUMENT'],
    [
      'a multi-node writer',
      { name: 'x', volume_capabilities: [mountCap('', 'MULTI_NODE_MULTI_WRITER')] },
      'INVALID_ARGUMENT',
    ],
    ['an unknown filesystem', { name: 'x', volume_capabilities: [mountCap('ntfs')] }, 'INVALID_ARGUMENT'],
    [
      'an unknown parameter',
      { name: 'x', volume_capabilities: [mountCap()], parameters: { speed: 'fast' } },
      'INVALID_ARGUMENT',
    ],
    [
      'a bad allocation',
      { name: 'x', volume_capabilities: [mountCap()], parameters: { allocation: 'thick' } },
      'INVALID_ARGUMENT',
    ],
    [
      'a bad fstype parameter',
      { name: 'x', volume_capabilities: [mountCap()], parameters: { 'csi.storage.k8s.io/fstype': 'zfs' } },
      'INVALID_ARGUMENT',
    ],
    [
      'an unsafe mount flag',
      {
        name: 'x',
        volume_capabilities: [
          { mount: { fs_type: 'ext4', mount_flags: ['bind'] }, access_mode: { mode: 'SINGLE_NODE_WRITER' } },
        ],
      },
      'INVALID_ARGUMENT',
    ],
    [
      'required above limit',
      {
        name: 'x',
        volume_capabilities: [mountCap()],
        capacity_range: { required_bytes: '200', limit_bytes: '100' },
      },
      'OUT_OF_RANGE',
    ],
    [
      'a negative size',
      { name: 'x', volume_capabilities: [mountCap()], capacity_range: { required_bytes: '-5' } },
      'INVALID_ARGUMENT',
    ],
    [
      'another pool in the topology',
      {
        name: 'x',
        volume_capabilities: [mountCap()],
        accessibility_requirements: {
          requisite: [{ segments: { 'loopvol.csi.io/pool': 'other' } }],
          preferred: [],
        },
      },
      'RESOURCE_EXHAUSTED',
    ],
    [
      'a missing snapshot source',
      {
        name: 'x',
        volume_capabilities: [mountCap()],
        volume_content_source: { snapshot: { snapshot_id: 'snap-00000000000000000000000000000000' } },
      },
      'NOT_FOUND',
    ],
    [
      'a missing volume source',
      {
        name: 'x',
        volume_capabilities: [mountCap()],
        volume_content_source: { volume: { volume_id: '../../etc' } },
      },
      'NOT_FOUND',
    ],
    [
      'an unknown mutable parameter',
      { name: 'x', volume_capabilities: [mountCap()], mutable_parameters: { iops: '5' } },
      'INVALID_ARGUMENT',
    ],
  ])('refuses %s', async (_what, req, code) => {
    const e = await errorOf(d.clients.controller.CreateVolume(req));
    expect(e.code).toBe(code);
    expect(e.details.length).toBeGreaterThan(10);
    expect(e.details).not.toMatch(/\n|at .*\.ts/);
  });

  it('names the known parameters when one is unknown', async () => {
    const e = await errorOf(
      d.clients.controller.CreateVolume({
        name: 'x',
        volume_capabilities: [mountCap()],
        parameters: { speed: 'fast' },
      }),
    );
    expect(e.details).toContain('csi.storage.k8s.io/fstype');
    expect(e.details).toContain('allocation');
  });

  it('deletes, and treats an unknown or malformed id as already deleted', async () => {
    const v = await d.clients.controller.CreateVolume({
      name: 'pvc-del',
      volume_capabilities: [blockCap()],
      capacity_range: { required_bytes: String(MiB) },
    });
    const id = v.volume?.volume_id ?? '';
    await d.clients.controller.DeleteVolume({ volume_id: id });
    await d.clients.controller.DeleteVolume({ volume_id: id });
    await expect(fs.stat(path.join(d.poolDir, 'volumes', id))).rejects.toThrow(/ENOENT/);
    for (const bad of ['vol-00000000000000000000000000000000', '../pool.json', 'x/../../y']) {
      expect(await codeOf(d.clients.controller.DeleteVolume({ volume_id: bad }))).toBe('OK');
    }
    expect(await fs.readFile(path.join(d.poolDir, 'pool.json'), 'utf8')).toContain('format');
    expect(await codeOf(d.clients.controller.DeleteVolume({ volume_id: '' }))).toBe('INVALID_ARGUMENT');
  });

  it('makes one volume out of 50 concurrent calls with one name', async () => {
    const req = {
      name: 'pvc-race',
      capacity_range: { required_bytes: String(8 * MiB) },
      volume_capabilities: [mountCap()],
    };
    const outcomes = await Promise.all(
      Array.from({ length: 50 }, () =>
        d.clients.controller.CreateVolume(req).then(
          (r) => ({ code: 'OK', id: r.volume?.volume_id }),
          (err: unknown) => codeOf(Promise.reject(err as Error)).then((code) => ({ code, id: undefined })),
        ),
      ),
    );
    const ok = outcomes.filter((o) => o.code === 'OK');
    expect(ok.length).toBeGreaterThanOrEqual(1);
    expect(new Set(outcomes.map((o) => o.code))).toEqual(
      new Set(ok.length === 50 ? ['OK'] : ['OK', 'ABORTED']),
    );
    const ids = new Set(ok.map((o) => o.id));
    expect(ids.size).toBe(1);
    const again = await d.clients.controller.CreateVolume(req);
    expect(ids.has(again.volume?.volume_id)).toBe(true);
    const all = await d.clients.controller.ListVolumes({});
    expect(all.entries.filter((e) => e.volume?.volume_id === again.volume?.volume_id)).toHaveLength(1);
  });
});

describe('crash safety', () => {
  const points = [
    'create-volume:dir',
    'create-volume:meta-creating',
    'create-volume:image-written',
    'create-volume:image-renamed',
    'create-volume:ready',
  ];
  it.each(points)('a CreateVolume killed at %s is finished by its retry, once', async (point) => {
    const base = await dir('crash');
    const first = await driver({ dir: base, env: { LOOPVOL_FAILPOINT: point } });
    const req = {
      name: `pvc-crash-${point}`,
      capacity_range: { required_bytes: String(64 * MiB) },
      volume_capabilities: [mountCap()],
      parameters: { allocation: 'preallocate' },
    };
    expect(await codeOf(first.clients.controller.CreateVolume(req))).not.toBe('OK');
    expect(await first.exited).toBe(null); // killed by SIGKILL
    const second = await driver({ dir: base });
    const res = await second.clients.controller.CreateVolume(req);
    const id = res.volume?.volume_id ?? '';
    expect(await fs.readdir(path.join(second.poolDir, 'volumes'))).toEqual([id]);
    expect((await fs.readdir(path.join(second.poolDir, 'volumes', id))).sort()).toEqual([
      'disk.img',
      'meta.json',
    ]);
    expect(await fs.readdir(path.join(second.poolDir, 'trash'))).toEqual([]);
    const st = await fs.stat(path.join(second.poolDir, 'volumes', id, 'disk.img'));
    expect(st.size).toBe(64 * MiB);
    expect(st.blocks * 512).toBeGreaterThanOrEqual(64 * MiB);
    const list = await second.clients.controller.ListVolumes({});
    expect(list.entries.map((e) => e.volume?.volume_id)).toEqual([id]);
    expect((await second.clients.controller.CreateVolume(req)).volume?.volume_id).toBe(id);
  });

  it('a ControllerExpandVolume killed between the image and its record: snapshots of both kinds hold the image, check says so, the retry (even lowered) records it', async () => {
    const base = await dir('crashgrow');
    const first = await driver({ dir: base, env: { LOOPVOL_FAILPOINT: 'expand-volume:grown' } });
    const v = await first.clients.controller.CreateVolume({
      name: 'pvc-grow-cut',
      capacity_range: { required_bytes: String(16 * MiB) },
      volume_capabilities: [blockCap()],
    });
    const id = v.volume?.volume_id ?? '';
    const grow = (c: DriverProcess, bytes = 32 * MiB) =>
      c.clients.controller.ControllerExpandVolume({
        volume_id: id,
        capacity_range: { required_bytes: String(bytes) },
      });
    expect(await codeOf(grow(first))).not.toBe('OK');
    expect(await first.exited).toBe(null); // killed by SIGKILL
    const second = await driver({ dir: base });
    const one = await second.clients.controller.CreateSnapshot({ name: 'cut-one', source_volume_id: id });
    const group = await second.clients.group.CreateVolumeGroupSnapshot({
      name: 'cut-group',
      source_volume_ids: [id],
    });
    const check = await runMain(['check', '--only=pool', '--json', `--pool-dir=${second.poolDir}`]);
    const kinds = (JSON.parse(check.stdout) as { findings: { kind: string }[] }).findings.map((f) => f.kind);
    // Retried lowered, as Kubernetes' recovery from a failed expansion may: the image's size is recorded.
    const retried = await grow(second, 24 * MiB);
    const after = await runMain(['check', '--only=pool', '--json', `--pool-dir=${second.poolDir}`]);
    expect({
      one: one.snapshot?.size_bytes,
      member: group.group_snapshot?.snapshots[0]?.size_bytes,
      kinds,
      retried: retried.capacity_bytes,
      after: (JSON.parse(after.stdout) as { findings: unknown[] }).findings,
    }).toEqual({
      one: String(32 * MiB),
      member: String(32 * MiB),
      kinds: ['image-larger-than-record'],
      retried: String(32 * MiB),
      after: [],
    });
  });

  it('an image left a length of no whole MiB (a failed preallocated growth of an older release) is grown to the next MiB by the retry', async () => {
    const d = await driver({ dir: await dir('oddgrow') });
    const v = await d.clients.controller.CreateVolume({
      name: 'pvc-odd-length',
      capacity_range: { required_bytes: String(16 * MiB) },
      volume_capabilities: [blockCap()],
    });
    const id = v.volume?.volume_id ?? '';
    const image = path.join(d.poolDir, 'volumes', id, 'disk.img');
    await fs.truncate(image, 20 * MiB + 12_345);
    const retried = await d.clients.controller.ControllerExpandVolume({
      volume_id: id,
      capacity_range: { required_bytes: String(16 * MiB) },
    });
    expect({ capacity: retried.capacity_bytes, image: (await fs.stat(image)).size }).toEqual({
      capacity: String(21 * MiB),
      image: 21 * MiB,
    });
    // Rounded up, it is past a limit between the two: more than limit_bytes is OUT_OF_RANGE.
    await fs.truncate(image, 22 * MiB + 12_345);
    const limited = d.clients.controller.ControllerExpandVolume({
      volume_id: id,
      capacity_range: { required_bytes: String(16 * MiB), limit_bytes: String(22 * MiB + 65_536) },
    });
    expect({ code: await codeOf(limited), image: (await fs.stat(image)).size }).toEqual({
      code: 'OUT_OF_RANGE',
      image: 22 * MiB + 12_345,
    });
  });

  it('a DeleteVolume killed after it moved the volume away is not resurrected', async () => {
    const base = await dir('crashdel');
    const first = await driver({ dir: base, env: { LOOPVOL_FAILPOINT: 'discard:moved' } });
    const v = await first.clients.controller.CreateVolume({
      name: 'pvc-gone',
      volume_capabilities: [blockCap()],
    });
    const id = v.volume?.volume_id ?? '';
    expect(await codeOf(first.clients.controller.DeleteVolume({ volume_id: id }))).not.toBe('OK');
    const second = await driver({ dir: base });
    expect((await second.clients.controller.ListVolumes({})).entries).toEqual([]);
    expect(await fs.readdir(path.join(second.poolDir, 'trash'))).toEqual([]);
    await second.clients.controller.DeleteVolume({ volume_id: id });
  });

  it('a ControllerPublishVolume killed between its two records is completed by its retry', async () => {
    const base = await dir('crashpub');
    const first = await driver({ dir: base, env: { LOOPVOL_FAILPOINT: 'publish:indexed' } });
    const v = await first.clients.controller.CreateVolume({
      name: 'pvc-pub',
      volume_capabilities: [blockCap()],
    });
    const id = v.volume?.volume_id ?? '';
    const pub = { volume_id: id, node_id: 'node-1', volume_capability: blockCap() };
    expect(await codeOf(first.clients.controller.ControllerPublishVolume(pub))).not.toBe('OK');
    const second = await driver({ dir: base });
    await second.clients.controller.ControllerPublishVolume(pub);
    const got = await second.clients.controller.ControllerGetVolume({ volume_id: id });
    expect(got.status?.published_node_ids).toEqual(['node-1']);
    await second.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
    expect(await fs.readdir(path.join(base, 'pool', 'nodes', 'node-1.attached'))).toEqual([]);
  });

  it('a byte copy in flight dies with a controller killed by SIGKILL, not left filling the pool', async () => {
    const base = await dir('crashcopy');
    const scratch = await scratchFilesystem(base, 'ext4', 2048); // no reflink: the clone is a byte copy
    env.declareOwn(scratch.mountPoint, scratch.device);
    const first = await driver({ dir: base, poolDir: path.join(scratch.mountPoint, 'pool') });
    const src = await first.clients.controller.CreateVolume({
      name: 'pvc-copied',
      capacity_range: { required_bytes: String(320 * MiB) },
      volume_capabilities: [blockCap()],
    });
    const srcId = src.volume?.volume_id ?? '';
    const h = await fs.open(path.join(first.poolDir, 'volumes', srcId, 'disk.img'), 'r+');
    try {
      for (let i = 0; i < 256; i++) await h.write(Buffer.alloc(MiB, i + 1), 0, MiB, i * MiB);
      await h.sync();
    } finally {
      await h.close();
    }
    const clone = codeOf(
      first.clients.controller.CreateVolume({
        name: 'pvc-clone-of-copied',
        capacity_range: { required_bytes: String(320 * MiB) },
        volume_capabilities: [blockCap()],
        volume_content_source: { volume: { volume_id: srcId } },
      }),
    );
    // The driver's cp, caught and stopped mid-copy, so that it is still copying when the driver dies.
    const cp = await childNamed(first.proc.pid ?? 0, 'cp', 10_000);
    let alive: boolean | undefined;
    try {
      process.kill(cp, 'SIGSTOP');
      first.proc.kill('SIGKILL');
      await first.exited;
      await new Promise((r) => setTimeout(r, 500));
      alive = await isRunning(cp);
    } finally {
      if (await isRunning(cp)) {
        process.kill(cp, 'SIGKILL');
        process.kill(cp, 'SIGCONT');
      }
    }
    expect({ clone: await clone, copyLeftRunning: alive }).toEqual({
      clone: 'UNAVAILABLE',
      copyLeftRunning: false,
    });
  });

  it('two controller processes racing on one name make one volume', async () => {
    const base = await dir('twoctl');
    const a = await driver({ dir: base, socket: path.join(base, 'a.sock'), mode: 'controller' });
    const b = await driver({ dir: base, socket: path.join(base, 'b.sock'), mode: 'controller' });
    const req = {
      name: 'pvc-shared',
      capacity_range: { required_bytes: String(32 * MiB) },
      volume_capabilities: [mountCap()],
    };
    const calls = Array.from({ length: 20 }, (_, i) => (i % 2 ? a : b).clients.controller.CreateVolume(req));
    const settled = await Promise.allSettled(calls);
    const ids = new Set(
      settled.flatMap((r) => (r.status === 'fulfilled' ? [r.value.volume?.volume_id] : [])),
    );
    expect(ids.size).toBeLessThanOrEqual(1);
    const final = await a.clients.controller.CreateVolume(req);
    expect(await fs.readdir(path.join(base, 'pool', 'volumes'))).toEqual([final.volume?.volume_id]);
  });
});

describe('ListVolumes', () => {
  it('pages through 1,000 volumes stably and refuses a token it did not issue', async () => {
    const d = await driver({ dir: await dir('list') });
    const created: string[] = [];
    for (let i = 0; i < 1000; i += 25) {
      const batch = await Promise.all(
        Array.from({ length: 25 }, (_, j) =>
          d.clients.controller.CreateVolume({
            name: `pvc-list-${i + j}`,
            volume_capabilities: [blockCap()],
            capacity_range: { required_bytes: String(MiB) },
          }),
        ),
      );
      created.push(...batch.map((r) => r.volume?.volume_id ?? ''));
    }
    const seen: string[] = [];
    let token = '';
    let pages = 0;
    do {
      const page = await d.clients.controller.ListVolumes({ max_entries: 128, starting_token: token });
      expect(page.entries.length).toBeLessThanOrEqual(128);
      seen.push(...page.entries.map((e) => e.volume?.volume_id ?? ''));
      token = page.next_token;
      pages++;
    } while (token !== '');
    expect(pages).toBe(8);
    expect(seen).toEqual([...created].sort());
    const all = await d.clients.controller.ListVolumes({});
    expect(all.entries).toHaveLength(1000);
    expect(all.entries[0]?.status?.volume_condition).toEqual({
      abnormal: false,
      message: expect.any(String) as unknown,
    });
    expect(await codeOf(d.clients.controller.ListVolumes({ starting_token: 'invalid-token' }))).toBe(
      'ABORTED',
    );
    expect(await codeOf(d.clients.controller.ListVolumes({ max_entries: -1 }))).toBe('INVALID_ARGUMENT');
  });
});

describe('capacity', () => {
  let pool: ScratchFs;
  beforeAll(async () => {
    pool = await scratchFilesystem(await dir('cap'), 'ext4', 512);
    env.declareOwn(pool.mountPoint, pool.device);
  });

  /** A driver on the small scratch pool; `socket` names its own socket beside it (several run in turn). */
  const onScratchPool = (socket?: string, extra: string[] = []): Promise<DriverProcess> => {
    const base = path.dirname(pool.mountPoint);
    return driver({
      dir: base,
      poolDir: path.join(pool.mountPoint, 'pool'),
      ...(socket ? { socket: path.join(base, socket) } : {}),
      extra,
    });
  };

  async function available(d: DriverProcess): Promise<number> {
    const c = await d.clients.controller.GetCapacity({ volume_capabilities: [], parameters: {} });
    expect(c.maximum_volume_size?.value).toBe(c.available_capacity);
    return Number(c.available_capacity);
  }

  it('counts sparse promises, preallocated blocks, and refuses what the pool cannot honour', async () => {
    const d = await onScratchPool();
    const start = await available(d);
    expect(start).toBeGreaterThan(400 * MiB);
    const sparse = await d.clients.controller.CreateVolume({
      name: 'cap-sparse',
      volume_capabilities: [blockCap()],
      capacity_range: { required_bytes: String(100 * MiB) },
    });
    expect(start - (await available(d))).toBeGreaterThanOrEqual(99 * MiB);
    const sparseImage = path.join(d.poolDir, 'volumes', sparse.volume?.volume_id ?? '', 'disk.img');
    expect(await diskUsage(sparseImage)).toBe(0);
    const pre = await d.clients.controller.CreateVolume({
      name: 'cap-pre',
      volume_capabilities: [blockCap()],
      capacity_range: { required_bytes: String(100 * MiB) },
      parameters: { allocation: 'preallocate' },
    });
    expect(
      await diskUsage(path.join(d.poolDir, 'volumes', pre.volume?.volume_id ?? '', 'disk.img')),
    ).toBeGreaterThanOrEqual(100 * MiB);
    const afterBoth = await available(d);
    expect(start - afterBoth).toBeGreaterThanOrEqual(199 * MiB);
    expect(start - afterBoth).toBeLessThan(230 * MiB);
    const tooBig = await errorOf(
      d.clients.controller.CreateVolume({
        name: 'cap-huge',
        volume_capabilities: [blockCap()],
        capacity_range: { required_bytes: String(afterBoth + 64 * MiB) },
      }),
    );
    expect(tooBig.code).toBe('RESOURCE_EXHAUSTED');
    expect((await fs.readdir(path.join(d.poolDir, 'volumes'))).length).toBe(2);
    await d.clients.controller.DeleteVolume({ volume_id: sparse.volume?.volume_id ?? '' });
    await d.clients.controller.DeleteVolume({ volume_id: pre.volume?.volume_id ?? '' });
    expect(Math.abs((await available(d)) - start)).toBeLessThan(8 * MiB);
    await d.stop();
  });

  it('lets --overcommit-ratio promise more, and cleans up when the disk really runs out', async () => {
    const d = await onScratchPool('over.sock', ['--overcommit-ratio=100']);
    const start = await available(d);
    const preStart = Number(
      (await d.clients.controller.GetCapacity({ parameters: { allocation: 'preallocate' } }))
        .available_capacity,
    );
    expect(start).toBeGreaterThan(90 * preStart);
    const src = await d.clients.controller.CreateVolume({
      name: 'over-src',
      volume_capabilities: [blockCap()],
      capacity_range: { required_bytes: String(1000 * MiB) },
    });
    expect(start - (await available(d))).toBeGreaterThanOrEqual(999 * MiB);
    // Fill 300 MiB of the source with data: copies of it take real space.
    const image = path.join(d.poolDir, 'volumes', src.volume?.volume_id ?? '', 'disk.img');
    const handle = await fs.open(image, 'r+');
    const chunk = Buffer.alloc(MiB, 0xa5);
    for (let i = 0; i < 300; i++) await handle.write(chunk, 0, MiB, i * MiB);
    await handle.sync();
    await handle.close();
    const clone = (name: string) =>
      d.clients.controller.CreateVolume({
        name,
        volume_capabilities: [blockCap()],
        volume_content_source: { volume: { volume_id: src.volume?.volume_id ?? '' } },
      });
    // The promise check passes (R = 100); copying 300 MiB into ~150 MiB of free space does not.
    const e = await errorOf(clone('over-clone'));
    expect(e.code).toBe('RESOURCE_EXHAUSTED');
    expect(e.details).toContain('out of space');
    expect((await fs.readdir(path.join(d.poolDir, 'volumes'))).length).toBe(1);
    expect(await fs.readdir(path.join(d.poolDir, 'trash'))).toEqual([]);
    await d.clients.controller.DeleteVolume({ volume_id: src.volume?.volume_id ?? '' });
    await d.stop();
  });

  it('admits a preallocated clone or restore against the free space, never the overcommitted budget', async () => {
    const d = await onScratchPool('prealloc-clone.sock', ['--overcommit-ratio=2']);
    const src = await d.clients.controller.CreateVolume({
      name: 'prealloc-src',
      volume_capabilities: [blockCap()],
      capacity_range: { required_bytes: String(8 * MiB) },
    });
    const srcId = src.volume?.volume_id ?? '';
    const snap = await d.clients.controller.CreateSnapshot({
      name: 'prealloc-snap',
      source_volume_id: srcId,
    });
    const preRoom = Number(
      (await d.clients.controller.GetCapacity({ parameters: { allocation: 'preallocate' } }))
        .available_capacity,
    );
    // More than the free space, less than the overcommitted budget (twice the free space).
    const bytes = preRoom + 64 * MiB;
    expect(bytes).toBeLessThan(await available(d));
    // The pool must never run full meanwhile: every other volume's writes would fail.
    let full = false;
    const stop = new AbortController();
    const watch = (async () => {
      while (!stop.signal.aborted) {
        if ((await fs.statfs(pool.mountPoint)).bavail === 0) full = true;
        await new Promise((r) => setTimeout(r, 1));
      }
    })();
    const make = (name: string, source: CreateVolumeRequest['volume_content_source']) =>
      errorOf(
        d.clients.controller.CreateVolume({
          name,
          volume_capabilities: [blockCap()],
          capacity_range: { required_bytes: String(bytes) },
          parameters: { allocation: 'preallocate' },
          volume_content_source: source,
        }),
      );
    const refused = [
      await make('prealloc-empty', null),
      await make('prealloc-clone', { volume: { volume_id: srcId } }),
      await make('prealloc-restore', { snapshot: { snapshot_id: snap.snapshot?.snapshot_id ?? '' } }),
    ];
    stop.abort();
    await watch;
    // Refused by the reservation (before a block is taken), not by fallocate running out of space.
    expect({
      refused: refused.map((e) => `${e.code}: ${/ preallocated, not enough /.test(e.details)}`),
      full,
    }).toEqual({ refused: Array(3).fill('RESOURCE_EXHAUSTED: true'), full: false });
    expect(await fs.readdir(path.join(d.poolDir, 'volumes'))).toEqual([srcId]);
    await d.clients.controller.DeleteSnapshot({ snapshot_id: snap.snapshot?.snapshot_id ?? '' });
    await d.clients.controller.DeleteVolume({ volume_id: srcId });
    await d.stop();
  });

  it("admits a ControllerModifyVolume to preallocate against the other volumes' promises, not free space alone", async () => {
    const d = await onScratchPool('prealloc-modify.sock', ['--overcommit-ratio=2']);
    // Two sparse volumes that together promise nearly twice the free space (the ratio allows it), each
    // smaller than the free space: preallocating one would take blocks the other was promised.
    const each = Math.floor((0.45 * (await available(d))) / MiB) * MiB;
    const ids: string[] = [];
    for (const name of ['modify-a', 'modify-b']) {
      const v = await d.clients.controller.CreateVolume({
        name,
        volume_capabilities: [blockCap()],
        capacity_range: { required_bytes: String(each) },
      });
      ids.push(v.volume?.volume_id ?? '');
    }
    const [a, b] = [ids[0] ?? '', ids[1] ?? ''];
    const free = (await fs.statfs(pool.mountPoint)).bavail * (await fs.statfs(pool.mountPoint)).bsize;
    const modify = () =>
      d.clients.controller.ControllerModifyVolume({
        volume_id: b,
        mutable_parameters: { allocation: 'preallocate' },
      });
    const allocation = async () =>
      (
        JSON.parse(await fs.readFile(path.join(d.poolDir, 'volumes', b, 'meta.json'), 'utf8')) as {
          allocation: string;
        }
      ).allocation;
    const refused = await errorOf(modify());
    const whileShared = await allocation();
    // Once the other volume is gone, its own promise is all it replaces: admitted.
    await d.clients.controller.DeleteVolume({ volume_id: a });
    const admitted = await codeOf(modify());
    expect({
      lessThanFree: each < free,
      refused: `${refused.code}: ${/ preallocated, not enough /.test(refused.details)}`,
      whileShared,
      admitted,
      after: await allocation(),
    }).toEqual({
      lessThanFree: true,
      refused: 'RESOURCE_EXHAUSTED: true',
      whileShared: 'sparse',
      admitted: 'OK',
      after: 'preallocate',
    });
    await d.clients.controller.DeleteVolume({ volume_id: b });
    await d.stop();
  });

  it('reports no capacity for another pool, and the filesystem minimum', async () => {
    const d = await driver({ dir: await dir('cap2') });
    const other = await d.clients.controller.GetCapacity({
      accessible_topology: { segments: { 'loopvol.csi.io/pool': 'elsewhere' } },
    });
    expect(other.available_capacity).toBe('0');
    const xfs = await d.clients.controller.GetCapacity({
      parameters: { 'csi.storage.k8s.io/fstype': 'xfs' },
    });
    expect(xfs.minimum_volume_size?.value).toBe(String(300 * MiB));
    expect(await codeOf(d.clients.controller.GetCapacity({ parameters: { bogus: '1' } }))).toBe(
      'INVALID_ARGUMENT',
    );
  });
});

describe('ControllerPublishVolume: the attach fence', () => {
  let d: DriverProcess;
  let id = '';
  beforeAll(async () => {
    const base = await dir('fence');
    d = await driver({ dir: base, extra: ['--max-volumes-per-node=3'] });
    // A second node plugin on the same pool registers node-2.
    await env.nodePlugin(base, 'node-2');
    id =
      (await d.clients.controller.CreateVolume({ name: 'pvc-fence', volume_capabilities: [mountCap()] }))
        .volume?.volume_id ?? '';
  });

  const pub = (node: string, readonly = false, cap = mountCap()) => ({
    volume_id: id,
    node_id: node,
    volume_capability: cap,
    readonly,
  });

  it('publishes to a registered node, idempotently, with a publish context', async () => {
    const r = await d.clients.controller.ControllerPublishVolume(pub('node-1'));
    expect(r.publish_context).toMatchObject({ 'loopvol.csi.io/pool': 'default' });
    await d.clients.controller.ControllerPublishVolume(pub('node-1'));
    expect(await fs.readdir(path.join(d.poolDir, 'volumes', id, 'attachments'))).toEqual(['node-1.json']);
  });

  it('refuses a second node for a single-node volume, naming the first', async () => {
    const e = await errorOf(d.clients.controller.ControllerPublishVolume(pub('node-2')));
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain('node-1');
  });

  it('refuses the same node with other arguments', async () => {
    expect(await codeOf(d.clients.controller.ControllerPublishVolume(pub('node-1', true)))).toBe(
      'ALREADY_EXISTS',
    );
  });

  it('answers NOT_FOUND for unknown nodes and volumes', async () => {
    expect(await codeOf(d.clients.controller.ControllerPublishVolume(pub('node-99')))).toBe('NOT_FOUND');
    expect(
      await codeOf(
        d.clients.controller.ControllerPublishVolume({
          ...pub('node-1'),
          volume_id: 'vol-ffffffffffffffffffffffffffffffff',
        }),
      ),
    ).toBe('NOT_FOUND');
    expect(
      await codeOf(d.clients.controller.ControllerPublishVolume({ ...pub('node-1'), node_id: '../../etc' })),
    ).toBe('NOT_FOUND');
  });

  it('refuses to delete a published volume', async () => {
    const e = await errorOf(d.clients.controller.DeleteVolume({ volume_id: id }));
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain('node-1');
  });

  it('moves to another node after unpublishing, and unpublish is idempotent', async () => {
    await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
    await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
    await d.clients.controller.ControllerPublishVolume(pub('node-2'));
    const got = await d.clients.controller.ControllerGetVolume({ volume_id: id });
    expect(got.status?.published_node_ids).toEqual(['node-2']);
    await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: '' });
    expect(
      (await d.clients.controller.ControllerGetVolume({ volume_id: id })).status?.published_node_ids,
    ).toEqual([]);
    expect(
      await codeOf(
        d.clients.controller.ControllerUnpublishVolume({
          volume_id: 'vol-ffffffffffffffffffffffffffffffff',
          node_id: 'node-1',
        }),
      ),
    ).toBe('OK');
  });

  it('shares MULTI_NODE_READER_ONLY read-only publications', async () => {
    const ro = mountCap('', 'MULTI_NODE_READER_ONLY');
    await d.clients.controller.ControllerPublishVolume(pub('node-1', true, ro));
    await d.clients.controller.ControllerPublishVolume(pub('node-2', true, ro));
    expect(
      (await d.clients.controller.ControllerGetVolume({ volume_id: id })).status?.published_node_ids,
    ).toEqual(['node-1', 'node-2']);
    expect(await codeOf(d.clients.controller.ControllerPublishVolume(pub('node-2')))).toBe('ALREADY_EXISTS');
    await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: '' });
  });

  it('enforces the node attach limit with RESOURCE_EXHAUSTED', async () => {
    const info = await d.clients.node.NodeGetInfo({});
    expect(info.max_volumes_per_node).toBe('3');
    const ids: string[] = [];
    for (let i = 0; i < 4; i++) {
      ids.push(
        (
          await d.clients.controller.CreateVolume({
            name: `pvc-limit-${i}`,
            volume_capabilities: [blockCap()],
          })
        ).volume?.volume_id ?? '',
      );
    }
    for (const v of ids.slice(0, 3))
      await d.clients.controller.ControllerPublishVolume({
        volume_id: v,
        node_id: 'node-1',
        volume_capability: blockCap(),
      });
    const e = await errorOf(
      d.clients.controller.ControllerPublishVolume({
        volume_id: ids[3] ?? '',
        node_id: 'node-1',
        volume_capability: blockCap(),
      }),
    );
    expect(e.code).toBe('RESOURCE_EXHAUSTED');
    await d.clients.controller.ControllerUnpublishVolume({ volume_id: ids[0] ?? '', node_id: 'node-1' });
    await d.clients.controller.ControllerPublishVolume({
      volume_id: ids[3] ?? '',
      node_id: 'node-1',
      volume_capability: blockCap(),
    });
    for (const v of ids) await d.clients.controller.ControllerUnpublishVolume({ volume_id: v, node_id: '' });
  });
});

describe('the node index after an upgrade', () => {
  it('a controller that starts on an index an older release left short counts every attachment', async () => {
    const base = await dir('index-repair');
    const extra = ['--max-volumes-per-node=2'];
    const first = await driver({ dir: base, extra });
    const ids: string[] = [];
    for (const name of ['pvc-ix-a', 'pvc-ix-b', 'pvc-ix-c']) {
      const v = await first.clients.controller.CreateVolume({ name, volume_capabilities: [blockCap()] });
      ids.push(v.volume?.volume_id ?? '');
    }
    const pub = (id: string) => ({ volume_id: id, node_id: 'node-1', volume_capability: blockCap() });
    for (const id of ids.slice(0, 2)) await first.clients.controller.ControllerPublishVolume(pub(id));
    await first.stop();
    // What an older release's race could leave: a live attachment missing from the node's index.
    await fs.rm(path.join(base, 'pool', 'nodes', 'node-1.attached', ids[1] ?? ''));
    const second = await driver({ dir: base, extra });
    expect(await codeOf(second.clients.controller.ControllerPublishVolume(pub(ids[2] ?? '')))).toBe(
      'RESOURCE_EXHAUSTED',
    );
    expect((await fs.readdir(path.join(base, 'pool', 'nodes', 'node-1.attached'))).sort()).toEqual(
      ids.slice(0, 2).sort(),
    );
    for (const id of ids)
      await second.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: '' });
  });
});

describe('ValidateVolumeCapabilities, ControllerGetVolume, ControllerModifyVolume', () => {
  let d: DriverProcess;
  let id = '';
  beforeAll(async () => {
    d = await driver({ dir: await dir('misc') });
    id =
      (await d.clients.controller.CreateVolume({ name: 'pvc-misc', volume_capabilities: [mountCap('xfs')] }))
        .volume?.volume_id ?? '';
  });

  it('confirms supported capabilities and explains unsupported ones', async () => {
    const ok = await d.clients.controller.ValidateVolumeCapabilities({
      volume_id: id,
      volume_capabilities: [mountCap('xfs'), blockCap()],
    });
    expect(ok.confirmed?.volume_capabilities).toHaveLength(2);
    const wrongFs = await d.clients.controller.ValidateVolumeCapabilities({
      volume_id: id,
      volume_capabilities: [mountCap('ext4')],
    });
    expect(wrongFs.confirmed).toBeNull();
    expect(wrongFs.message).toContain('xfs');
    const multi = await d.clients.controller.ValidateVolumeCapabilities({
      volume_id: id,
      volume_capabilities: [mountCap('', 'MULTI_NODE_MULTI_WRITER')],
    });
    expect(multi.confirmed).toBeNull();
    expect(
      await codeOf(
        d.clients.controller.ValidateVolumeCapabilities({
          volume_id: 'vol-ffffffffffffffffffffffffffffffff',
          volume_capabilities: [blockCap()],
        }),
      ),
    ).toBe('NOT_FOUND');
    expect(await codeOf(d.clients.controller.ValidateVolumeCapabilities({ volume_id: id }))).toBe(
      'INVALID_ARGUMENT',
    );
  });

  it('reports an abnormal condition when the image is gone', async () => {
    const healthy = await d.clients.controller.ControllerGetVolume({ volume_id: id });
    expect(healthy.status?.volume_condition?.abnormal).toBe(false);
    const image = path.join(d.poolDir, 'volumes', id, 'disk.img');
    await fs.rename(image, `${image}.away`);
    const sick = await d.clients.controller.ControllerGetVolume({ volume_id: id });
    expect(sick.status?.volume_condition).toMatchObject({ abnormal: true });
    expect(sick.status?.volume_condition?.message).toContain('missing');
    await fs.rename(`${image}.away`, image);
  });

  it('preallocates an existing sparse volume on request', async () => {
    const image = path.join(d.poolDir, 'volumes', id, 'disk.img');
    expect(await diskUsage(image)).toBe(0);
    await d.clients.controller.ControllerModifyVolume({
      volume_id: id,
      mutable_parameters: { allocation: 'preallocate' },
    });
    expect(await diskUsage(image)).toBeGreaterThanOrEqual(300 * MiB);
    expect(
      await codeOf(
        d.clients.controller.ControllerModifyVolume({
          volume_id: id,
          mutable_parameters: { XXX_FakeKey: 'x' },
        }),
      ),
    ).toBe('INVALID_ARGUMENT');
    expect(
      await codeOf(
        d.clients.controller.ControllerModifyVolume({ volume_id: 'nope', mutable_parameters: {} }),
      ),
    ).toBe('NOT_FOUND');
  });

  it('leaves nothing on the host', async () => {
    expect(await leaksUnder(path.dirname(d.poolDir))).toEqual({ loops: [], mounts: [] });
  });
});
