/**
 * What crashed creations left is cleared by the controller (pool/leftovers.ts): a "creating" volume,
 * snapshot or group snapshot (with its members) that two looks saw unchanged, whose lock nobody holds.
 * What may stand for data, or is someone's at work, stays: a damaged record, a directory without a
 * record (an operator copying a volume back), a group snapshot's member on its own, a creation whose
 * lock is held or that changed. On a real pool.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { LeftoverSweeper } from '../../src/pool/leftovers.js';
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

  it('an unfinished group snapshot goes with its members once two looks saw it, members included, unchanged and free; a finished one stays', async () => {
    const w = await controllerWorld();
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
    expect(unfinished.members).toHaveLength(2);
    // A crash while the second member was copied: the group and that member say "creating", its
    // image is still the partial one.
    const [first, second] = unfinished.members as [string, string];
    await edit(l.groupMeta(unfinished.id), { state: 'creating' });
    await edit(l.snapshotMeta(second), { state: 'creating' });
    await fs.rename(l.snapshotImage(second), l.snapshotImageTemp(second));
    const sweeper = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    const gone = [l.groupDir(unfinished.id), l.snapshotDir(first), l.snapshotDir(second)];
    const kept = [l.groupDir(done.id), ...done.members.map((m) => l.snapshotDir(m))];
    const all = async () => Promise.all([...gone, ...kept].map(present));

    expect(await sweeper.look()).toEqual({ discarded: [], waiting: 1 });
    // A member written meanwhile (a copy at work): the group is not the one the last look saw.
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

  it("temporary files killed writers left go once an hour old, from the pool's own directories", async () => {
    const w = await controllerWorld();
    const l = w.pool.layout;
    const vol = volumeIdOf(await w.CreateVolume('with-a-temp'));
    await w.d.nodes.register('n1', 'test', 10);
    const at = (dir: string, name = '.x.json.tmp-0123456789ab') => path.join(dir, name);
    const old = [
      at(l.root, '.pool.json.tmp-00000000000a'),
      at(l.nodesDir, '.n1.alive.tmp-00000000000b'),
      at(l.locksDir, `.${vol}.lock.tmp-00000000000c`),
      at(l.nodeAttachedDir('n1')),
    ];
    const young = at(l.nodesDir, '.n1.alive.tmp-00000000000d');
    const inVolume = at(l.volumeDir(vol), '.fences.json.tmp-00000000000e');
    const hourAgo = new Date(Date.now() - 3600_000 - 60_000);
    for (const f of [...old, young, inVolume]) {
      await fs.writeFile(f, '{"torn');
      if (f !== young) await fs.utimes(f, hourAgo, hourAgo);
    }
    const sweeper = new LeftoverSweeper(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log);
    expect((await sweeper.removeLeftTemps()).sort()).toEqual([...old].sort());
    expect(await Promise.all([...old, young, inVolume].map(present))).toEqual([
      ...old.map(() => false),
      true,
      true,
    ]);
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
