/**
 * The node's side of fencing (node/fence.ts) and of freezes for copies (node/quiesce.ts), against the
 * in-memory kernel and a real pool: when a volume taken from this node is confirmed (and only then),
 * that a fence is never thawed, that a filesystem frozen by someone else is neither claimed nor thawed,
 * and that a freeze for a copy always ends.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { type FenceGuard as Guard, FenceGuard, nodeKey, thawLeftovers } from '../../src/node/fence.js';
import { expandVolume } from '../../src/node/grow.js';
import { QuiesceAgent } from '../../src/node/quiesce.js';
import { QuiesceBoard, type QuiesceRequest } from '../../src/pool/quiesce.js';
import { Turns } from '../../src/pool/turns.js';
import { InFlight } from '../../src/server/inflight.js';
import type { LoopDevice } from '../../src/host/host.js';
import { commandError, FakeHost } from '../helpers/fake-host.js';
import {
  attachTo,
  codeOf,
  during,
  log,
  must,
  newVolume,
  noCommands,
  NODE,
  publish,
  removeWorlds,
  stage,
  STAGING,
  takenFromAnotherHost,
  unpublish,
  unstage,
  world,
  type World,
} from '../helpers/node-world.js';

afterAll(removeWorlds);

const BUSY = commandError('fsfreeze', 'fsfreeze: /x: freeze failed: Device or resource busy');
const block = { accessType: 'block' as const, fsType: '' };

/** A volume staged and published on NODE, then force-detached from it by the controller. */
async function takenFromNode(over = {}) {
  const w = await world();
  const { id } = await newVolume(w);
  await stage(w, id, over);
  await publish(w, id, over);
  await w.volumes.unpublish(id, NODE);
  return { w, id };
}

const guardOf = (w: World, keys = new InFlight()): FenceGuard =>
  new FenceGuard(w.d, w.pool, keys, noCommands, log);

/** Another volume's fence on /dev/loop0 in this boot, its backing identity unknown (matched by path). */
const otherVolumesFence = (w: World) => ({
  volumeId: 'vol-other',
  device: '/dev/loop0',
  backingDev: '',
  backingIno: '',
  bootId: w.d.bootId,
  at: 'x',
});

/** A volume taken from NODE, and a prepared guard whose first `failures` record writes fail (no space). */
async function recordFailing(failures: number) {
  const { w, id } = await takenFromNode();
  const guard = guardOf(w);
  await guard.prepare();
  const setFenced = w.d.nodes.setFenced.bind(w.d.nodes);
  w.d.nodes.setFenced = async (node, entries) => {
    if (failures-- > 0) throw new Error('ENOSPC: no space left on device');
    await setFenced(node, entries);
  };
  return { w, id, guard };
}

/** NODE's revoked lease on `id`. */
async function revoked(w: World, id: string) {
  const l = (await w.volumes.leases(id)).find((x) => x.node === NODE);
  expect(l?.revokedAt).toBeDefined();
  return l;
}

describe('the fence guard', () => {
  it('a volume fenced here is never grown: NodeExpandVolume refuses before touching the frozen filesystem', async () => {
    const { w, id } = await takenFromNode();
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round(); // frozen for good
    const from = w.host.ops.length;
    const code = await codeOf(
      expandVolume(w.d, w.x, { id, volumePath: STAGING, requiredBytes: 0, limitBytes: 0 }),
    );
    expect({ code, ops: w.host.ops.slice(from) }).toEqual({ code: 'FAILED_PRECONDITION', ops: [] });
  });

  it('freezes a writable mount of a volume taken from this node, records it, then confirms', async () => {
    const { w, id } = await takenFromNode();
    expect(await w.d.nodes.revocations(NODE)).toEqual([id]);
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect(w.host.ops.filter((o) => /^(freeze|thaw)/.test(o))).toHaveLength(1);
    expect(w.host.ops.find((o) => o.startsWith('freeze'))).toMatch(/^freeze /);
    expect([...w.host.frozen]).toEqual(['/dev/loop0']);
    expect((await revoked(w, id))?.fencedAt).toMatch(/^node node-a froze its filesystem for good at /);
    expect(await w.d.nodes.revocations(NODE)).toEqual([]);
    const record = await w.d.nodes.fenced(NODE, w.d.bootId);
    expect(record).toMatchObject([{ volumeId: id, device: '/dev/loop0', bootId: w.d.bootId }]);
    // Never thawed: not by the kubelet's teardown, not by a plugin that restarts in the same boot.
    expect(await codeOf(unpublish(w, id))).toBe('OK');
    expect(await codeOf(unstage(w, id))).toBe('FAILED_PRECONDITION');
    const again = guardOf(w);
    await again.prepare();
    expect(await thawLeftovers(w.d, w.x, again)).toBe(0);
    expect(w.host.ops.some((o) => o.startsWith('thaw'))).toBe(false);
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
  });

  it('unstages a fence an operator thawed by hand while it was still mounted: nothing of it is left to refuse for', async () => {
    const { w, id } = await takenFromNode();
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round(); // frozen for good
    expect(await codeOf(unpublish(w, id))).toBe('OK');
    w.host.frozen.delete('/dev/loop0'); // fsfreeze --unfreeze by hand
    expect(await codeOf(unstage(w, id))).toBe('OK');
    expect({ attached: [...w.host.attached.keys()], mounts: w.host.table }).toEqual({
      attached: [],
      mounts: [],
    });
    // Not staged here again before a reboot, even published here again: its next device would have the
    // number and the file of the fence on record, which the guard would take for that fence.
    await attachTo(w, id);
    const from = w.host.ops.length;
    expect(await codeOf(stage(w, id))).toBe('FAILED_PRECONDITION');
    expect(w.host.ops.slice(from)).toEqual([]);
  });

  it('confirms a fence only once its record is written, the filesystem frozen then (a thaw meanwhile: frozen again)', async () => {
    const { w, id, guard } = await recordFailing(2);
    const unconfirmed = async () => ({
      fencedAt: (await revoked(w, id))?.fencedAt,
      record: await w.d.nodes.fenced(NODE, w.d.bootId),
      frozen: [...w.host.frozen],
    });
    await guard.round(); // frozen; its record not written
    expect(await unconfirmed()).toEqual({ fencedAt: undefined, record: [], frozen: ['/dev/loop0'] });
    await guard.round(); // still frozen (busy); its record still not written
    expect(await unconfirmed()).toEqual({ fencedAt: undefined, record: [], frozen: ['/dev/loop0'] });
    expect(guard.isFenced(must(w.host.attached.get('loop0'), 'loop0'), id)).toBe(false);
    w.host.frozen.delete('/dev/loop0'); // an operator thaws it (loopvol check saw a frozen filesystem it cannot explain)
    await guard.round(); // frozen again, recorded, then confirmed
    expect(await w.d.nodes.fenced(NODE, w.d.bootId)).toMatchObject([{ volumeId: id, device: '/dev/loop0' }]);
    expect((await revoked(w, id))?.fencedAt).toMatch(/froze its filesystem for good/);
    expect([...w.host.frozen]).toEqual(['/dev/loop0']);
  });

  it('records a freeze made while the record could not be read once it is repaired, then confirms', async () => {
    const { w, id } = await takenFromNode();
    const file = w.pool.layout.nodeFenced(NODE);
    await fs.mkdir(path.dirname(file), { recursive: true });
    await fs.writeFile(file, 'not json');
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round(); // frozen; nothing recorded, nothing confirmed
    expect({ fencedAt: (await revoked(w, id))?.fencedAt, frozen: [...w.host.frozen] }).toEqual({
      fencedAt: undefined,
      frozen: ['/dev/loop0'],
    });
    await fs.writeFile(file, '[]\n'); // repaired
    await guard.round();
    expect(await w.d.nodes.fenced(NODE, w.d.bootId)).toMatchObject([{ volumeId: id, device: '/dev/loop0' }]);
    expect((await revoked(w, id))?.fencedAt).toMatch(/froze its filesystem for good/);
  });

  it("forgets a freeze it could not record once the volume is settled: someone else's freeze of its next staging is not taken for it", async () => {
    const { w, id, guard } = await recordFailing(1);
    await guard.round(); // frozen; its record not written
    w.host.frozen.delete('/dev/loop0'); // thawed by hand, then the kubelet tears the pod down
    expect(await codeOf(unpublish(w, id))).toBe('OK');
    expect(await codeOf(unstage(w, id))).toBe('OK');
    await guard.round(); // settled
    // Back on this node, taken again while a backup hook has its filesystem frozen.
    await attachTo(w, id);
    await stage(w, id);
    await publish(w, id);
    await w.volumes.unpublish(id, NODE);
    w.host.frozen.add('/dev/loop0');
    await guard.round();
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
  });

  it('stages nothing while the record of fenced filesystems cannot be read', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await fs.mkdir(path.dirname(w.pool.layout.nodeFenced(NODE)), { recursive: true });
    await fs.writeFile(w.pool.layout.nodeFenced(NODE), 'not json');
    expect(await codeOf(stage(w, id))).toBe('FAILED_PRECONDITION');
    expect(w.host.ops).toEqual([]);
  });

  it("freezes a volume taken from this node on a device number another volume's fence had (identities unknown: by path)", async () => {
    const { w, id } = await takenFromNode();
    w.host.identityReadable = false;
    await w.d.nodes.setFenced(NODE, [otherVolumesFence(w)]);
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect([...w.host.frozen]).toEqual(['/dev/loop0']);
    expect((await revoked(w, id))?.fencedAt).toMatch(/froze its filesystem for good/);
  });

  it("counts a device as a volume's fence only by that volume's entries when it skips freezing or a copy's freeze", async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    const guard = guardOf(w);
    await w.d.nodes.setFenced(NODE, [otherVolumesFence(w)]);
    await guard.prepare();
    const loop = { ...(w.host.attached.get('loop0') as LoopDevice), backing: undefined }; // unknown identity: by path
    expect([guard.isFenced(loop, id), guard.isFenced(loop, 'vol-other'), guard.isFenced(loop)]).toEqual([
      false,
      true,
      true,
    ]);
  });

  it('still freezes a writable mount of a volume released without its word (seen silent, or by an operator)', async () => {
    const { w, id } = await takenFromNode();
    await w.volumes.markFenced(id, NODE, 'released by an operator');
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect(w.host.frozen.size).toBe(1);
    // The release stays as the operator made it, and the node is done with the volume.
    expect((await revoked(w, id))?.fencedAt).toContain('released by an operator');
    expect(await w.d.nodes.revocations(NODE)).toEqual([]);
  });

  it('confirms nothing while a filesystem of the volume is active here with no mount it can see', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    // The host's mounts are gone, but a mount namespace that outlived them (a container's) still holds
    // the filesystem, so the device stays: unstage says so and keeps the lease.
    w.host.heldElsewhere.add('/dev/loop0');
    expect(await codeOf(unpublish(w, id))).toBe('OK');
    expect(await codeOf(unstage(w, id))).toBe('FAILED_PRECONDITION');
    await w.volumes.unpublish(id, NODE); // the CO force-detaches the node
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    expect(await w.d.nodes.revocations(NODE)).toEqual([id]);
    // Once it ends, the device is the node's to let go of, and it confirms.
    w.host.heldElsewhere.delete('/dev/loop0');
    await guard.round();
    expect((await revoked(w, id))?.fencedAt).toContain('nothing of it was writable here');
  });

  it('confirms at once when nothing of the volume is writable here (the node rebooted)', async () => {
    const { w, id } = await takenFromNode();
    const rebooted = { ...w, d: { ...w.d, host: new FakeHost(), bootId: 'next-boot' } };
    const guard = guardOf(rebooted);
    await guard.prepare();
    await guard.round();
    expect(rebooted.d.host instanceof FakeHost && rebooted.d.host.ops).toEqual([]);
    expect((await revoked(w, id))?.fencedAt).toMatch(/nothing of it was writable here/);
    expect(await w.d.nodes.revocations(NODE)).toEqual([]);
  });

  it('neither claims nor thaws a filesystem frozen by someone else, and fences it once they thaw it', async () => {
    const { w, id } = await takenFromNode();
    const guard = guardOf(w);
    await guard.prepare();
    w.host.failNext('freeze', BUSY);
    await guard.round();
    expect(w.host.ops.filter((o) => /^(freeze|thaw)/.test(o))).toEqual([
      expect.stringMatching(/\(failed\)$/),
    ]);
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    expect(await w.d.nodes.revocations(NODE)).toEqual([id]);
    expect(await w.d.nodes.fenced(NODE, w.d.bootId)).toEqual([]);
    await guard.round();
    expect((await revoked(w, id))?.fencedAt).toMatch(/froze its filesystem for good/);
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
  });

  it('waits while a call on the volume holds its key', async () => {
    const { w, id } = await takenFromNode();
    const keys = new InFlight();
    const guard = guardOf(w, keys);
    await guard.prepare();
    const call = keys.tryAcquire([nodeKey(id)], 'NodeUnstageVolume');
    if (typeof call !== 'function') throw new Error('the key was busy');
    await guard.round();
    expect(w.host.ops.some((o) => o.startsWith('freeze'))).toBe(false);
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    call();
    await guard.round();
    expect((await revoked(w, id))?.fencedAt).toMatch(/froze/);
  });

  it('holds a raw block volume attached for writing until this node unstages it', async () => {
    const { w, id } = await takenFromNode(block);
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect(w.host.ops.some((o) => o.startsWith('freeze'))).toBe(false);
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    expect(await w.d.nodes.revocations(NODE)).toEqual([id]);
    expect(await codeOf(unpublish(w, id))).toBe('OK');
    expect(await codeOf(unstage(w, id))).toBe('OK');
    await guard.round();
    const mine = (await w.volumes.leases(id)).find((l) => l.node === NODE);
    expect(mine === undefined || mine.fencedAt !== undefined).toBe(true);
    expect(await w.d.nodes.revocations(NODE)).toEqual([]);
  });

  it('with an unreadable record of fences thaws nothing at start, and fences without confirming', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    w.host.frozen.add('/dev/loop0'); // left frozen by an earlier run
    const file = w.pool.layout.nodeFenced(NODE);
    await fs.writeFile(file, '{ torn');
    const guard = guardOf(w);
    await guard.prepare();
    expect(await thawLeftovers(w.d, w.x, guard)).toBe(0);
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
    expect(await fs.readFile(file, 'utf8')).toBe('{ torn');
    w.host.frozen.delete('/dev/loop0');
    await w.volumes.unpublish(id, NODE);
    await guard.round();
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    expect(await w.d.nodes.revocations(NODE)).toEqual([id]);
  });

  it('still knows a fence recorded while losetup could not be read once it can: never thawed at start', async () => {
    const { w, id } = await takenFromNode();
    w.host.identityReadable = false;
    const guard = guardOf(w);
    await guard.prepare();
    // Killed once the fence was recorded, before it was confirmed.
    w.volumes.markFenced = () => Promise.reject(new Error('killed'));
    await guard.round();
    expect(await w.d.nodes.fenced(NODE, w.d.bootId)).toMatchObject([{ volumeId: id, backingDev: '' }]);
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    w.host.identityReadable = true; // the plugin restarted, and losetup answers again
    const next = guardOf(w);
    await next.prepare();
    expect(await thawLeftovers(w.d, w.x, next)).toBe(0);
    expect([...w.host.frozen]).toEqual(['/dev/loop0']);
  });

  it('thaws at start what a killed run left frozen, also on a volume taken from this node but not yet fenced', async () => {
    const w = await world();
    const live = await newVolume(w);
    await stage(w, live.id);
    w.host.frozen.add('/dev/loop0');
    const guard = guardOf(w);
    await guard.prepare();
    expect(await thawLeftovers(w.d, w.x, guard)).toBe(1);
    expect(w.host.frozen.size).toBe(0);
    await w.volumes.unpublish(live.id, NODE);
    w.host.frozen.add('/dev/loop0');
    expect(await thawLeftovers(w.d, w.x, guard)).toBe(1);
    await guard.round(); // then fenced: frozen by this node, for good
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
    expect((await revoked(w, live.id))?.fencedAt).toMatch(/froze/);
  });
});

/** A freeze agent on `w` with its guard, and a board to post requests on. */
async function agentOf(w: World, keys = new InFlight()) {
  const guard: Guard = guardOf(w, keys);
  await guard.prepare();
  const board = new QuiesceBoard(w.pool);
  const agent = new QuiesceAgent(w.d, board, keys, guard, noCommands, log);
  await agent.prepare();
  /** Ticks until the node answered `r` (the freeze runs beside the loop). */
  const answered = async (r: QuiesceRequest) => {
    for (let i = 0; i < 200; i++) {
      await agent.tick();
      const a = await board.answer(NODE, r);
      if (a) return a;
      await new Promise((res) => setTimeout(res, 5));
    }
    throw new Error('no answer');
  };
  return { guard, board, agent, answered, keys };
}

/** A staged volume whose filesystem the agent froze for request `r` (ttl `ttlMs`). */
async function frozenFor(ttlMs: number) {
  const w = await world();
  const { id } = await newVolume(w);
  await stage(w, id);
  const parts = await agentOf(w);
  const r = await parts.board.post(NODE, id, ttlMs, 'test', 'snapshot');
  expect(await parts.answered(r)).toMatchObject({ state: 'frozen' });
  return { w, r, ...parts };
}

describe('a stage that races a detach', () => {
  it('takes no lease once the volume was detached from its node, until it is published there again', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await attachTo(w, id); // the CO attaches, kubelet starts NodeStageVolume…
    await w.volumes.unpublish(id, NODE); // …and the detach lands before the stage takes its lease
    expect(await codeOf(stage(w, id))).toBe('FAILED_PRECONDITION');
    expect(await w.volumes.leases(id)).toEqual([]);
    expect([...w.host.attached.keys()]).toEqual([]);
    // Published to it again, the node stages as usual.
    await attachTo(w, id);
    expect(await codeOf(stage(w, id))).toBe('OK');
  });
});

describe('a lease left by a node on another host', () => {
  /**
   * The volume lived on node-c, which was force-detached and confirmed (its revoked lease stays until
   * node-c unstages, which a dead node never does), then moved to NODE. Kubelet's staging path is the
   * same on both hosts.
   */
  async function movedFromAnotherHost() {
    const { w, c, id } = await takenFromAnotherHost();
    const gc = new FenceGuard(c.d, c.pool, new InFlight(), noCommands, log);
    await gc.prepare();
    await gc.round();
    expect((await w.volumes.leases(id)).find((l) => l.node === 'node-c')?.fencedAt).toBeDefined();
    await stage(w, id);
    await publish(w, id);
    return { w, id };
  }

  it("never hides this node's own staging: a force-detach here still freezes it", async () => {
    const { w, id } = await movedFromAnotherHost();
    await w.volumes.unpublish(id, NODE);
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect(w.host.frozen.size).toBe(1);
    expect((await revoked(w, id))?.fencedAt).toBeDefined();
  });

  /** NODE's loop0, as sysfs and losetup show it after the pool was mounted again on this host. */
  const remounted = (w: World, over: { identity?: { dev: string; ino: string }; shown?: string } = {}) => {
    const loop = w.host.attached.get('loop0');
    if (!loop) throw new Error('loop0 is not attached');
    loop.identity = over.identity ?? { dev: '0:99', ino: '7' }; // the old connection's file
    if (over.shown !== undefined) loop.backingFile = over.shown;
  };

  it('still knows its staging after the pool was mounted again (the image has another identity): freezes, then confirms', async () => {
    const { w, id } = await takenFromNode();
    remounted(w, { shown: `/volumes/${id}/disk.img` });
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect(w.host.frozen.size).toBe(1);
    expect((await revoked(w, id))?.fencedAt).toMatch(/froze its filesystem for good/);
    // Its kubelet's teardown: the pod's bind goes, the fenced staging waits for a reboot.
    expect(await codeOf(unpublish(w, id))).toBe('OK');
    expect(await codeOf(unstage(w, id))).toBe('FAILED_PRECONDITION');
  });

  it('releases its staging after the pool was mounted again: unpublish and unstage tear it down', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    remounted(w);
    expect(await codeOf(unpublish(w, id))).toBe('OK');
    expect(await codeOf(unstage(w, id))).toBe('OK');
    expect(w.host.table).toEqual([]);
    expect([...w.host.attached.keys()]).toEqual([]);
    expect(await w.volumes.lease(id, NODE)).toBeUndefined();
  });

  it('confirms nothing, and tears nothing down, while a device at its staging path may be the volume', async () => {
    const { w, id } = await takenFromNode();
    // Neither its identity (losetup cannot say) nor its path (another file's) shows it as the volume's.
    remounted(w, { shown: '/elsewhere/disk.img' });
    w.host.identityReadable = false;
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect(w.host.frozen.size).toBe(0);
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    expect(await w.d.nodes.revocations(NODE)).toEqual([id]);
    const from = w.host.ops.length;
    expect(await codeOf(unpublish(w, id))).toBe('FAILED_PRECONDITION');
    expect(await codeOf(unstage(w, id))).toBe('FAILED_PRECONDITION');
    expect(w.host.ops.slice(from)).toEqual([]);
  });

  it('stages again on the device its lease records after the pool was mounted again, never on a second one', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    remounted(w);
    // A filesystem: the staging mount shows which device it is, and the repeat is answered as done.
    expect(await during(w, () => stage(w, id))).toEqual({ code: 'OK', ops: [] });
    const b = await world();
    const raw = await newVolume(b);
    await stage(b, raw.id, block);
    remounted(b);
    // A raw block device is at no staging mount: it may be the volume, so nothing is attached beside it.
    expect(await during(b, () => stage(b, raw.id, block))).toEqual({ code: 'FAILED_PRECONDITION', ops: [] });
    expect([...b.host.attached.keys()]).toEqual(['loop0']);
    expect(await b.volumes.lease(raw.id, NODE)).toMatchObject({ device: 'loop0' });
  });

  it("lets a device at its staging path go as another's only when its identity and path both say so", async () => {
    const { w, id } = await takenFromNode();
    remounted(w, { shown: '/other-pool/volumes/vol-00000000000000000000000000000000/disk.img' });
    const guard = guardOf(w);
    await guard.prepare();
    await guard.round();
    expect(w.host.frozen.size).toBe(0);
    expect((await revoked(w, id))?.fencedAt).toMatch(/nothing of it was writable here/);
    expect(await codeOf(unpublish(w, id))).toBe('FAILED_PRECONDITION');
  });

  it("never hides this node's own staging: unpublish and unstage tear it down", async () => {
    const { w, id } = await movedFromAnotherHost();
    expect(await codeOf(unpublish(w, id))).toBe('OK');
    expect(await codeOf(unstage(w, id))).toBe('OK');
    expect(w.host.table).toEqual([]);
    expect([...w.host.attached.keys()]).toEqual([]);
  });
});

describe('freezes for copies', () => {
  it('never thaws a filesystem someone else froze (the freeze says busy)', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    const { board, agent, answered } = await agentOf(w);
    const r = await board.post(NODE, id, 60_000, 'test', 'snapshot');
    w.host.failNext('freeze', BUSY);
    expect(await answered(r)).toMatchObject({
      state: 'failed',
      message: expect.stringMatching(/frozen by someone else/) as unknown,
    });
    await agent.stop();
    expect(w.host.ops.some((o) => o.startsWith('thaw'))).toBe(false);
  });

  it("freezes and thaws a copy's volume on a device number another volume's fence had (identities unknown: by path)", async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await w.d.nodes.setFenced(NODE, [otherVolumesFence(w)]);
    w.host.identityReadable = false;
    const { board, agent, answered } = await agentOf(w);
    const r = await board.post(NODE, id, 50, 'test', 'snapshot');
    // "Frozen for good (fenced)" here would let the copy read a filesystem pods still write.
    expect(await answered(r)).toEqual({ volumeId: id, state: 'frozen', message: 'frozen for at most 1 s' });
    expect(w.host.ops.filter((o) => o.startsWith('freeze'))).toHaveLength(1);
    await new Promise((res) => setTimeout(res, 80));
    await agent.tick();
    // Left frozen as if fenced, the volume's writes would hang until a reboot.
    expect(w.host.frozen.size).toBe(0);
    await agent.stop();
  });

  /** The answer to a copy's freeze of a published volume while NODE's record of fences cannot be read. */
  async function answerWithoutFences(hidden: boolean) {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    if (hidden) {
      // The host's mounts are gone; a pod's mount namespace still has the filesystem mounted.
      w.host.table.splice(0, w.host.table.length);
      w.host.heldElsewhere.add('/dev/loop0');
    }
    await fs.mkdir(path.dirname(w.pool.layout.nodeFenced(NODE)), { recursive: true });
    await fs.writeFile(w.pool.layout.nodeFenced(NODE), 'not json');
    const { board, agent, answered } = await agentOf(w);
    const answer = await answered(await board.post(NODE, id, 60_000, 'test', 'snapshot'));
    await agent.stop();
    return { w, answer };
  }

  it('freezes nothing for a copy while its record of fences cannot be read (it may be a fence), and answers failed', async () => {
    const { w, answer } = await answerWithoutFences(false);
    // "Frozen for good (fenced)" unfrozen would let the copy read a filesystem its pod still writes.
    expect(answer).toMatchObject({
      state: 'failed',
      message: expect.stringMatching(/record of fenced filesystems cannot be read/) as unknown,
    });
    expect(w.host.ops.filter((o) => o.startsWith('freeze') || o.startsWith('thaw'))).toEqual([]);
  });

  it('answers failed, never not-staged, for a filesystem active where it cannot see while its record of fences cannot be read', async () => {
    const { answer } = await answerWithoutFences(true);
    expect(answer).toMatchObject({
      state: 'failed',
      message: expect.stringMatching(/no mount this node plugin can see/) as unknown,
    });
  });

  it('answers failed, never not-staged, while a filesystem of the volume is active in a namespace it cannot see', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    // The host's mounts are gone; a pod's mount namespace still has the filesystem mounted.
    w.host.table.splice(0, w.host.table.length);
    w.host.heldElsewhere.add('/dev/loop0');
    const { board, agent, answered } = await agentOf(w);
    const r = await board.post(NODE, id, 60_000, 'test', 'snapshot');
    // 'not-staged' would let the controller byte-copy a volume a pod writes.
    expect(await answered(r)).toMatchObject({
      state: 'failed',
      message: expect.stringMatching(/no mount this node plugin can see/) as unknown,
    });
    await agent.stop();
  });

  it('thaws when its time is up even if the answer cannot be written', async () => {
    const { w, board, agent } = await frozenFor(50);
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
    board.writeAnswers = () => Promise.reject(new Error('ENOSPC'));
    await new Promise((res) => setTimeout(res, 80));
    await agent.tick();
    expect(w.host.frozen.has('/dev/loop0')).toBe(false);
    await agent.stop();
  });

  it('thaws when its time is up even if writing the answer hangs (a pool gone under a hard mount)', async () => {
    const { w, board, agent } = await frozenFor(50);
    board.writeAnswers = () => new Promise(() => undefined);
    await new Promise((res) => setTimeout(res, 80));
    await Promise.race([agent.tick(), new Promise((res) => setTimeout(res, 3000))]);
    expect(w.host.frozen.has('/dev/loop0')).toBe(false);
  });

  it('thaws when its time is up while its rounds hang on the pool (reads and writes)', async () => {
    const { w, board, agent } = await frozenFor(300);
    const hang = () => new Promise<never>(() => undefined);
    board.requests = hang;
    board.writeAnswers = hang;
    agent.run();
    for (let i = 0; i < 100 && w.host.frozen.has('/dev/loop0'); i++)
      await new Promise((res) => setTimeout(res, 30));
    expect(w.host.frozen.has('/dev/loop0')).toBe(false);
  });

  it("an expiry under way never thaws the volume's next freeze (the retry after a withdrawn request)", async () => {
    const { w, r, board, agent } = await frozenFor(200);
    const write = board.writeAnswers.bind(board);
    const sleep = (ms: number) => new Promise((res) => setTimeout(res, ms));
    board.writeAnswers = async (node, answers) => {
      const now = new Map(answers);
      await sleep(1500); // a slow pool: the expiry waits 1 s for its write, then thaws
      await write(node, now);
    };
    agent.run(); // the watchdog starts the expiry
    await sleep(450);
    // The controller gave up on r (its copy ran out) and retries at once.
    await board.withdraw(NODE, r);
    const r2 = await board.post(NODE, r.volumeId, 60_000, 'test', 'snapshot again');
    let a2;
    for (let i = 0; i < 100 && a2?.state !== 'frozen'; i++) {
      await sleep(50);
      a2 = await board.answer(NODE, r2);
    }
    const frozenWhileAnswered = w.host.frozen.has('/dev/loop0');
    board.writeAnswers = write;
    await agent.stop();
    expect({ answer: a2?.state, frozenWhileAnswered }).toEqual({
      answer: 'frozen',
      frozenWhileAnswered: true,
    });
  });

  it('says "expired" before it thaws when the plugin stops, so no copy under the freeze is taken for frozen', async () => {
    const { w, r, board, agent } = await frozenFor(60_000);
    const write = board.writeAnswers.bind(board);
    const seen: string[] = [];
    board.writeAnswers = async (node, answers) => {
      seen.push(`${answers.get(r.requestId)?.state ?? '-'} frozen=${w.host.frozen.has('/dev/loop0')}`);
      await write(node, answers);
    };
    await agent.stop();
    expect(seen[0]).toBe('expired frozen=true');
    expect(w.host.frozen.has('/dev/loop0')).toBe(false);
  });

  it('never loses an answer made while the answers are being written', async () => {
    const w = await world();
    const ids = [(await newVolume(w)).id, (await newVolume(w)).id];
    for (const [i, id] of ids.entries()) {
      const staging = `${STAGING}-${i}`;
      w.host.addPath(staging);
      await stage(w, id, {}, staging);
    }
    const { board, agent, answered } = await agentOf(w);
    const write = board.writeAnswers.bind(board);
    // Each write takes a while (what it writes is read when it starts, as the real one does), so
    // that freezes started beside the loop answer during one.
    board.writeAnswers = async (node, answers) => {
      const now = new Map(answers);
      await new Promise((res) => setTimeout(res, 15));
      await write(node, now);
    };
    // Back-to-back copies: the next request is posted as the previous one is withdrawn, so one round
    // both drops the old answer (a write) and starts the new freeze, which answers during that write.
    let unanswered = 0;
    let previous: QuiesceRequest | undefined;
    for (let i = 0; i < 12; i++) {
      if (previous) await board.withdraw(NODE, previous);
      const r = await board.post(NODE, ids[i % 2] ?? '', 60_000, 'test', `copy ${i}`);
      const a = await answered(r).catch(() => undefined);
      if (!a) unanswered++;
      previous = r;
    }
    await agent.stop();
    expect(unanswered).toBe(0);
  });

  it('keeps the volume (no unstage) and thaws again until a failed thaw succeeds', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    const keys = new InFlight();
    const { board, agent, answered } = await agentOf(w, keys);
    const r = await board.post(NODE, id, 60_000, 'test', 'snapshot');
    expect(await answered(r)).toMatchObject({ state: 'frozen' });
    await board.withdraw(NODE, r);
    w.host.failNext('thaw');
    await agent.tick();
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
    expect(typeof keys.tryAcquire([nodeKey(id)], 'NodeUnstageVolume')).toBe('object');
    await agent.tick();
    expect(w.host.frozen.has('/dev/loop0')).toBe(false);
    const got = keys.tryAcquire([nodeKey(id)], 'NodeUnstageVolume');
    expect(typeof got).toBe('function');
    if (typeof got === 'function') got();
    await agent.stop();
  });

  it('holds fencing off while it holds the volume, which is fenced once the copy is done', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    const { board, agent, answered, guard } = await agentOf(w);
    const r = await board.post(NODE, id, 60_000, 'test', 'snapshot');
    expect(await answered(r)).toMatchObject({ state: 'frozen' });
    await w.volumes.unpublish(id, NODE);
    await guard.round();
    expect((await revoked(w, id))?.fencedAt).toBeUndefined();
    await board.withdraw(NODE, r);
    await agent.tick();
    await guard.round();
    expect((await revoked(w, id))?.fencedAt).toMatch(/froze/);
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
    await agent.stop(); // stopping thaws its own freezes, never a fence
    expect(w.host.frozen.has('/dev/loop0')).toBe(true);
  });
});

describe('a burst of publishes to one node', () => {
  /** The ids of `n` new volumes. */
  function volumeIds(w: World, n: 3): Promise<[string, string, string]>;
  function volumeIds(w: World, n: 4): Promise<[string, string, string, string]>;
  function volumeIds(w: World, n: number): Promise<string[]>;
  function volumeIds(w: World, n: number): Promise<string[]> {
    return Promise.all(Array.from({ length: n }, async () => (await newVolume(w)).id));
  }

  /** What a ControllerPublishVolume of a single-node writer to NODE records. */
  const WRITER = {
    node: NODE,
    readonly: false,
    accessType: 'mount',
    mode: 'SINGLE_NODE_WRITER',
    since: 'x',
  } as const;

  it('queues them in this process: none is ABORTED, and the node limit holds exactly', async () => {
    const w = await world();
    const ids = await volumeIds(w, 48);
    const codes = await Promise.all(ids.map((id) => codeOf(w.volumes.publish(id, WRITER, 40))));
    const count = (c: string) => codes.filter((x) => x === c).length;
    expect({ ok: count('OK'), exhausted: count('RESOURCE_EXHAUSTED'), aborted: count('ABORTED') }).toEqual({
      ok: 40,
      exhausted: 8,
      aborted: 0,
    });
    expect(await w.d.nodes.attachedVolumes(NODE)).toHaveLength(40);
  }, 60_000);

  /**
   * Publishes `first` alone to NODE (limit `max`), held in its batch until `batch` are all queued behind
   * it in their order, so that they form the next batch; index writes of `bad` fail. Their codes.
   */
  async function nextBatch(
    w: World,
    first: string,
    batch: string[],
    bad: string,
    max: number,
  ): Promise<string[]> {
    const nodes = w.d.nodes as unknown as { addAttached: (n: string, v: string) => Promise<void> };
    const orig = nodes.addAttached.bind(nodes);
    let open!: () => void;
    const gate = new Promise<void>((r) => (open = r));
    let reached!: () => void;
    const atGate = new Promise<void>((r) => (reached = r));
    nodes.addAttached = async (n, v) => {
      if (v === first) {
        reached();
        await gate;
      }
      if (v === bad) throw new Error('EIO writing the index');
      return orig(n, v);
    };
    // A publish reaches the node's queue after its own checks, which take their time: wait for each.
    const queue = vi.spyOn(Turns.prototype, 'run');
    const inQueue = async (id: string) => {
      while (!queue.mock.calls.some((c) => (c[2] as { id: string }).id === id))
        await new Promise((r) => setTimeout(r, 5));
    };
    try {
      const codes = [codeOf(w.volumes.publish(first, WRITER, max))];
      await atGate;
      for (const id of batch) {
        codes.push(codeOf(w.volumes.publish(id, WRITER, max)));
        await inQueue(id);
      }
      open();
      return await Promise.all(codes);
    } finally {
      queue.mockRestore();
    }
  }

  it('a member that fails once admitted does not leave a later member of its batch refused', async () => {
    const w = await world();
    const [first, bad, good] = await volumeIds(w, 3);
    expect(await nextBatch(w, first, [bad, good], bad, 2)).toEqual(['OK', 'INTERNAL', 'OK']);
  });

  it('a batch whose second round cannot count fails only those still waiting, not those done', async () => {
    const w = await world();
    const [first, done, bad, waiting] = await volumeIds(w, 4);
    // The index can be listed for the first round of the second batch, not for its second round.
    const nodes = w.d.nodes as unknown as { attachedVolumes: (n: string) => Promise<string[]> };
    const list = nodes.attachedVolumes.bind(nodes);
    let lists = 0;
    nodes.attachedVolumes = async (n) => {
      if (++lists === 3) throw new Error('EIO listing the index');
      return list(n);
    };
    expect(await nextBatch(w, first, [done, bad, waiting], bad, 3)).toEqual([
      'OK',
      'OK',
      'INTERNAL',
      'INTERNAL',
    ]);
    expect((await w.volumes.attachments(done)).map((x) => x.node)).toEqual([NODE]);
  });

  it("counts, once a controller started, attachments an older release's index lost", async () => {
    const w = await world();
    const a = (await newVolume(w)).id;
    const b = (await newVolume(w)).id;
    await w.volumes.publish(a, WRITER, 2);
    await w.volumes.publish(b, WRITER, 2);
    // The race of releases before the index scheme: a count dropped b's entry before b's attachment was written.
    await w.d.nodes.removeAttached(NODE, b);
    const { added } = await w.volumes.repairNodeIndex(); // what a controller does when it starts
    const c = (await newVolume(w)).id;
    expect({
      added,
      code: await codeOf(w.volumes.publish(c, WRITER, 2)),
      index: (await w.d.nodes.attachedVolumes(NODE)).sort(),
    }).toEqual({ added: 1, code: 'RESOURCE_EXHAUSTED', index: [a, b].sort() });
  });

  it('admits nothing while the start-up check of the index runs, and skips a volume it cannot read', async () => {
    const w = await world();
    const [a, b, c, broken] = await volumeIds(w, 4);
    await w.volumes.publish(a, WRITER, 2);
    await w.volumes.publish(b, WRITER, 2);
    await w.d.nodes.removeAttached(NODE, b); // lost by an older release
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const attachments = w.volumes.attachments.bind(w.volumes);
    w.volumes.attachments = async (id) => {
      if (id === broken) throw new Error('EIO');
      if (id !== c) await gate; // the check of the index stalls; the publish's own reads do not
      return attachments(id);
    };
    const repair = w.volumes.repairNodeIndex();
    let answered = false;
    const publish = codeOf(w.volumes.publish(c, WRITER, 2)).finally(() => (answered = true));
    await new Promise((r) => setTimeout(r, 200));
    const waited = !answered;
    release();
    expect({ waited, code: await publish, repair: await repair }).toEqual({
      waited: true,
      code: 'RESOURCE_EXHAUSTED',
      repair: { added: 1, unreadable: [broken] },
    });
  });

  it('at the limit, index entries left by publishes killed half-way are checked and dropped, not counted', async () => {
    const w = await world();
    // Three publishes killed after indexing the volume on the node, before writing its attachment.
    for (let i = 0; i < 3; i++) await w.d.nodes.addAttached(NODE, (await newVolume(w)).id);
    const one = (await newVolume(w)).id;
    const two = (await newVolume(w)).id;
    expect({
      first: await codeOf(w.volumes.publish(one, WRITER, 3)),
      second: await codeOf(w.volumes.publish(two, WRITER, 2)),
      third: await codeOf(w.volumes.publish((await newVolume(w)).id, WRITER, 2)),
      index: (await w.d.nodes.attachedVolumes(NODE)).sort(),
    }).toEqual({ first: 'OK', second: 'OK', third: 'RESOURCE_EXHAUSTED', index: [one, two].sort() });
  });
});
