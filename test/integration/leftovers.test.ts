/**
 * What crashed creations left is cleared by the controller (pool/leftovers.ts): a "creating" volume,
 * snapshot or group snapshot (with its members) that two looks saw unchanged, whose lock nobody holds.
 * What may stand for data, or is someone's at work, stays: a damaged record, a directory without a
 * record (an operator copying a volume back), a group snapshot's member on its own, a creation whose
 * lock is held or that changed. On a real pool.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { busy } from '../../src/errors.js';
import type { HeldLock } from '../../src/pool/lock.js';
import { LeftoverSweeper, startDiscarding } from '../../src/pool/leftovers.js';
import { log } from '../helpers/node-world.js';
import {
  type ControllerWorld,
  controllerWorld,
  removeControllerWorlds,
  volumeIdOf,
} from '../helpers/controller-world.js';
import { TestEnv } from '../helpers/env.js';

const env = new TestEnv();
afterAll(async () => {
  await removeControllerWorlds();
  expect(await env.teardown()).toEqual([]);
});

/** Rewrites a record as a crash at creation would have left it. */
async function edit(file: string, change: Record<string, unknown>): Promise<void> {
  const v = JSON.parse(await fs.readFile(file, 'utf8')) as Record<string, unknown>;
  await fs.writeFile(file, JSON.stringify({ ...v, ...change }));
}

const present = async (dir: string): Promise<boolean> =>
  fs.access(dir).then(
    () => true,
    () => false,
  );

async function leftovers(w: ControllerWorld) {
  const l = w.pool.layout;
  const volume = async (name: string): Promise<string> => volumeIdOf(await w.CreateVolume(name));
  const ids = await Promise.all(
    ['creating', 'ready', 'damaged', 'held', 'restoring', 'changing'].map(volume),
  );
  const [creating, ready, damaged, held, restoring, changing] = ids as [
    string,
    string,
    string,
    string,
    string,
    string,
  ];
  const snap = async (name: string): Promise<string> =>
    (await w.CreateSnapshot(name, ready)).snapshot?.snapshot_id ?? '';
  const snapCreating = await snap('snap-creating');
  const member = await snap('snap-member');

  for (const id of [creating, held, changing]) {
    await edit(l.volumeMeta(id), { state: 'creating' });
    await fs.rename(l.volumeImage(id), l.volumeImageTemp(id));
  }
  await fs.writeFile(l.volumeMeta(damaged), '{"torn');
  // An operator copying a volume back (rsync: the image into a dot file first, the record last).
  await fs.rm(l.volumeMeta(restoring));
  await fs.rename(l.volumeImage(restoring), path.join(l.volumeDir(restoring), '.disk.img.Xy12Ab'));
  await edit(l.snapshotMeta(snapCreating), { state: 'creating' });
  await edit(l.snapshotMeta(member), { state: 'creating', groupSnapshotId: 'group-of-another-call' });
  return {
    gone: [l.volumeDir(creating), l.snapshotDir(snapCreating)],
    kept: [l.volumeDir(ready), l.volumeDir(damaged), l.volumeDir(restoring), l.snapshotDir(member)],
    held,
    changing,
  };
}

describe('unfinished creations a crash left', () => {
  it('are discarded when two looks saw them unchanged and nobody holds them; what may hold data, or is at work, stays', async () => {
    const w = await controllerWorld();
    const { gone, kept, held, changing } = await leftovers(w);
    const l = w.pool.layout;
    const sweeper = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    // The first look only notes them.
    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 4 });
    for (const d of [...gone, ...kept]) expect(await present(d)).toBe(true);

    // One is written meanwhile (someone is at work on it), one is held.
    await fs.appendFile(l.volumeImageTemp(changing), Buffer.alloc(4096, 1));
    const second = await w.pool.withLock(held, 'a create at work', () => sweeper.look());
    expect(second.discarded.sort()).toEqual([...gone].sort());
    for (const d of gone) expect(await present(d)).toBe(false);
    for (const d of [...kept, l.volumeDir(held), l.volumeDir(changing)]) expect(await present(d)).toBe(true);

    // Unchanged and free at the next look: they go too.
    expect((await sweeper.look()).discarded.sort()).toEqual(
      [l.volumeDir(held), l.volumeDir(changing)].sort(),
    );
    for (const d of kept) expect(await present(d)).toBe(true);
  });

  /**
   * Two volumes, a finished group snapshot of them, a standalone snapshot, and a group a crash
   * interrupted while its second member was copied: the group and both members say "creating", the
   * first member's image is complete, the second's still the partial one.
   */
  async function interruptedGroup(w: ControllerWorld) {
    const l = w.pool.layout;
    const a = volumeIdOf(await w.CreateVolume('ga'));
    const b = volumeIdOf(await w.CreateVolume('gb'));
    const group = async (name: string) => {
      const g = (await w.CreateVolumeGroupSnapshot(name, [a, b])).group_snapshot;
      return {
        id: g?.group_snapshot_id ?? '',
        members: (g?.snapshots ?? []).map((s) => s.snapshot_id ?? ''),
      };
    };
    const unfinished = await group('unfinished');
    const done = await group('done');
    const standalone = (await w.CreateSnapshot('standalone', a)).snapshot?.snapshot_id ?? '';
    expect(unfinished.members).toHaveLength(2);
    const [first, second] = unfinished.members as [string, string];
    await edit(l.groupMeta(unfinished.id), { state: 'creating' });
    for (const m of [first, second]) await edit(l.snapshotMeta(m), { state: 'creating' });
    await fs.rename(l.snapshotImage(second), l.snapshotImageTemp(second));
    return {
      unfinished,
      first,
      second,
      gone: [l.groupDir(unfinished.id), l.snapshotDir(first), l.snapshotDir(second)],
      kept: [l.groupDir(done.id), ...done.members.map((m) => l.snapshotDir(m)), l.snapshotDir(standalone)],
      standalone,
    };
  }

  it('an unfinished group snapshot goes with its members once two looks saw it, members included, unchanged and free; a finished one stays', async () => {
    const w = await controllerWorld();
    const l = w.pool.layout;
    const { unfinished, first, second, gone, kept, standalone } = await interruptedGroup(w);
    // A record edited by hand that lists another snapshot among the group's: that one is not the group's.
    await edit(l.groupMeta(unfinished.id), { snapshotIds: [first, second, standalone] });
    const sweeper = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    const all = async () => Promise.all([...gone, ...kept].map(present));

    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 1 });
    // A member's record rewritten meanwhile, then its partial image (a copy at work): each time the
    // group is not the one the last look saw.
    await edit(l.snapshotMeta(first), { sizeBytes: 1 });
    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 1 });
    await fs.appendFile(l.snapshotImageTemp(second), Buffer.alloc(4096, 1));
    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 1 });
    // Unchanged since, but held (a retried create at work).
    const held = await w.pool.withLock(unfinished.id, 'a create at work', () => sweeper.look());
    expect(held).toEqual({ discarded: [], waiting: 1 });
    expect(await all()).toEqual([...gone, ...kept].map(() => true));

    expect(await sweeper.look()).toEqual({ discarded: [l.groupDir(unfinished.id)], waiting: 0 });
    expect(await all()).toEqual([...gone.map(() => false), ...kept.map(() => true)]);
    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 0 });
  });

  it("a group snapshot's discard stopped by a member's lock is said and finished by later looks", async () => {
    const w = await controllerWorld();
    const { second, gone, kept } = await interruptedGroup(w);
    const sweeper = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 1 });
    // The second member's lock is held (a restore from it, say) when the discard comes to it: the first
    // member is gone by then, the group stays, and the look goes on.
    const warn = vi.spyOn(log, 'warn');
    const stopped = await w.pool.withLock(second, 'a restore at work', () => sweeper.look());
    expect(stopped).toEqual({ discarded: [], waiting: 0 });
    expect(warn.mock.calls.some(([, msg]) => String(msg).includes('could not look at or discard'))).toBe(
      true,
    );
    warn.mockRestore();
    expect(await present(gone[0] ?? '')).toBe(true);
    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 1 });
    expect((await sweeper.look()).discarded).toEqual([gone[0]]);
    expect(await Promise.all([...gone, ...kept].map(present))).toEqual([
      ...gone.map(() => false),
      ...kept.map(() => true),
    ]);
  });

  it('a group snapshot with a member whose record cannot be read is left to an operator', async () => {
    const w = await controllerWorld();
    const { first, gone } = await interruptedGroup(w);
    await fs.writeFile(w.pool.layout.snapshotMeta(first), '{"torn');
    const sweeper = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    // Not even noted, so no later look can discard it (each look reads the torn record a while).
    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 0 });
    expect(await Promise.all(gone.map(present))).toEqual(gone.map(() => true));
  });

  it("a group snapshot's delete commits nothing more once the group's lock is lost, up to its last step", async () => {
    // The lock is asked about after each member's record is read (its lock waited for), right before
    // each member goes, and before the group goes: lost at the n-th question.
    const left = [];
    for (const lostAt of [2, 3, 5]) {
      const w = await controllerWorld();
      const { unfinished, gone } = await interruptedGroup(w);
      let checks = 0;
      const lock: HeldLock = {
        signal: new AbortController().signal,
        assertHeld: () => {
          if (++checks >= lostAt) throw busy('lost');
        },
        release: () => Promise.resolve(),
      };
      await expect(w.snapshots.deleteGroup(unfinished.id, unfinished.members, lock)).rejects.toThrow('lost');
      left.push(await Promise.all(gone.map(present))); // [group, first member, second member]
    }
    expect(left).toEqual([
      [true, true, true], // lost while the first member's lock was waited for: nothing went
      [true, false, true], // the first member went while the lock was held
      [true, false, false], // both members went; the group stays
    ]);
  });

  it("what killed writers left in the pool's own directories goes once looks saw it unchanged long enough, whatever its times say", async () => {
    const w = await controllerWorld();
    const l = w.pool.layout;
    const vol = volumeIdOf(await w.CreateVolume('with-a-temp'));
    const left = [
      path.join(l.root, '.pool.json.tmp-00000000000a'),
      path.join(l.nodesDir, '.n1.alive.tmp-00000000000b'),
      path.join(l.locksDir, `.${vol}.lock.tmp-00000000000c`),
      path.join(l.locksDir, `${vol}.lock.stale-00000000000d`), // a lock moved aside to be broken
    ];
    const written = path.join(l.nodesDir, '.n2.alive.tmp-00000000000e'); // a writer at work
    const inVolume = path.join(l.volumeDir(vol), '.fences.json.tmp-00000000000f');
    const future = new Date(Date.now() + 24 * 3600_000); // another host's clock, far ahead
    for (const f of [...left, written, inVolume]) {
      await fs.writeFile(f, '{"torn');
      await fs.utimes(f, future, future);
    }
    const sweeper = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    const all = [...left, written, inVolume];
    // The first look only notes them; one unchanged since for the age given goes at a later look, and
    // one changed meanwhile counts from the look that saw it change.
    const age = 300;
    const pause = () => new Promise((r) => setTimeout(r, age + 50));
    expect(await sweeper.removeLeftTemps(age)).toEqual([]);
    await pause();
    await fs.appendFile(written, 'more');
    expect((await sweeper.removeLeftTemps(age)).sort()).toEqual([...left].sort());
    expect(await Promise.all(all.map(present))).toEqual([...left.map(() => false), true, true]);
    expect(await sweeper.removeLeftTemps(age)).toEqual([]);
    await pause();
    expect(await sweeper.removeLeftTemps(age)).toEqual([written]);
    // Not yet unchanged for an hour: stays.
    const young = path.join(l.nodesDir, '.n1.alive.tmp-000000000010');
    await fs.writeFile(young, '{"torn');
    const hourly = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    expect(await hourly.removeLeftTemps()).toEqual([]);
    expect(await hourly.removeLeftTemps()).toEqual([]);
    expect(await present(young)).toBe(true);
  });

  it('removes nothing through a directory of the pool that is a symlink', async () => {
    const w = await controllerWorld();
    const l = w.pool.layout;
    const elsewhere = await env.dir('leftovers-elsewhere');
    const theirs = path.join(elsewhere, '.x.json.tmp-000000000012');
    await fs.writeFile(theirs, "not the pool's");
    await fs.rm(l.nodesDir, { recursive: true });
    await fs.symlink(elsewhere, l.nodesDir);
    const sweeper = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    expect([await sweeper.removeLeftTemps(0), await sweeper.removeLeftTemps(0)]).toEqual([[], []]);
    expect(await present(theirs)).toBe(true);
  });

  it("removes what killed writers left from the controller's looks", async () => {
    const w = await controllerWorld();
    const temp = path.join(w.pool.layout.nodesDir, '.n1.alive.tmp-000000000011');
    await fs.writeFile(temp, '{"torn');
    const looks = startDiscarding(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log, 20, 0);
    try {
      for (let i = 0; i < 200 && (await present(temp)); i++) await new Promise((r) => setTimeout(r, 20));
      expect(await present(temp)).toBe(false);
    } finally {
      looks.stop();
      await looks.first;
    }
  });

  it('are looked for by a controller when it starts', async () => {
    const w = await controllerWorld();
    await leftovers(w);
    const base = await env.dir('leftovers');
    const d = await env.driver({ dir: base, mode: 'controller', poolDir: w.dir });
    expect(
      await d.waitForLog((l) => l.includes('unfinished creations seen') && l.includes('"count":4')),
    ).toBe(true);
    await d.stop();
  });
});
