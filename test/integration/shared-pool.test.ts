/**
 * A pool on a network filesystem shared by several hosts (root only). The kernel here has no NFS
 * client, so each simulated host gets its own sshfs mount of one export (test/helpers/sshfs.ts), with
 * the client caches off, as NFS gives close-to-open consistency. Covered: Probe on a pool whose server
 * hangs, a volume moving from one node plugin to another with its data, the lease fence between
 * them, and a snapshot of a volume in use, frozen on its node by a request through the pool.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import { READINESS_TIMEOUT_MS } from '../../src/health.js';
import type { DriverProcess } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { isRoot, MiB, RUN, SLOW, sha256, writeRandom } from '../helpers/host.js';
import { type SshServer, type SshfsMount, sshfsUnavailable, startSshServer } from '../helpers/sshfs.js';

const env = new TestEnv();
let ssh: SshServer | undefined;
const skip = !isRoot() || sshfsUnavailable() !== undefined;

afterAll(async () => {
  // First: a process blocked on a stopped server cannot even be killed.
  ssh?.resumeAll();
  const leaks = await env.teardown();
  const sshLeaks = ssh ? await ssh.stop() : [];
  expect([...leaks, ...sshLeaks]).toEqual([]);
});

/** A dir under `base` holding an export and the given sshfs mounts of it (declared the file's own). */
async function shared(
  tag: string,
  hosts: string[],
  cache: 'off' | 'sshfs-defaults' = 'off',
): Promise<{ base: string; mounts: SshfsMount[] }> {
  if (!ssh) throw new Error('no sshd');
  const base = await env.dir(tag);
  const exportDir = path.join(base, 'export');
  await fs.mkdir(exportDir);
  const mounts: SshfsMount[] = [];
  for (const h of hosts) {
    const mp = path.join(base, `pool-${h}`);
    mounts.push(await ssh.mountExport(exportDir, mp, { cache }));
    env.declareOwn(mp);
  }
  return { base, mounts };
}

function nodePlugin(base: string, m: SshfsMount, nodeId: string): Promise<DriverProcess> {
  return env.driver({
    dir: base,
    poolDir: m.mountPoint,
    socket: path.join(base, `${nodeId}.sock`),
    nodeId,
    mode: 'node',
  });
}

/** Whether Probe says ready within `ms`, asked every 200 ms. */
async function readyWithin(d: DriverProcess, ms: number): Promise<boolean> {
  for (const deadline = Date.now() + ms; Date.now() < deadline;) {
    const ready = await d.clients.identity.Probe({}, { timeoutMs: 3000 }).then(
      (r) => r.ready?.value === true,
      () => false,
    );
    if (ready) return true;
    await new Promise((r) => setTimeout(r, 200));
  }
  return false;
}

/** The paths a kubelet on one node uses for one volume, and its stage/publish calls. */
class OnNode {
  constructor(
    readonly d: DriverProcess,
    readonly id: string,
    readonly cap: VolumeCapability,
    readonly base: string,
  ) {}
  get staging(): string {
    return path.join(this.base, 'staging', this.id);
  }
  get target(): string {
    return path.join(this.base, 'pods', this.id, 'mount');
  }
  async stage() {
    await fs.mkdir(this.staging, { recursive: true });
    return this.d.clients.node.NodeStageVolume({
      volume_id: this.id,
      staging_target_path: this.staging,
      volume_capability: this.cap,
    });
  }
  async publish() {
    await fs.mkdir(path.dirname(this.target), { recursive: true });
    return this.d.clients.node.NodePublishVolume({
      volume_id: this.id,
      staging_target_path: this.staging,
      target_path: this.target,
      volume_capability: this.cap,
    });
  }
  async up(): Promise<void> {
    await this.stage();
    await this.publish();
  }
  async down(): Promise<void> {
    await this.d.clients.node.NodeUnpublishVolume({ volume_id: this.id, target_path: this.target });
    await this.d.clients.node.NodeUnstageVolume({ volume_id: this.id, staging_target_path: this.staging });
  }
}

describe.skipIf(skip)('a pool on a network filesystem (sshfs)', () => {
  beforeAll(async () => {
    ssh = await startSshServer();
  });

  it("shows one client's changes to another at once (the mount options the tests rely on)", async () => {
    const {
      mounts: [a, b],
    } = await shared('fresh', ['a', 'b']);
    if (!a || !b) throw new Error('no mounts');
    const fa = (n: string): string => path.join(a.mountPoint, n);
    const fb = (n: string): string => path.join(b.mountPoint, n);
    await fs.mkdir(fa('dir'));
    expect(await fs.readdir(fb('dir'))).toEqual([]);
    await expect(fs.stat(fb('dir/new.json'))).rejects.toThrow(/ENOENT/);
    await fs.writeFile(fa('dir/new.json'), '{"v":1}');
    expect(await fs.readdir(fb('dir'))).toEqual(['new.json']);
    expect(await fs.readFile(fb('dir/new.json'), 'utf8')).toBe('{"v":1}');
    // Replaced by a rename, as the driver writes its records: the next open reads the new content.
    await fs.writeFile(fa('dir/.tmp'), '{"v":2,"longer":true}');
    await fs.rename(fa('dir/.tmp'), fa('dir/new.json'));
    expect(await fs.readFile(fb('dir/new.json'), 'utf8')).toBe('{"v":2,"longer":true}');
    await fs.unlink(fa('dir/new.json'));
    await expect(fs.stat(fb('dir/new.json'))).rejects.toThrow(/ENOENT/);
    expect(await fs.readdir(fb('dir'))).toEqual([]);
    // link(2), which the pool's locks are made with, works and refuses an existing name.
    await fs.writeFile(fb('dir/t'), 'x');
    await fs.link(fb('dir/t'), fb('dir/l'));
    expect(await fs.readFile(fa('dir/l'), 'utf8')).toBe('x');
    await expect(fs.link(fa('dir/t'), fa('dir/l'))).rejects.toThrow(/EEXIST/);
    for (const m of [a, b]) await m.unmount();
  });

  it('answers Probe within its deadline while the pool does not answer, and is ready once it does', async () => {
    const {
      base,
      mounts: [m],
    } = await shared('hung', ['node']);
    if (!m) throw new Error('no mount');
    const d = await nodePlugin(base, m, 'node-hung');
    expect((await d.clients.identity.Probe({}, { timeoutMs: 3000 })).ready?.value).toBe(true);
    m.hang();
    try {
      // A readiness answer is reused for 1 s: let the one from before the hang age out.
      await new Promise((r) => setTimeout(r, 1100));
      // Calls that touch the pool block a thread each (more of them than libuv's default 4).
      const stuck = Array.from({ length: 6 }, () =>
        codeOf(d.clients.node.NodeGetInfo({}, { timeoutMs: 1000 })),
      );
      for (let i = 0; i < 2; i++) {
        const started = performance.now();
        // Answered once its own readiness timeout is over, not when the pool answers (never): the margin
        // is for a loaded machine's late timers.
        const e = await errorOf(d.clients.identity.Probe({}, { timeoutMs: 30_000 }));
        const took = performance.now() - started;
        expect(e.code).toBe('FAILED_PRECONDITION');
        expect(e.details).toMatch(/pool .* does not answer/);
        expect(took).toBeLessThan(READINESS_TIMEOUT_MS + 3000 * SLOW);
        const info = await d.clients.identity.GetPluginInfo({}, { timeoutMs: 1000 });
        expect(info.name).toBeTruthy();
      }
      expect(await Promise.all(stuck)).toEqual(Array(6).fill('DEADLINE_EXCEEDED'));
    } finally {
      m.resume();
    }
    expect(await readyWithin(d, 15_000)).toBe(true);
    expect((await d.clients.node.NodeGetInfo({}, { timeoutMs: 5000 })).node_id).toBe('node-hung');
    await d.stop();
    await m.unmount();
  });

  it('starts and answers Probe while its pool does not answer, and serves it once it does', async () => {
    const {
      base,
      mounts: [m],
    } = await shared('hung-start', ['node']);
    if (!m) throw new Error('no mount');
    await (await nodePlugin(base, m, 'node-hs')).stop(); // the pool exists; its server then hangs
    m.hang();
    let d: DriverProcess | undefined;
    try {
      // Before: the process awaited the pool before listening, and said nothing, for as long as it hung.
      d = await nodePlugin(base, m, 'node-hs');
      const e = await errorOf(d.clients.identity.Probe({}, { timeoutMs: 3000 }));
      expect(e.code).toBe('FAILED_PRECONDITION');
      expect(e.details).toMatch(/is not open after 2 s/);
      expect(d.logs().some((l) => l.includes('is not open after 2 s'))).toBe(true);
    } finally {
      m.resume();
    }
    // Its log tells what it waited for, should it not get ready.
    const ready = await readyWithin(d, 30_000);
    expect({ ready, log: ready ? [] : d.logs().slice(-15) }).toEqual({ ready: true, log: [] });
    expect((await d.clients.node.NodeGetInfo({}, { timeoutMs: 5000 })).node_id).toBe('node-hs');
    expect(d.logs().some((l) => l.includes('the pool is open; serving it'))).toBe(true);
    await d.stop();
    await m.unmount();
  });

  // With every client cache off, as the tests assume elsewhere; and with sshfs's own caching on, where
  // a directory listing can be 20 s old: the fences (leases, attachments) must not depend on one.
  describe.each(['off', 'sshfs-defaults'] as const)(
    'two hosts and a controller, each with its own mount of one export (client caches %s)',
    (cache) => {
      let base = '';
      let ctl: DriverProcess;
      let nodeA: DriverProcess;
      let nodeB: DriverProcess;
      const cap = mountCap('ext4');

      beforeAll(async () => {
        const s = await shared(`hosts-${cache}`, ['a', 'b', 'ctl'], cache);
        base = s.base;
        const [a, b, c] = s.mounts;
        if (!a || !b || !c) throw new Error('no mounts');
        nodeA = await nodePlugin(base, a, 'node-a');
        nodeB = await nodePlugin(base, b, 'node-b');
        ctl = await env.driver({
          dir: base,
          poolDir: c.mountPoint,
          socket: path.join(base, 'ctl.sock'),
          mode: 'controller',
        });
      });

      async function createVolume(name: string, size = 64 * MiB, source?: string): Promise<string> {
        const res = await ctl.clients.controller.CreateVolume({
          name: `${name}-${RUN}`,
          capacity_range: { required_bytes: String(size) },
          volume_capabilities: [cap],
          ...(source ? { volume_content_source: { snapshot: { snapshot_id: source } } } : {}),
        });
        return res.volume?.volume_id ?? '';
      }
      const publishTo = (id: string, node: string) =>
        ctl.clients.controller.ControllerPublishVolume({
          volume_id: id,
          node_id: node,
          volume_capability: cap,
        });
      const unpublishFrom = (id: string, node: string) =>
        ctl.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: node });

      it('moves a volume from one node to the other with its data, and fences the second while the first has it', async () => {
        const id = await createVolume('pvc-moves');
        await publishTo(id, 'node-a');
        const onA = new OnNode(nodeA, id, cap, path.join(base, 'host-a'));
        const onB = new OnNode(nodeB, id, cap, path.join(base, 'host-b'));
        await onA.up();
        const sum = await writeRandom(path.join(onA.target, 'data.bin'), 4, 42);

        // The lease node-a wrote through its mount stops node-b, which reads it through another.
        const refused = await errorOf(onB.stage());
        expect(refused.code).toBe('FAILED_PRECONDITION');
        expect(refused.details).toContain('node-a');
        expect(await codeOf(publishTo(id, 'node-b'))).toBe('FAILED_PRECONDITION');

        await onA.down();
        await unpublishFrom(id, 'node-a');
        await publishTo(id, 'node-b');
        await onB.up();
        expect(await sha256(path.join(onB.target, 'data.bin'))).toBe(sum);
        // And now the other way round.
        expect((await errorOf(onA.stage())).details).toContain('node-b');
        await onB.down();
        await unpublishFrom(id, 'node-b');
        await ctl.clients.controller.DeleteVolume({ volume_id: id });
      });

      it('snapshots a volume in use on a node, which freezes it on a request through the pool', async () => {
        const id = await createVolume('pvc-snap-src');
        await publishTo(id, 'node-a');
        const onA = new OnNode(nodeA, id, cap, path.join(base, 'host-a'));
        await onA.up();
        const sum = await writeRandom(path.join(onA.target, 'data.bin'), 2, 7);

        const snap = await ctl.clients.controller.CreateSnapshot(
          { name: 'snap-shared', source_volume_id: id },
          { timeoutMs: 60_000 },
        );
        expect(snap.snapshot?.ready_to_use).toBe(true);
        expect(await nodeA.waitForLog((l) => l.includes('froze a filesystem for a copy'))).toBe(true);
        expect(await nodeA.waitForLog((l) => l.includes('thawed a filesystem frozen for a copy'))).toBe(true);
        expect(
          await ctl.waitForLog(
            (l) =>
              l.includes('"name":"snap-shared"') &&
              l.includes('"how":"sparse-copy"') &&
              l.includes('"frozen":true'),
          ),
        ).toBe(true);
        // The pod writes again.
        await fs.writeFile(path.join(onA.target, 'after'), 'written after the snapshot');

        // The copy holds the data as it was, restored on the other node.
        const restored = await createVolume('pvc-snap-restored', 64 * MiB, snap.snapshot?.snapshot_id);
        await publishTo(restored, 'node-b');
        const onB = new OnNode(nodeB, restored, cap, path.join(base, 'host-b'));
        await onB.up();
        expect(await sha256(path.join(onB.target, 'data.bin'))).toBe(sum);
        await expect(fs.stat(path.join(onB.target, 'after'))).rejects.toThrow(/ENOENT/);

        await onB.down();
        await onA.down();
        await unpublishFrom(restored, 'node-b');
        await unpublishFrom(id, 'node-a');
        for (const v of [restored, id]) await ctl.clients.controller.DeleteVolume({ volume_id: v });
        await ctl.clients.controller.DeleteSnapshot({ snapshot_id: snap.snapshot?.snapshot_id ?? '' });
      });

      it('freezes a volume staged just after the controller last listed its leases', async () => {
        // The controller lists the leases of a volume nobody stages; then a node stages it. With the
        // client's directory cache on (sshfs's default), the next snapshot would still see no lease,
        // and byte-copy a mounted filesystem without freezing it.
        const id = await createVolume('pvc-fresh-lease');
        await publishTo(id, 'node-a');
        const onA = new OnNode(nodeA, id, cap, path.join(base, 'host-a'));
        await onA.up();
        await onA.down();
        const unused = await ctl.clients.controller.CreateSnapshot({
          name: 'snap-unused',
          source_volume_id: id,
        });
        expect(
          await ctl.waitForLog((l) => l.includes('"name":"snap-unused"') && l.includes('"frozen":false')),
        ).toBe(true);
        await onA.up();
        // This call once answered INTERNAL in a fully loaded run, never since: should it again, the
        // controller's own account of it goes into the failure.
        const inUse = await ctl.clients.controller
          .CreateSnapshot({ name: 'snap-in-use', source_volume_id: id })
          .catch((err: unknown) => {
            const said = ctl.logs().filter((l) => /"level":"(warn|error)"/.test(l));
            throw new Error(`${String(err)}\nthe controller logged:\n${said.join('\n')}`);
          });
        expect(
          await ctl.waitForLog((l) => l.includes('"name":"snap-in-use"') && l.includes('"frozen":true')),
        ).toBe(true);
        await onA.down();
        await unpublishFrom(id, 'node-a');
        for (const s of [unused, inUse])
          await ctl.clients.controller.DeleteSnapshot({ snapshot_id: s.snapshot?.snapshot_id ?? '' });
        await ctl.clients.controller.DeleteVolume({ volume_id: id });
      });
    },
  );
});
