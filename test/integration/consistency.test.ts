/**
 * Snapshots of volumes in use (root only): a writer appends fsynced, numbered records to a volume
 * staged by a node plugin in its own mount namespace (another "host": the controller cannot see its
 * mounts), while the controller snapshots it. A snapshot either is refused with a reason, or restores
 * to a clean filesystem (e2fsck -n) holding an unbroken prefix of the records. And a pod that goes
 * away during a long frozen copy leaves no filesystem frozen behind.
 */
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import {
  isRoot,
  leaksUnder,
  MiB,
  ownMountNamespace,
  RUN,
  scratchFilesystem,
  SLOW,
  until,
  writeRandom,
} from '../helpers/host.js';
import { createVolume } from '../helpers/volumes.js';

const env = new TestEnv();
/** Names unique to this run: a device another run left behind never matches one of ours. */
const writers: ChildProcess[] = [];
afterAll(async () => {
  for (const w of writers) w.kill('SIGKILL');
  expect(await env.teardown()).toEqual([]);
});

const RECORD = 9; // "%08d\n"

/** Appends numbered records to `file`, each written and fsynced alone, inside `pid`'s mount namespace. */
function startWriter(
  pid: number,
  file: string,
): { proc: ChildProcess; written: () => number; stop: () => Promise<void> } {
  const script = `
    const fs = require('node:fs');
    const fd = fs.openSync(process.argv[1], 'a');
    let n = 0;
    const tick = () => {
      for (let i = 0; i < 20; i++) {
        fs.writeSync(fd, String(n).padStart(8, '0') + '\\n');
        fs.fsyncSync(fd);
        n++;
      }
      process.stdout.write(n + '\\n');
      setImmediate(tick);
    };
    tick();
  `;
  const proc = spawn(
    'nsenter',
    ['--target', String(pid), '--mount', '--', process.execPath, '-e', script, file],
    {
      stdio: ['ignore', 'pipe', 'inherit'],
    },
  );
  writers.push(proc);
  let last = 0;
  proc.stdout.on('data', (b: Buffer) => {
    const lines = b.toString().trim().split('\n');
    last = Number(lines.at(-1) ?? last);
  });
  const exited = new Promise<void>((resolve) => {
    proc.once('exit', () => {
      resolve();
    });
  });
  // Stopped and gone: its open file in the pod's volume would make the unpublish that follows busy.
  // A writer blocked on a filesystem a failed test left frozen may not die: given up on after 10 s.
  const stop = async (): Promise<void> => {
    proc.kill('SIGTERM');
    await Promise.race([exited, new Promise((r) => setTimeout(r, 10_000 * SLOW))]);
  };
  return { proc, written: () => last, stop };
}

/** The records in an ext4 image's /log, read without mounting it; throws on a torn or missing record. */
function recordsIn(image: string): number {
  const text = execFileSync('debugfs', ['-R', 'cat /log', image], {
    encoding: 'latin1',
    stdio: ['ignore', 'pipe', 'ignore'],
  });
  expect(text.length % RECORD).toBe(0);
  const n = text.length / RECORD;
  for (let i = 0; i < n; i++)
    expect(text.slice(i * RECORD, (i + 1) * RECORD)).toBe(`${String(i).padStart(8, '0')}\n`);
  return n;
}

/** e2fsck -n: exit 0 means clean, with nothing to replay or repair. */
function fsckClean(image: string): number {
  try {
    execFileSync('e2fsck', ['-f', '-n', image], { stdio: 'ignore' });
    return 0;
  } catch (err) {
    return (err as { status?: number }).status ?? -1;
  }
}

describe.skipIf(!isRoot()).each([
  ['ext4', false],
  ['xfs', true],
] as const)('a snapshot of a volume in use on another node, pool on %s', (poolFs, reflink) => {
  let base: string;
  let ctl: DriverProcess;
  let node: DriverProcess;
  let id = '';
  let target = '';
  let staging = '';
  const cap = mountCap('ext4');

  beforeAll(async () => {
    base = await env.dir(`consistent-${poolFs}`);
    let poolDir = path.join(base, 'pool');
    if (reflink) {
      const scratch = await scratchFilesystem(base, 'xfs', 2048);
      env.declareOwn(scratch.mountPoint, scratch.device);
      poolDir = path.join(scratch.mountPoint, 'pool');
    }
    ctl = await env.driver({ dir: base, mode: 'controller', poolDir, socket: path.join(base, 'ctl.sock') });
    // Its own mount namespace: what it mounts, the controller (and this test) cannot see.
    node = await env.driver({
      dir: base,
      mode: 'node',
      nodeId: 'node-2',
      poolDir,
      socket: path.join(base, 'node-2.sock'),
      wrap: ownMountNamespace(base),
    });
    const res = await ctl.clients.controller.CreateVolume({
      name: `pvc-consistent-${poolFs}-${RUN}`,
      capacity_range: { required_bytes: String(256 * MiB) },
      volume_capabilities: [cap],
    });
    id = res.volume?.volume_id ?? '';
    await ctl.clients.controller.ControllerPublishVolume({
      volume_id: id,
      node_id: 'node-2',
      volume_capability: cap,
    });
    staging = path.join(base, 'staging');
    target = path.join(base, 'pod', 'mount');
    await fs.mkdir(staging, { recursive: true });
    await fs.mkdir(path.dirname(target), { recursive: true });
    await node.clients.node.NodeStageVolume({
      volume_id: id,
      staging_target_path: staging,
      volume_capability: cap,
    });
    await node.clients.node.NodePublishVolume({
      volume_id: id,
      staging_target_path: staging,
      target_path: target,
      volume_capability: cap,
    });
  });

  it('is filesystem-consistent: a clean restore holding an unbroken prefix of the records', async () => {
    const w = startWriter(node.proc.pid ?? 0, path.join(target, 'log'));
    await until(() => w.written() >= 400);
    const before = w.written();
    const snap = await ctl.clients.controller.CreateSnapshot({
      name: `snap-${poolFs}-${RUN}`,
      source_volume_id: id,
    });
    const at = w.written();
    await until(() => w.written() >= at + 200);
    await w.stop();
    expect(snap.snapshot?.ready_to_use).toBe(true);
    expect(await node.waitForLog((l) => l.includes('froze a filesystem for a copy'))).toBe(true);
    expect(await ctl.waitForLog((l) => l.includes(reflink ? '"how":"reflink"' : '"how":"sparse-copy"'))).toBe(
      true,
    );
    const image = path.join(ctl.poolDir, 'snapshots', snap.snapshot?.snapshot_id ?? '', 'disk.img');
    expect(fsckClean(image)).toBe(0);
    const n = recordsIn(image);
    expect(n).toBeGreaterThanOrEqual(before);
    expect(n).toBeLessThanOrEqual(at + 20);
    // The pod was thawed when the call returned: its writes went on.
    expect(w.written()).toBeGreaterThan(at);
  });

  it.skipIf(reflink)(
    'refuses a copy that would not fit the freeze budget, saying why and what to do',
    async () => {
      const strict = await env.driver({
        dir: base,
        mode: 'controller',
        poolDir: ctl.poolDir,
        socket: path.join(base, 'strict.sock'),
        extra: ['--freeze-budget=0'],
      });
      const snapshotsBefore = await fs.readdir(path.join(ctl.poolDir, 'snapshots'));
      const e = await errorOf(
        strict.clients.controller.CreateSnapshot({ name: `snap-strict-${RUN}`, source_volume_id: id }),
      );
      expect(e.code).toBe('FAILED_PRECONDITION');
      expect(e.details).toContain('node-2');
      expect(e.details).toMatch(/cannot reflink/);
      expect(e.details).toMatch(/Stop the workload/);
      expect(await fs.readdir(path.join(ctl.poolDir, 'snapshots'))).toEqual(snapshotsBefore);
      await strict.stop();
    },
  );

  it.skipIf(reflink)(
    'a frozen copy that outlasts the budget is stopped with FAILED_PRECONDITION, and the retry is refused before freezing',
    async () => {
      // A pool that copies far slower than any copy seen so far: its cp never finishes.
      const slow = path.join(base, 'slow-bin');
      await fs.mkdir(slow, { recursive: true });
      await fs.writeFile(path.join(slow, 'cp'), '#!/bin/sh\nexec sleep 60\n', { mode: 0o755 });
      const c = await env.driver({
        dir: base,
        mode: 'controller',
        poolDir: ctl.poolDir,
        socket: path.join(base, 'slow.sock'),
        extra: ['--freeze-budget=2'],
        env: { PATH: `${slow}:${process.env.PATH ?? ''}` },
      });
      const froze = (): number =>
        node.logs().filter((l) => l.includes('froze a filesystem for a copy')).length;
      const snapshotsBefore = await fs.readdir(path.join(ctl.poolDir, 'snapshots'));
      const w = startWriter(node.proc.pid ?? 0, path.join(target, 'log-slow'));
      try {
        await until(() => w.written() >= 50);
        const frozeBefore = froze();
        const first = await errorOf(
          c.clients.controller.CreateSnapshot({ name: `snap-slow-${RUN}`, source_volume_id: id }),
        );
        expect(first.code).toBe('FAILED_PRECONDITION'); // not DEADLINE_EXCEEDED: nothing is still running
        expect(first.details).toMatch(/did not finish within its 2 s freeze budget/);
        await until(() => froze() === frozeBefore + 1, 30_000 * SLOW);
        // The writer goes on once the copy is stopped.
        const at = w.written();
        await until(() => w.written() >= at + 20);

        const second = await errorOf(
          c.clients.controller.CreateSnapshot({ name: `snap-slow-${RUN}`, source_volume_id: id }),
        );
        expect(second.code).toBe('FAILED_PRECONDITION');
        expect(second.details).toMatch(/more than the 2 s freeze budget/);
        await new Promise((r) => setTimeout(r, 500)); // the node's log is written asynchronously
        expect(froze()).toBe(frozeBefore + 1); // refused before asking the node to freeze again
        expect(await fs.readdir(path.join(ctl.poolDir, 'snapshots'))).toEqual(snapshotsBefore);
      } finally {
        await w.stop();
        await c.stop();
      }
    },
    60_000,
  );

  it('tears down after', async () => {
    await node.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await node.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    expect((await leaksUnder(path.join(ctl.poolDir, 'volumes', id))).loops).toEqual([]);
  });
});

describe.skipIf(!isRoot())('a pod that goes away during a long frozen copy', () => {
  it('waits for the thaw: nothing stays frozen, and the volume stages and writes again', async () => {
    const base = await env.dir('freeze-unstage');
    const d = await env.driver({ dir: base, extra: ['--freeze-budget=120'] });
    const cap = mountCap('ext4');
    const { id } = await createVolume(d, `pvc-frozen-${RUN}`, cap, 2048 * MiB);
    const staging = path.join(base, 'staging');
    const target = path.join(base, 'pod', 'mount');
    await fs.mkdir(staging, { recursive: true });
    await fs.mkdir(path.dirname(target), { recursive: true });
    const stageReq = { volume_id: id, staging_target_path: staging, volume_capability: cap };
    const publishReq = { ...stageReq, target_path: target };
    await d.clients.node.NodeStageVolume(stageReq);
    await d.clients.node.NodePublishVolume(publishReq);
    await writeRandom(path.join(target, 'data.bin'), 768, 8);
    const snapshot = d.clients.controller.CreateSnapshot({ name: `snap-long-${RUN}`, source_volume_id: id });
    expect(await d.waitForLog((l) => l.includes('froze a filesystem for a copy'))).toBe(true);
    await new Promise((r) => setTimeout(r, 400));
    // The kubelet tears the pod down now, and retries what is refused.
    const retry = async (call: () => Promise<unknown>): Promise<number> => {
      for (let aborted = 0; ; aborted++) {
        const code = await codeOf(call());
        if (code === 'OK') return aborted;
        expect(code).toBe('ABORTED');
        await new Promise((r) => setTimeout(r, 200));
      }
    };
    expect(
      await retry(() => d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target })),
    ).toBeGreaterThan(0);
    await retry(() => d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging }));
    expect((await snapshot).snapshot?.ready_to_use).toBe(true);
    expect((await leaksUnder(path.join(d.poolDir, 'volumes', id))).loops).toEqual([]);
    // It stages again (no false "needs e2fsck"), and writes do not hang on a frozen superblock.
    await d.clients.node.NodeStageVolume(stageReq);
    await d.clients.node.NodePublishVolume(publishReq);
    const write = (async () => {
      const h = await fs.open(path.join(target, 'after'), 'w');
      await h.writeFile('still writable');
      await h.sync();
      await h.close();
    })();
    const hung = new Promise((_, reject) => {
      setTimeout(() => {
        reject(new Error('a write hung'));
      }, 30_000 * SLOW);
    });
    await Promise.race([write, hung]);
    await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
  });
});
