/**
 * A shared pool mounted again on a node while a volume is staged there (root, sshfs). The pool's
 * filesystem goes away and comes back on the node's host (a network mount that lost its connection):
 * the image now has another device and inode, while the node's loop device keeps the file it opened
 * through the old connection, and its filesystem stays mounted for writing. The node must still know
 * that device for the volume's: a force-detach freezes it before anything is confirmed (else another
 * node mounts the same filesystem beside it), a snapshot freezes it, and the node's own unpublish and
 * unstage release it.
 */
import { execFileSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { errorOf } from '../helpers/grpc.js';
import { publish, stage } from '../helpers/volumes.js';
import { frozen, isRoot, MiB, RUN, sha256, thawFenced, writeRandom } from '../helpers/host.js';
import { type SshServer, type SshfsMount, sshfsUnavailable, startSshServer } from '../helpers/sshfs.js';

const env = new TestEnv();
let ssh: SshServer | undefined;
const skip = !isRoot() || sshfsUnavailable() !== undefined;
/** Loop devices whose backing file only the old connection reaches: teardown cannot find them by it. */
const oldDevices: { device: string; shown: string }[] = [];
/** Filesystems a node froze for good (what a reboot of it would end). */
const fenced: string[] = [];

const shownBacking = (device: string): string => {
  try {
    return readFileSync(`/sys/block/${path.basename(device)}/loop/backing_file`, 'utf8').trim();
  } catch {
    return '';
  }
};

afterAll(async () => {
  ssh?.resumeAll();
  // The kernel hands back the frozen superblock to a new mount of its device: thaw it there.
  await thawFenced(fenced);
  const leaks = await env.teardown();
  for (const { device, shown } of oldDevices) {
    if (shown !== '' && shownBacking(device) === shown) {
      // A fenced one stays attached by design (its node must reboot); any other is a leak.
      if (!fenced.includes(device)) leaks.push(`${device} ${shown}`);
      execFileSync('losetup', ['--detach', device]);
    }
  }
  const sshLeaks = ssh ? await ssh.stop() : [];
  expect([...leaks, ...sshLeaks]).toEqual([]);
});

/** The source of the top mount at `mp` in this process's mount table. */
function sourceOf(mp: string): string {
  const line = readFileSync('/proc/self/mountinfo', 'utf8')
    .split('\n')
    .filter((l) => l.split(' ')[4] === mp)
    .at(-1);
  return line?.split(' - ')[1]?.split(' ')[1] ?? '';
}

const fileDev = async (p: string): Promise<string> => {
  const st = await fs.stat(p, { bigint: true });
  return `${st.dev}:${st.ino}`;
};

describe.skipIf(skip)('a shared pool mounted again on a node that has a volume staged', () => {
  let base = '';
  let mountA: SshfsMount;
  let ctl: DriverProcess;
  let nodeA: DriverProcess;
  let nodeB: DriverProcess;
  const cap = mountCap('ext4');

  beforeAll(async () => {
    ssh = await startSshServer();
    base = await env.dir('remount');
    const exportDir = path.join(base, 'export');
    await fs.mkdir(exportDir);
    const mounts: SshfsMount[] = [];
    for (const h of ['a', 'b', 'ctl']) {
      const mp = path.join(base, `pool-${h}`);
      mounts.push(await ssh.mountExport(exportDir, mp));
      env.declareOwn(mp);
    }
    const [a, b, c] = mounts;
    if (!a || !b || !c) throw new Error('no mounts');
    mountA = a;
    const plugin = (m: SshfsMount, nodeId: string) =>
      env.driver({
        dir: base,
        poolDir: m.mountPoint,
        socket: path.join(base, `${nodeId}.sock`),
        nodeId,
        mode: 'node',
      });
    nodeA = await plugin(a, 'node-a');
    nodeB = await plugin(b, 'node-b');
    ctl = await env.driver({
      dir: base,
      poolDir: c.mountPoint,
      socket: path.join(base, 'ctl.sock'),
      mode: 'controller',
    });
  });

  /** A volume staged and published on node-a, with data written, whose pool node-a then mounts again. */
  async function stagedThenRemounted(name: string) {
    const id =
      (
        await ctl.clients.controller.CreateVolume({
          name: `${name}-${RUN}`,
          capacity_range: { required_bytes: String(64 * MiB) },
          volume_capabilities: [cap],
        })
      ).volume?.volume_id ?? '';
    const on = (n: string) => ({
      staging: path.join(base, n, 'staging', id),
      target: path.join(base, n, 'pods', id, 'mount'),
    });
    const up = async (d: DriverProcess, n: string) => {
      const p = on(n);
      await stage(d, id, p.staging, cap);
      await publish(d, id, p.staging, p.target, cap);
    };
    const down = async (d: DriverProcess, n: string) => {
      await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: on(n).target });
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: on(n).staging });
    };
    const publishTo = (node: string) =>
      ctl.clients.controller.ControllerPublishVolume({
        volume_id: id,
        node_id: node,
        volume_capability: cap,
      });
    const unpublishFrom = (node: string) =>
      ctl.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: node });

    await publishTo('node-a');
    await up(nodeA, 'a');
    const sum = await writeRandom(path.join(on('a').target, 'data.bin'), 4, 7);
    const device = sourceOf(on('a').staging);
    const image = (m: SshfsMount) => path.join(m.mountPoint, 'volumes', id, 'disk.img');
    const before = await fileDev(image(mountA));
    mountA = await mountA.reconnect();
    // Only the old connection reaches its backing file now, which sysfs shows from that mount's root.
    oldDevices.push({ device, shown: shownBacking(device) });
    // What makes this case: the image as node-a now reaches it is another file to stat(2).
    expect(await fileDev(image(mountA))).not.toBe(before);
    return { id, on, up, down, publishTo, unpublishFrom, sum, device };
  }

  it('fences the old mount after a force-detach before another node may stage it', async () => {
    const { id, on, up, down, publishTo, unpublishFrom, sum, device } =
      await stagedThenRemounted('pvc-remount-fence');
    fenced.push(device);
    // node-a stopped answering the API server, say: the CO force-detaches it and moves the pod.
    await unpublishFrom('node-a');
    await publishTo('node-b');
    const end = Date.now() + 20_000;
    for (;;) {
      const e = await errorOf(up(nodeB, 'b')).catch(() => undefined);
      if (!e) break;
      expect(e.code).toBe('FAILED_PRECONDITION');
      if (Date.now() > end) throw new Error(`node-b still refused: ${e.details}`);
      await new Promise((r) => setTimeout(r, 500));
    }
    // node-b got in only because node-a froze its mount, which the old pod still had for writing.
    expect(frozen(on('a').staging)).toBe(true);
    const record = JSON.parse(
      await fs.readFile(path.join(base, 'export', 'volumes', id, 'fences.json'), 'utf8'),
    ) as { revoked: Record<string, { fencedAt?: string }> };
    expect(record.revoked['node-a']?.fencedAt).toMatch(/node node-a froze its filesystem for good/);
    expect(await sha256(path.join(on('b').target, 'data.bin'))).toBe(sum);
    // node-a's kubelet tears the old pod down: its bind goes; the fenced staging stays until a reboot.
    await nodeA.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: on('a').target });
    const unstage = await errorOf(
      nodeA.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: on('a').staging }),
    );
    expect(unstage.code).toBe('FAILED_PRECONDITION');
    expect(unstage.details).toMatch(/frozen for good.*Reboot the node/);
    await down(nodeB, 'b');
    await unpublishFrom('node-b');
  });

  it("freezes the old mount for a snapshot, and the node's own unpublish and unstage release it", async () => {
    const { id, on, up, down, publishTo, unpublishFrom, sum, device } =
      await stagedThenRemounted('pvc-remount-release');
    // Its stats still see the volume behind the pod's path: healthy, with its usage (not "detached").
    const stats = await nodeA.clients.node.NodeGetVolumeStats({ volume_id: id, volume_path: on('a').target });
    expect({ condition: stats.volume_condition, units: stats.usage.map((u) => u.unit) }).toEqual({
      condition: { abnormal: false, message: 'The volume is attached, mounted and healthy.' },
      units: ['BYTES', 'INODES'],
    });
    // A snapshot on a pool that cannot reflink copies only while node-a holds the filesystem frozen.
    const snap = await ctl.clients.controller.CreateSnapshot({ name: 'snap-remount', source_volume_id: id });
    expect(snap.snapshot?.ready_to_use).toBe(true);
    expect(nodeA.logs().some((l) => l.includes(id) && l.includes('froze a filesystem for a copy'))).toBe(
      true,
    );
    expect(frozen(on('a').staging)).toBe(false);
    // The pod goes away the ordinary way: node-a lets go of the volume, device and lease.
    const shown = shownBacking(device);
    expect(shown).not.toBe('');
    await down(nodeA, 'a');
    // Detached from this volume's image (its number may serve another file's by now: files run side by side).
    expect(shownBacking(device)).not.toBe(shown);
    await unpublishFrom('node-a');
    await publishTo('node-b');
    await up(nodeB, 'b');
    expect(await sha256(path.join(on('b').target, 'data.bin'))).toBe(sum);
    await down(nodeB, 'b');
    await unpublishFrom('node-b');
    await ctl.clients.controller.DeleteSnapshot({ snapshot_id: snap.snapshot?.snapshot_id ?? '' });
    await ctl.clients.controller.DeleteVolume({ volume_id: id });
  });
});
