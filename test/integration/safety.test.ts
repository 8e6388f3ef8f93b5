/**
 * Data safety under real conditions (root only, real loop devices and mounts): a node plugin replaced
 * by one whose view of the pool differs, hostile node paths, records that cannot be read, callers that
 * give up half-way, images that carry signatures the pool's block counts hide, btrfs growth from its
 * smallest size, and two nodes formatting a fresh volume at once. Each test fails on the driver as it
 * was before these fixes.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import {
  isRoot,
  leaksUnder,
  MiB,
  mountSource,
  ownMountNamespace,
  RUN,
  sha256,
  SLOW,
  writeRandom,
} from '../helpers/host.js';
import { createVolume, publish, publishTo, stage } from '../helpers/volumes.js';

const env = new TestEnv();
/** Names unique to this run: a device another run left behind never matches one of ours. */
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const sh = (cmd: string, args: string[]): string => execFileSync(cmd, args, { encoding: 'utf8' });

async function mountPoints(): Promise<string[]> {
  return (await fs.readFile('/proc/self/mountinfo', 'utf8')).split('\n').map((l) => l.split(' ')[4] ?? '');
}

const exists = (p: string): Promise<boolean> =>
  fs.lstat(p).then(
    () => true,
    () => false,
  );

describe.skipIf(!isRoot())('a node plugin replaced by one that sees the pool at another path', () => {
  it('tears down what its predecessor staged and published, and only then lets the volume go', async () => {
    const base = await env.dir('ns');
    // The kubelet directory propagates mounts both ways, as in a cluster (Bidirectional).
    sh('mount', ['--bind', base, base]);
    sh('mount', ['--make-shared', base]);
    env.declareOwn(base);
    const view = await env.dir('view'); // private: the predecessor's own view of the pool
    const ctl = await env.driver({ dir: base, mode: 'controller', socket: path.join(base, 'ctl.sock') });
    const alt = path.join(view, 'volumes-root');
    await fs.mkdir(alt);
    const old = await env.driver({
      dir: base,
      mode: 'node',
      socket: path.join(base, 'old.sock'),
      poolDir: alt,
      wrap: [
        ...ownMountNamespace(base, 'unchanged'),
        'sh',
        '-c',
        'mount --bind "$1" "$2" && shift 2 && exec "$@"',
        'sh',
        ctl.poolDir,
        alt,
      ],
    });
    const cap = mountCap('ext4');
    const { id, image } = await createVolume(ctl, `pvc-replaced-${RUN}`, cap, 64 * MiB);
    const staging = path.join(base, 'kubelet', 'staging', id);
    const target = path.join(base, 'kubelet', 'pods', 'p1', 'mount');
    await stage(old, id, staging, cap);
    await publish(old, id, staging, target, cap);
    // Propagated to the host, as to a kubelet.
    expect(await mountPoints()).toContain(target);
    const sum = await writeRandom(path.join(target, 'data.bin'), 4, 3);

    await old.stop('SIGKILL'); // the container is replaced: its mount namespace goes with it
    const loops = (await leaksUnder(path.dirname(image))).loops;
    const device = (
      sh('losetup', ['--list', '--noheadings', '--output', 'NAME,BACK-FILE'])
        .split('\n')
        .find((l) => l.includes(`/${id}/disk.img`)) ?? ''
    ).trim();
    expect(device).not.toBe('');
    // sysfs now names the image by a path this host does not have: the scenario is real. Only the
    // backing file's device and inode tie the loop device to the image.
    expect(device).not.toContain(ctl.poolDir);
    expect(loops.map((l) => l.split(' ')[1])).toEqual([image]);

    const fresh = await env.driver({ dir: base, mode: 'node', socket: path.join(base, 'new.sock') });
    // The volume's data is whole: stats read through the new plugin's look at the host.
    const stats = await fresh.clients.node.NodeGetVolumeStats({ volume_id: id, volume_path: target });
    expect(stats.volume_condition?.abnormal).toBe(false);
    expect(await sha256(path.join(target, 'data.bin'))).toBe(sum);
    expect(await codeOf(ctl.clients.controller.DeleteVolume({ volume_id: id }))).toBe('FAILED_PRECONDITION');
    await fresh.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    expect(await mountPoints()).not.toContain(target);
    await fresh.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    expect(await mountPoints()).not.toContain(staging);
    const still = sh('losetup', ['--list', '--noheadings', '--output', 'BACK-FILE']);
    expect(still).not.toContain(`/${id}/disk.img`);
    await ctl.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
    await ctl.clients.controller.DeleteVolume({ volume_id: id });
    expect(await exists(image)).toBe(false);
  });

  it('refuses to delete an image attached on this host even when no record says so', async () => {
    const base = await env.dir('attached');
    const d = await env.driver({ dir: base });
    const cap = blockCap();
    const { id, image } = await createVolume(d, `pvc-attached-${RUN}`, cap, 16 * MiB);
    const staging = path.join(base, 'staging');
    await stage(d, id, staging, cap);
    // The records are lost (an operator, a bug): only the host still knows.
    await fs.rm(path.join(d.poolDir, 'volumes', id, 'leases'), { recursive: true });
    await fs.rm(path.join(d.poolDir, 'volumes', id, 'attachments'), { recursive: true });
    await fs.rm(path.join(d.poolDir, 'volumes', id, 'fences.json'));
    const e = await errorOf(d.clients.controller.DeleteVolume({ volume_id: id }));
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toMatch(/in use on this host .*\/dev\/loop\d+/);
    expect(await exists(image)).toBe(true);
    await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    await d.clients.controller.DeleteVolume({ volume_id: id });
    expect(await exists(image)).toBe(false);
  });
});

describe.skipIf(!isRoot())('node paths a caller must not be able to use', () => {
  let d: DriverProcess;
  let base: string;
  let id = '';
  let image = '';
  let staging = '';
  const cap = mountCap('ext4');
  /** Each bad path, what sits there, and how to tell that it is untouched. */
  const cases: { name: string; path: () => string; code: string }[] = [];
  let outside = '';

  beforeAll(async () => {
    base = await env.dir('paths');
    d = await env.driver({ dir: base });
    ({ id, image } = await createVolume(d, `pvc-paths-${RUN}`, cap, 32 * MiB));
    staging = path.join(base, 'staging');
    await stage(d, id, staging, cap);
    outside = path.join(base, 'elsewhere');
    await fs.mkdir(path.join(outside, 'full-dir'), { recursive: true });
    await fs.writeFile(path.join(outside, 'full-dir', 'keep'), 'mine');
    await fs.writeFile(path.join(outside, 'file'), 'data that is not the driver’s');
    await fs.symlink(path.join(outside, 'file'), path.join(outside, 'link-to-file'));
    await fs.symlink(image, path.join(outside, 'link-to-image'));
    cases.push(
      { name: 'the pool image', path: () => image, code: 'INVALID_ARGUMENT' },
      { name: 'the volume directory in the pool', path: () => path.dirname(image), code: 'INVALID_ARGUMENT' },
      { name: 'the pool itself', path: () => d.poolDir, code: 'INVALID_ARGUMENT' },
      {
        name: 'a symlink to the pool image',
        path: () => path.join(outside, 'link-to-image'),
        code: 'INVALID_ARGUMENT',
      },
      { name: 'the root', path: () => '/', code: 'INVALID_ARGUMENT' },
      { name: 'a non-empty file', path: () => path.join(outside, 'file'), code: 'FAILED_PRECONDITION' },
      {
        name: 'a symlink to a file',
        path: () => path.join(outside, 'link-to-file'),
        code: 'FAILED_PRECONDITION',
      },
      {
        name: 'a directory with files',
        path: () => path.join(outside, 'full-dir'),
        code: 'FAILED_PRECONDITION',
      },
    );
  });

  /** A fingerprint of everything a bad path could damage. */
  async function state(): Promise<string> {
    return JSON.stringify([
      await sha256(image),
      await fs.readFile(path.join(outside, 'file'), 'utf8'),
      await fs.readlink(path.join(outside, 'link-to-file')),
      await fs.readlink(path.join(outside, 'link-to-image')),
      await fs.readdir(path.join(outside, 'full-dir')),
      await fs.readdir(path.dirname(image)),
    ]);
  }

  it.each([0, 1, 2, 3, 4, 5, 6, 7])(
    'NodeUnpublishVolume and NodeUnstageVolume remove nothing at bad path #%i',
    async (i) => {
      const c = cases[i];
      if (!c) throw new Error('no case');
      const before = await state();
      expect([
        c.name,
        await codeOf(d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: c.path() })),
      ]).toEqual([c.name, c.code]);
      if (c.path() !== '/' && !c.path().startsWith(outside)) {
        expect(
          await codeOf(d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: c.path() })),
        ).toBe(c.code);
      }
      expect(await state()).toBe(before);
    },
  );

  it('refuses pool paths in stage, publish, stats and expand too', async () => {
    const before = await state();
    expect(await codeOf(stage(d, id, path.dirname(image), cap))).toBe('INVALID_ARGUMENT');
    expect(
      await codeOf(
        d.clients.node.NodePublishVolume({
          volume_id: id,
          staging_target_path: staging,
          target_path: image,
          volume_capability: cap,
        }),
      ),
    ).toBe('INVALID_ARGUMENT');
    expect(await codeOf(d.clients.node.NodeGetVolumeStats({ volume_id: id, volume_path: image }))).toBe(
      'INVALID_ARGUMENT',
    );
    expect(await codeOf(d.clients.node.NodeExpandVolume({ volume_id: id, volume_path: d.poolDir }))).toBe(
      'INVALID_ARGUMENT',
    );
    expect(await state()).toBe(before);
    await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
  });
});

describe.skipIf(!isRoot())('records that cannot be read', () => {
  let d: DriverProcess;
  let base: string;
  const quarantine = (): string => path.join(d.poolDir, 'quarantine');

  beforeAll(async () => {
    base = await env.dir('quarantine');
    d = await env.driver({ dir: base });
  });

  it('quarantines a volume whose meta.json does not parse instead of discarding it on a retry', async () => {
    const cap = mountCap('ext4');
    const { id } = await createVolume(d, `pvc-torn-${RUN}`, cap, 16 * MiB, null);
    const dir = path.join(d.poolDir, 'volumes', id);
    await writeRandom(path.join(dir, 'disk.img'), 4, 9);
    const sum = await sha256(path.join(dir, 'disk.img'));
    await fs.writeFile(path.join(dir, 'meta.json'), '{"format": 1, "id": "vol-');
    // The CO retries the create (or a second provisioner does): the data must not go.
    const e = await errorOf(
      d.clients.controller.CreateVolume({
        name: `pvc-torn-${RUN}`,
        capacity_range: { required_bytes: String(16 * MiB) },
        volume_capabilities: [cap],
      }),
    );
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain(quarantine());
    expect(await exists(dir)).toBe(false);
    const [entry] = await fs.readdir(quarantine());
    const kept = path.join(quarantine(), entry ?? '');
    expect(await sha256(path.join(kept, 'disk.img'))).toBe(sum);
    const note = JSON.parse(await fs.readFile(path.join(kept, 'QUARANTINE.json'), 'utf8')) as Record<
      string,
      string
    >;
    expect(note.from).toBe(dir);
    expect(note.why).toContain('meta.json');
    // It stays refused (no empty volume under the same name) until an operator decides.
    expect(
      await codeOf(
        d.clients.controller.CreateVolume({
          name: `pvc-torn-${RUN}`,
          capacity_range: { required_bytes: String(16 * MiB) },
          volume_capabilities: [cap],
        }),
      ),
    ).toBe('FAILED_PRECONDITION');
    expect(await exists(dir)).toBe(false);
  });

  it('quarantines on delete, an image without a record, and a snapshot whose record is damaged', async () => {
    const cap = mountCap('ext4');
    const mk = async (name: string) => (await createVolume(d, name, cap, 8 * MiB, null)).id;
    const a = await mk(`pvc-del-damaged-${RUN}`);
    await fs.writeFile(path.join(d.poolDir, 'volumes', a, 'meta.json'), 'not json');
    const e = await errorOf(d.clients.controller.DeleteVolume({ volume_id: a }));
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain(quarantine());
    await d.clients.controller.DeleteVolume({ volume_id: a }); // gone from the pool now: OK

    const b = await mk(`pvc-no-record-${RUN}`);
    await fs.rm(path.join(d.poolDir, 'volumes', b, 'meta.json'));
    expect(await codeOf(d.clients.controller.DeleteVolume({ volume_id: b }))).toBe('FAILED_PRECONDITION');

    const c = await mk(`pvc-snap-src-${RUN}`);
    const snap =
      (await d.clients.controller.CreateSnapshot({ name: `snap-damaged-${RUN}`, source_volume_id: c }))
        .snapshot?.snapshot_id ?? '';
    await fs.writeFile(path.join(d.poolDir, 'snapshots', snap, 'meta.json'), '[]');
    expect(
      await codeOf(d.clients.controller.CreateSnapshot({ name: `snap-damaged-${RUN}`, source_volume_id: c })),
    ).toBe('FAILED_PRECONDITION');
    expect(await exists(path.join(d.poolDir, 'snapshots', snap))).toBe(false);

    const entries = await fs.readdir(quarantine());
    expect(entries.filter((x) => x.startsWith(a))).toHaveLength(1);
    expect(entries.filter((x) => x.startsWith(b))).toHaveLength(1);
    expect(entries.filter((x) => x.startsWith(snap))).toHaveLength(1);
    for (const x of entries) expect(await exists(path.join(quarantine(), x, 'QUARANTINE.json'))).toBe(true);
  });

  it('treats a lease it cannot read as held: the volume is not deleted', async () => {
    const cap = blockCap();
    const { id, image } = await createVolume(d, `pvc-lease-damaged-${RUN}`, cap, 8 * MiB);
    await d.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' });
    await fs.mkdir(path.join(d.poolDir, 'volumes', id, 'leases'), { recursive: true });
    await fs.writeFile(path.join(d.poolDir, 'volumes', id, 'leases', 'node-9.json'), '{');
    const e = await errorOf(d.clients.controller.DeleteVolume({ volume_id: id }));
    expect(e.code).toBe('FAILED_PRECONDITION');
    expect(e.details).toContain('node-9');
    expect(await exists(image)).toBe(true);
  });

  it('counts quarantined records in a metric and lists them at start', async () => {
    const n = (await fs.readdir(quarantine())).length;
    expect(n).toBeGreaterThanOrEqual(4);
    // Controllers: a second node plugin of node-1 beside `d` would not start.
    const again = await env.driver({ dir: base, socket: path.join(base, 'again.sock'), mode: 'controller' });
    expect(await again.waitForLog((l) => l.includes('quarantined records') && l.includes(quarantine()))).toBe(
      true,
    );
    const metrics = await env.driver({
      dir: base,
      socket: path.join(base, 'metrics.sock'),
      mode: 'controller',
      extra: ['--metrics-address=127.0.0.1:19791'],
    });
    const text = await (await fetch('http://127.0.0.1:19791/metrics')).text();
    expect(text).toContain(`loopvol_quarantined_records ${n}`);
    await metrics.stop();
  });
});

describe.skipIf(!isRoot())('a caller that gives up half-way', () => {
  /** Where the call waits, and the call that waits there. */
  const steps = [
    ['stage:attached', 'stage'],
    ['stage:formatted', 'stage'],
    ['stage:mounted', 'stage'],
    ['publish:prepared', 'publish'],
    ['publish:mounted', 'publish'],
  ] as const;

  it.each(steps)('leaves nothing attached or mounted when its deadline passes at %s', async (point, call) => {
    const base = await env.dir('cancel');
    const d = await env.driver({ dir: base, env: { LOOPVOL_PAUSEPOINT: `${point}:1500` } });
    const cap = mountCap('ext4');
    const { id, image } = await createVolume(d, `pvc-${point.replace(':', '-')}-${RUN}`, cap, 32 * MiB);
    const staging = path.join(base, 'staging');
    const target = path.join(base, 'pod', 'mount');
    await fs.mkdir(staging, { recursive: true });
    await fs.mkdir(path.dirname(target), { recursive: true });
    if (call === 'publish') await stage(d, id, staging, cap);
    const req =
      call === 'stage'
        ? d.clients.node.NodeStageVolume(
            { volume_id: id, staging_target_path: staging, volume_capability: cap },
            { timeoutMs: 700 },
          )
        : d.clients.node.NodePublishVolume(
            { volume_id: id, staging_target_path: staging, target_path: target, volume_capability: cap },
            { timeoutMs: 700 },
          );
    expect(await codeOf(req)).toBe('DEADLINE_EXCEEDED');
    // The driver finishes its side of the call (pause, then the undo) on its own.
    expect(
      await d.waitForLog(
        (l) =>
          l.includes(call === 'stage' ? '"method":"NodeStageVolume"' : '"method":"NodePublishVolume"') &&
          /"code":"(DEADLINE_EXCEEDED|CANCELLED)"/.test(l),
      ),
    ).toBe(true);
    if (call === 'stage') {
      expect((await leaksUnder(base)).mounts).toEqual([]);
      expect((await leaksUnder(path.dirname(image))).loops).toEqual([]);
      expect(await fs.readdir(path.join(d.poolDir, 'volumes', id, 'leases')).catch(() => [])).toEqual([]);
    } else {
      expect((await leaksUnder(base)).mounts).toEqual([staging]); // the staging's own
      expect(await mountPoints()).not.toContain(target);
      expect(await exists(target)).toBe(false);
      expect((await leaksUnder(path.dirname(image))).loops).toHaveLength(1); // the staging's own
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    }
  });
});

describe.skipIf(!isRoot())('a preallocated restore that outlasts its caller', () => {
  it('is finished and kept once its copy is done, so the retry gets it (it was thrown away after every copy)', async () => {
    const base = await env.dir('prealloc-late');
    // The pause stands for a copy longer than the caller's deadline (the provisioner's is 10 s).
    const d = await env.driver({
      dir: base,
      env: { LOOPVOL_PAUSEPOINT: `create-volume:filled:${1500 * SLOW}` },
    });
    const cap = blockCap();
    const src = await createVolume(d, `late-src-${RUN}`, cap, 16 * MiB, null);
    const snap = await d.clients.controller.CreateSnapshot({
      name: `late-snap-${RUN}`,
      source_volume_id: src.id,
    });
    const restore = () =>
      codeOf(
        d.clients.controller.CreateVolume(
          {
            name: `late-restore-${RUN}`,
            parameters: { allocation: 'preallocate' },
            capacity_range: { required_bytes: String(16 * MiB) },
            volume_capabilities: [cap],
            volume_content_source: { snapshot: { snapshot_id: snap.snapshot?.snapshot_id } },
          },
          { timeoutMs: 700 * SLOW },
        ),
      );
    const first = await restore();
    // Retried as the provisioner does, with the same deadline, until an answer that is not "busy".
    const retries: string[] = [];
    for (let i = 0; i < 20; i++) {
      await new Promise((r) => setTimeout(r, 300 * SLOW));
      retries.push(await restore());
      if (retries.at(-1) !== 'ABORTED') break;
    }
    expect({ first, last: retries.at(-1) }).toEqual({ first: 'DEADLINE_EXCEEDED', last: 'OK' });
  });
});

describe.skipIf(!isRoot())('a staging mount that goes away under a published volume', () => {
  /** The source device of the mount at `mp` (the last one stacked there). */
  const sourceAt = async (mp: string): Promise<string | undefined> =>
    (await fs.readFile('/proc/self/mountinfo', 'utf8'))
      .split('\n')
      .filter((l) => l.split(' ')[4] === mp)
      .map((l) => l.split(' - ')[1]?.split(' ')[1])
      .at(-1);

  it.each(['ext4', 'xfs'] as const)(
    'is staged again from the device the pod still has mounted, never a second device (%s)',
    async (fsType) => {
      const base = await env.dir(`restage-${fsType}`);
      const d = await env.driver({ dir: base });
      const cap = mountCap(fsType);
      const { id, image } = await createVolume(d, `pvc-restage-${fsType}-${RUN}`, cap, 320 * MiB);
      const staging = path.join(base, 'staging');
      const target = path.join(base, 'pod', 'mount');
      await stage(d, id, staging, cap);
      await publish(d, id, staging, target, cap);
      const device = await sourceAt(target);
      await fs.writeFile(path.join(target, 'before'), 'written through the pod');
      sh('umount', [staging]); // the staging mount, made by this test's driver, goes away
      await stage(d, id, staging, cap); // the kubelet stages again
      // One device of the image, mounted at both places: one filesystem, not two.
      expect((await leaksUnder(path.dirname(image))).loops).toHaveLength(1);
      expect(await sourceAt(staging)).toBe(device);
      await fs.writeFile(path.join(target, 'after'), 'also written through the pod');
      expect(await fs.readFile(path.join(staging, 'before'), 'utf8')).toBe('written through the pod');
      expect(await fs.readFile(path.join(staging, 'after'), 'utf8')).toBe('also written through the pod');
      await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
      expect(await leaksUnder(base)).toMatchObject({ mounts: [], loops: [] });
    },
  );
});

describe.skipIf(!isRoot())('a device that carries a signature, on a pool that hides its blocks', () => {
  let d: DriverProcess;
  let base: string;
  const signatures = ['ext4', 'xfs', 'btrfs', 'dos'] as const;
  const requests = ['ext4', 'xfs', 'btrfs', ''] as const;

  beforeAll(async () => {
    base = await env.dir('sigs');
    d = await env.driver({ dir: base });
  });

  /** Writes a signature straight into the image, as a file that held data before would carry it. */
  async function sign(image: string, sig: (typeof signatures)[number]): Promise<void> {
    if (sig === 'ext4') sh('mkfs.ext4', ['-q', '-F', image]);
    else if (sig === 'xfs') sh('mkfs.xfs', ['-q', '-f', image]);
    else if (sig === 'btrfs') sh('mkfs.btrfs', ['-q', '-f', image]);
    else {
      // An MBR with one Linux partition.
      const mbr = Buffer.alloc(512);
      mbr.set([0, 0, 0, 0, 0x83, 0, 0, 0], 446);
      mbr.writeUInt32LE(2048, 454);
      mbr.writeUInt32LE(16384, 458);
      mbr[510] = 0x55;
      mbr[511] = 0xaa;
      await fs.writeFile(image, mbr, { flag: 'r+' });
    }
  }

  it.each(signatures.flatMap((sig) => requests.map((req) => [sig, req] as const)))(
    'never formats an image carrying %s when %j is asked for',
    async (sig, req) => {
      const cap = mountCap(req);
      const { id, image } = await createVolume(d, `pvc-sig-${sig}-${req || 'none'}-${RUN}`, cap, 320 * MiB);
      await sign(image, sig);
      const uuid = (): string => sh('blkid', ['-p', '-o', 'export', image]);
      const before = uuid();
      const staging = path.join(base, `st-${sig}-${req || 'none'}`);
      const keep = sig !== 'dos' && (req === sig || req === '');
      const code = await codeOf(stage(d, id, staging, cap));
      expect([sig, req, code]).toEqual([sig, req, keep ? 'OK' : 'FAILED_PRECONDITION']);
      if (keep) {
        const top = (await fs.readFile('/proc/self/mountinfo', 'utf8'))
          .split('\n')
          .find((l) => l.split(' ')[4] === staging);
        expect(top?.split(' - ')[1]?.split(' ')[0]).toBe(sig);
        await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
      }
      // The same filesystem (or partition table) as before: UUIDs and types unchanged.
      const pick = (s: string) =>
        s
          .split('\n')
          .filter((l) => /^(UUID|TYPE|PTTYPE|PTUUID)=/.test(l))
          .sort()
          .join(',');
      expect(pick(uuid())).toBe(pick(before));
      expect((await leaksUnder(path.dirname(image))).loops).toEqual([]);
    },
  );
});

describe.skipIf(!isRoot())('btrfs at its smallest size', () => {
  it('is made big enough to grow, and grows online', async () => {
    const base = await env.dir('btrfs-min');
    const d = await env.driver({ dir: base });
    const cap = mountCap('btrfs');
    const res = await d.clients.controller.CreateVolume({
      name: `pvc-btrfs-min-${RUN}`,
      capacity_range: { required_bytes: '1' },
      volume_capabilities: [cap],
    });
    const id = res.volume?.volume_id ?? '';
    expect(Number(res.volume?.capacity_bytes)).toBe(256 * MiB);
    await d.clients.controller.ControllerPublishVolume({
      volume_id: id,
      node_id: 'node-1',
      volume_capability: cap,
    });
    const staging = path.join(base, 'staging');
    const target = path.join(base, 'pod', 'mount');
    await stage(d, id, staging, cap);
    await publish(d, id, staging, target, cap);
    const sum = await writeRandom(path.join(target, 'data.bin'), 8, 4);
    const before = (await fs.statfs(target)).blocks * (await fs.statfs(target)).bsize;
    const grown = await d.clients.controller.ControllerExpandVolume({
      volume_id: id,
      capacity_range: { required_bytes: String(320 * MiB) },
    });
    expect(grown.node_expansion_required).toBe(true);
    await d.clients.node.NodeExpandVolume({
      volume_id: id,
      volume_path: target,
      capacity_range: { required_bytes: String(320 * MiB) },
    });
    const after = (await fs.statfs(target)).blocks * (await fs.statfs(target)).bsize;
    expect(after - before).toBeGreaterThan(48 * MiB);
    expect(await sha256(path.join(target, 'data.bin'))).toBe(sum);
    await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
  });
});

describe.skipIf(!isRoot())('two nodes staging a fresh multi-reader volume at the same moment', () => {
  it('formats it once: both mount one filesystem, in every round', async () => {
    const base = await env.dir('race');
    const d = await env.driver({ dir: base });
    const a = await env.nodePlugin(base, 'node-a');
    const b = await env.nodePlugin(base, 'node-b');
    const cap = mountCap('ext4', 'MULTI_NODE_READER_ONLY');
    for (let round = 0; round < 6; round++) {
      const { id } = await createVolume(d, `pvc-race-${round}-${RUN}`, cap, 64 * MiB, null);
      await publishTo(d, id, ['node-a', 'node-b'], cap, true);
      const sa = path.join(base, `a-${round}`);
      const sb = path.join(base, `b-${round}`);
      await Promise.all([stage(a, id, sa, cap), stage(b, id, sb, cap)]);
      const [da, db] = [await mountSource(sa), await mountSource(sb)];
      expect(da).toMatch(/^\/dev\/loop\d+$/);
      expect(db).toMatch(/^\/dev\/loop\d+$/);
      const uuidOf = (dev: string) => sh('blkid', ['-p', '-s', 'UUID', '-o', 'value', dev]).trim();
      expect(uuidOf(da)).toBe(uuidOf(db));
      const formats = [...a.logs(), ...b.logs()].filter(
        (l) => l.includes('formatted a blank volume') && l.includes(id),
      );
      expect(formats.length).toBeLessThanOrEqual(1);
      await a.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sa });
      await b.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: sb });
    }
    const all = [...a.logs(), ...b.logs()].filter((l) => l.includes('formatted a blank volume'));
    expect(all).toHaveLength(6);
  });
});
