/**
 * A force-detach (root only): the CO detaches a volume from a node that still has it mounted (what
 * Kubernetes does after a node stops answering). Another node may stage it only once the first has
 * confirmed that it stopped writing it (its plugin froze the filesystem for good); silence alone
 * proves nothing, so a node whose plugin died confirms when the plugin is back. A fenced filesystem is
 * never thawed by the driver.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { HEARTBEAT_MS } from '../../src/pool/nodes.js';
import type { DriverProcess } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { publish, stage } from '../helpers/volumes.js';
import { frozen, isRoot, MiB, mountSource, RUN, sha256, thawFenced, writeRandom } from '../helpers/host.js';

const env = new TestEnv();
const fencedDevices: string[] = [];
afterAll(async () => {
  await thawFenced(fencedDevices);
  expect(await env.teardown()).toEqual([]);
});

const cap = mountCap('ext4');

async function retryUntilOk(call: () => Promise<unknown>, seconds: number): Promise<{ refusals: string[] }> {
  const refusals: string[] = [];
  const end = Date.now() + seconds * 1000;
  for (;;) {
    const e = await errorOf(call()).catch(() => undefined);
    if (!e) return { refusals };
    refusals.push(`${e.code}: ${e.details}`);
    if (Date.now() > end) throw new Error(`still refused after ${seconds} s: ${refusals.at(-1) ?? ''}`);
    await new Promise((r) => setTimeout(r, 500));
  }
}

/**
 * Waits for `node`'s next heartbeat, and a second more. Its plugin looks for volumes taken from it on
 * the same beat (HEARTBEAT_MS, src/node/fence.ts), so what the test does next lands seconds before that look,
 * not, on a slow machine, right at it.
 */
async function afterBeat(base: string, node: string): Promise<void> {
  const file = path.join(base, 'pool', 'nodes', `${node}.alive`);
  const read = () => fs.readFile(file, 'utf8').catch(() => '');
  const was = await read();
  const end = Date.now() + 2 * HEARTBEAT_MS;
  while ((await read()) === was) {
    if (Date.now() > end) throw new Error(`${node} wrote no heartbeat in ${(2 * HEARTBEAT_MS) / 1000} s`);
    await new Promise((r) => setTimeout(r, 20));
  }
  await new Promise((r) => setTimeout(r, 1000));
}

async function setup(tag: string) {
  const base = await env.dir(tag);
  const ctl = await env.driver({ dir: base, mode: 'controller', socket: path.join(base, 'ctl.sock') });
  const nodeArgs = (id: string) => ({
    dir: base,
    mode: 'node' as const,
    nodeId: id,
    socket: path.join(base, `${id}.sock`),
  });
  const a = await env.driver(nodeArgs('node-a'));
  const b = await env.driver(nodeArgs('node-b'));
  const id =
    (
      await ctl.clients.controller.CreateVolume({
        name: `pvc-fence-${tag}-${RUN}`,
        capacity_range: { required_bytes: String(64 * MiB) },
        volume_capabilities: [cap],
      })
    ).volume?.volume_id ?? '';
  const paths = (n: string) => ({
    staging: path.join(base, n, 'staging'),
    target: path.join(base, n, 'pod', 'mount'),
  });
  const up = async (d: DriverProcess, n: string) => {
    const p = paths(n);
    await stage(d, id, p.staging, cap);
    await publish(d, id, p.staging, p.target, cap);
  };
  const publishTo = (node: string) =>
    ctl.clients.controller.ControllerPublishVolume({ volume_id: id, node_id: node, volume_capability: cap });
  const fenceRecord = async () =>
    JSON.parse(await fs.readFile(path.join(base, 'pool', 'volumes', id, 'fences.json'), 'utf8')) as {
      revoked: Record<string, { fencedAt?: string }>;
    };
  return { base, ctl, a, b, id, paths, up, publishTo, fenceRecord, nodeArgs };
}

describe.skipIf(!isRoot())('a volume detached from a node that still has it mounted', () => {
  it('moves to another node only once the first has fenced itself, which is never thawed', async () => {
    const { base, ctl, a, b, id, paths, up, publishTo, fenceRecord } = await setup('alive');
    await publishTo('node-a');
    await up(a, 'a');
    fencedDevices.push(await mountSource(paths('a').staging));
    env.declareOwn(paths('a').staging, fencedDevices.at(-1) ?? ''); // fenced for good: what a reboot ends
    const sum = await writeRandom(path.join(paths('a').target, 'data.bin'), 4, 21);
    // The CO force-detaches node-a (it stopped answering the API server, say) and moves the pod; node-b
    // asks before node-a's plugin had a look.
    await afterBeat(base, 'node-a');
    await ctl.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-a' });
    await publishTo('node-b');
    const first = await errorOf(up(b, 'b'));
    expect(first.code).toBe('FAILED_PRECONDITION');
    expect(first.details).toMatch(
      /detached from node node-a.*once node-a has confirmed that it stopped using it/,
    );
    expect((await fenceRecord()).revoked['node-a']?.fencedAt).toBeUndefined();
    // node-a's plugin notices within a few seconds, freezes the filesystem for good, and says so.
    await retryUntilOk(() => up(b, 'b'), 15);
    expect(await a.waitForLog((l) => l.includes('froze its filesystem for good'))).toBe(true);
    expect(frozen(paths('a').staging)).toBe(true);
    expect((await fenceRecord()).revoked['node-a']?.fencedAt).toMatch(
      /node node-a froze its filesystem for good/,
    );
    expect(await sha256(path.join(paths('b').target, 'data.bin'))).toBe(sum);
    // A snapshot now needs no freeze from node-a (fenced) and freezes node-b's.
    const snap = await ctl.clients.controller.CreateSnapshot({
      name: `snap-fence-${RUN}`,
      source_volume_id: id,
    });
    expect(snap.snapshot?.ready_to_use).toBe(true);
    // node-a's kubelet tears the old pod down: the fenced filesystem is unmounted but never thawed.
    await a.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: paths('a').target });
    const unstage = await errorOf(
      a.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: paths('a').staging }),
    );
    expect(unstage.code).toBe('FAILED_PRECONDITION');
    expect(unstage.details).toMatch(/frozen for good.*Reboot the node/);
    // Staging it there again is refused too (the old writes wait on that superblock).
    const again = await errorOf(up(a, 'a'));
    expect(again.code).toBe('FAILED_PRECONDITION');
    // node-b is unaffected.
    await b.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: paths('b').target });
    await b.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: paths('b').staging });
  });

  it('waits for a node whose plugin died until the plugin is back and has fenced the old mount', async () => {
    const { ctl, b, id, paths, up, publishTo, fenceRecord, nodeArgs, a } = await setup('dead');
    await publishTo('node-a');
    await up(a, 'a');
    fencedDevices.push(await mountSource(paths('a').staging));
    env.declareOwn(paths('a').staging, fencedDevices.at(-1) ?? ''); // fenced for good: what a reboot ends
    const sum = await writeRandom(path.join(paths('a').target, 'data.bin'), 2, 22);
    // node-a's plugin dies with the volume mounted (the old pod could still be writing through it).
    await a.stop('SIGKILL');
    await ctl.clients.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-a' });
    await publishTo('node-b');
    // Silence is no proof: node-b is refused for as long as node-a says nothing, well past the
    // heartbeat interval.
    const end = Date.now() + 12_000;
    while (Date.now() < end) {
      const e = await errorOf(up(b, 'b'));
      expect(e.code).toBe('FAILED_PRECONDITION');
      expect(e.details).toMatch(/once node-a has confirmed/);
      await new Promise((r) => setTimeout(r, 1000));
    }
    expect((await fenceRecord()).revoked['node-a']?.fencedAt).toBeUndefined();
    // node-a's plugin comes back: it freezes the mount it left writable, then confirms.
    const again = await env.driver(nodeArgs('node-a'));
    await retryUntilOk(() => up(b, 'b'), 20);
    expect(await again.waitForLog((l) => l.includes('froze its filesystem for good'))).toBe(true);
    expect(frozen(paths('a').staging)).toBe(true);
    expect((await fenceRecord()).revoked['node-a']?.fencedAt).toMatch(/node node-a froze/);
    expect(await sha256(path.join(paths('b').target, 'data.bin'))).toBe(sum);
    expect(
      await codeOf(b.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: paths('b').target })),
    ).toBe('OK');
    await b.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: paths('b').staging });
    // What the old node's reboot would end: its pod mount (the fenced staging mount goes in afterAll).
    execFileSync('umount', [paths('a').target]);
  });
});
