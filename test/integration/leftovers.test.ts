/**
 * What crashed creations left is cleared by the controller (pool/leftovers.ts): a "creating" volume or
 * snapshot, or a directory holding nothing but a partial image and temp files, whose lock nobody holds.
 * What may stand for data, or is someone's at work, stays: a damaged record, a directory with other
 * files, a group snapshot's member, a creation whose lock is held. On a real pool.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { discardUnfinished } from '../../src/pool/leftovers.js';
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
  const [creating, ready, damaged, held, onlyTemp, withFences] = await Promise.all(
    ['creating', 'ready', 'damaged', 'held', 'only-temp', 'with-fences'].map(volume),
  );
  const src = ready ?? '';
  const snap = async (name: string): Promise<string> =>
    (await w.CreateSnapshot(name, src)).snapshot?.snapshot_id ?? '';
  const snapCreating = await snap('snap-creating');
  const member = await snap('snap-member');

  await edit(l.volumeMeta(creating ?? ''), { state: 'creating' });
  await fs.rename(l.volumeImage(creating ?? ''), l.volumeImageTemp(creating ?? ''));
  await fs.writeFile(l.volumeMeta(damaged ?? ''), '{"torn');
  await edit(l.volumeMeta(held ?? ''), { state: 'creating' });
  for (const id of [onlyTemp, withFences]) {
    await fs.rm(l.volumeMeta(id ?? ''));
    await fs.rm(l.volumeImage(id ?? ''));
  }
  await fs.writeFile(path.join(l.volumeDir(onlyTemp ?? ''), '.meta.json.tmp-0123456789ab'), '{');
  await fs.writeFile(path.join(l.volumeDir(withFences ?? ''), 'fences.json'), '{}');
  await edit(l.snapshotMeta(snapCreating), { state: 'creating' });
  await edit(l.snapshotMeta(member), { state: 'creating', groupSnapshotId: 'group-of-another-call' });
  return {
    gone: [l.volumeDir(creating ?? ''), l.volumeDir(onlyTemp ?? ''), l.snapshotDir(snapCreating)],
    kept: [
      l.volumeDir(ready ?? ''),
      l.volumeDir(damaged ?? ''),
      l.volumeDir(held ?? ''),
      l.volumeDir(withFences ?? ''),
      l.snapshotDir(member),
    ],
    held: held ?? '',
  };
}

describe('unfinished creations a crash left', () => {
  it('are discarded when nobody holds them; what may hold data, or is at work, stays', async () => {
    const w = await controllerWorld();
    const { gone, kept, held } = await leftovers(w);
    const discarded = await w.pool.withLock(held, 'a create at work', () =>
      discardUnfinished(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log),
    );
    expect(discarded.sort()).toEqual([...gone].sort());
    for (const d of gone) expect(await present(d)).toBe(false);
    for (const d of kept) expect(await present(d)).toBe(true);
    // Once its lock is free, the held one goes too.
    expect(await discardUnfinished(w.pool, { volumes: w.volumes, snapshots: w.snapshots }, log)).toEqual([
      w.pool.layout.volumeDir(held),
    ]);
  });

  it('are discarded by a controller when it starts', async () => {
    const w = await controllerWorld();
    const { gone } = await leftovers(w);
    const base = await env.dir('leftovers');
    const d = await env.driver({ dir: base, mode: 'controller', poolDir: w.dir });
    expect(await d.waitForLog((l) => l.includes('discarded unfinished creations crashes left'))).toBe(true);
    for (const dir of gone) expect(await present(dir)).toBe(false);
    await d.stop();
  });
});
