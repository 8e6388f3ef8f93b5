/**
 * `loopvol release-node`, the real binary against a real pool: the volumes force-detached from a node
 * that never confirmed are listed, released only with --yes and only after the node's heartbeat stayed
 * unchanged, and never while it changes. Node sides run on the in-memory kernel (test/helpers/node-world).
 */
import { afterAll, describe, expect, it } from 'vitest';
import { FenceGuard } from '../../src/node/fence.js';
import { InFlight } from '../../src/server/inflight.js';
import { runMain } from '../helpers/driver.js';
import {
  codeOf,
  log,
  newVolume,
  NODE,
  noCommands,
  publish,
  removeWorlds,
  stage,
  takenFromAnotherHost,
  world,
  type World,
} from '../helpers/node-world.js';

afterAll(removeWorlds);

const WATCH = '11';

const detachedFromDeadNode = takenFromAnotherHost;

const cLease = async (w: World, id: string) => (await w.volumes.leases(id)).find((l) => l.node === 'node-c');

describe('loopvol release-node', () => {
  it('refuses bad flags with status 2', async () => {
    const w = await world();
    expect((await runMain(['release-node', `--pool-dir=${w.root}`])).code).toBe(2);
    expect(
      (await runMain(['release-node', '--node=node-c', '--watch-seconds=3', `--pool-dir=${w.root}`])).code,
    ).toBe(2);
  });

  it('without --yes lists what waits and changes nothing', async () => {
    const { w, id } = await detachedFromDeadNode();
    const r = await runMain(['release-node', '--node=node-c', `--pool-dir=${w.root}`]);
    expect(r.code).toBe(0);
    expect(r.stdout).toContain(id);
    expect(r.stdout).toContain('--yes');
    expect((await cLease(w, id))?.fencedAt).toBeUndefined();
    expect(await codeOf(stage(w, id))).toBe('FAILED_PRECONDITION');
  });

  it('releases a silent node, and refuses (releasing nothing) while a heartbeat changes', async () => {
    const dead = await detachedFromDeadNode();
    const alive = await detachedFromDeadNode();
    const beat = setInterval(() => void alive.c.d.nodes.heartbeat('node-c'), 2000);
    try {
      const [r, refused] = await Promise.all([
        runMain([
          'release-node',
          '--node=node-c',
          '--yes',
          `--watch-seconds=${WATCH}`,
          `--pool-dir=${dead.w.root}`,
          '--json',
        ]),
        runMain([
          'release-node',
          '--node=node-c',
          '--yes',
          `--watch-seconds=${WATCH}`,
          `--pool-dir=${alive.w.root}`,
        ]),
      ]);
      expect(r.code).toBe(0);
      expect(JSON.parse(r.stdout)).toMatchObject({ node: 'node-c', released: true, releasedIds: [dead.id] });
      expect((await cLease(dead.w, dead.id))?.fencedAt).toContain('released by an operator');
      expect(refused.code).toBe(1);
      expect(refused.stderr).toContain('heartbeat changed');
      expect((await cLease(alive.w, alive.id))?.fencedAt).toBeUndefined();
      expect(await codeOf(stage(alive.w, alive.id))).toBe('FAILED_PRECONDITION');
    } finally {
      clearInterval(beat);
    }
    // The volume moves; and should node-c come back with its old mount, it freezes it all the same.
    expect(await codeOf(stage(dead.w, dead.id))).toBe('OK');
    const guard = new FenceGuard(dead.c.d, dead.c.pool, new InFlight(), noCommands, log);
    await guard.prepare();
    await guard.round();
    expect(dead.c.host.frozen.size).toBe(1);
  }, 30_000);
});

describe('loopvol release-node beside a running plugin', () => {
  it('refuses while the plugin runs, even while its fence round is slow', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    await w.volumes.unpublish(id, NODE); // force-detached while mounted for writing
    // fsfreeze takes longer than the watch (flushing a busy pod's dirty data to a slow pool), by several
    // seconds: the command's own start is slow on a busy machine.
    const freeze = w.host.freeze.bind(w.host);
    let frozeAt = 0;
    w.host.freeze = async (x, mp) => {
      await new Promise((r) => setTimeout(r, 18_000));
      await freeze(x, mp);
      frozeAt = Date.now();
    };
    const guard = new FenceGuard(w.d, w.pool, new InFlight(), noCommands, log);
    await guard.prepare();
    guard.run();
    try {
      await new Promise((r) => setTimeout(r, 5_500)); // its first round is freezing now
      const r = await runMain([
        'release-node',
        `--node=${NODE}`,
        '--yes',
        `--watch-seconds=${WATCH}`,
        `--pool-dir=${w.root}`,
      ]);
      expect(r.code).toBe(1);
      expect(r.stderr).toContain('heartbeat changed');
      expect(frozeAt).toBe(0); // the freeze was still under way: releasing would have let a writer in
      expect((await w.volumes.leases(id)).find((l) => l.node === NODE)?.fencedAt).toBeUndefined();
    } finally {
      await guard.stop();
    }
    // The node confirmed by itself once its freeze was done.
    expect((await w.volumes.leases(id)).find((l) => l.node === NODE)?.fencedAt).toContain(
      'froze its filesystem',
    );
  }, 60_000);
});
