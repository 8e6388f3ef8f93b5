/**
 * The controller's copies (CreateSnapshot, CreateVolume from a volume, CreateVolumeGroupSnapshot) racing
 * what else happens to their sources while they wait for the sources' pool locks, or while they copy:
 * what they find under the locks is what counts. In-process, on a real pool (cp and blkid on files).
 */
import fs from 'node:fs/promises';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { busy } from '../../src/errors.js';
import { groupSnapshotIdForName } from '../../src/pool/ids.js';
import type { HeldLock } from '../../src/pool/lock.js';
import type { QuiesceAnswer } from '../../src/pool/quiesce.js';
import {
  type ControllerWorld,
  controllerWorld,
  fromSnapshot,
  fromVolume,
  mountCapability,
  removeControllerWorlds,
  volumeIdOf,
  writerLease,
} from '../helpers/controller-world.js';
import { codeOf, MiB } from '../helpers/node-world.js';

afterAll(removeControllerWorlds);

/**
 * Starts `call` while holding volume `id`'s pool lock (as a node's stage or another controller's delete
 * would), runs `meanwhile` once the call waits for that lock, then lets go; returns how the call ended.
 */
async function whileItWaits(
  w: ControllerWorld,
  id: string,
  call: () => Promise<unknown>,
  meanwhile: () => Promise<unknown>,
): Promise<string> {
  let code: Promise<string> | undefined;
  await w.pool.withLock(id, 'a node or another controller', async () => {
    code = codeOf(call());
    await new Promise((r) => setTimeout(r, 300));
    await meanwhile();
  });
  if (!code) throw new Error('the call did not start');
  return code;
}

describe('a source volume deleted while a copy of it waits for its lock', () => {
  const deletedMeanwhile = async (copy: (w: ControllerWorld, id: string) => Promise<unknown>) => {
    const w = await controllerWorld();
    const id = volumeIdOf(await w.CreateVolume('src'));
    // What DeleteVolume does under the lock (volumes.delete: the volume's directory goes).
    return whileItWaits(
      w,
      id,
      () => copy(w, id),
      () => w.pool.discard(w.pool.layout.volumeDir(id)),
    );
  };

  it('CreateSnapshot answers NOT_FOUND (spec: source volume does not exist)', async () => {
    expect(await deletedMeanwhile((w, id) => w.CreateSnapshot('snap', id))).toBe('NOT_FOUND');
  });
  it('CreateVolume from it answers NOT_FOUND (spec: volume source does not exist)', async () => {
    expect(await deletedMeanwhile((w, id) => w.CreateVolume('clone', { source: fromVolume(id) }))).toBe(
      'NOT_FOUND',
    );
  });
  it('CreateVolumeGroupSnapshot answers NOT_FOUND', async () => {
    expect(await deletedMeanwhile((w, id) => w.CreateVolumeGroupSnapshot('group', [id]))).toBe('NOT_FOUND');
  });
});

describe('a copy of a volume whose first stage happens while the copy waits for its lock', () => {
  /**
   * A raw block volume, never staged; a node takes its lock for a first NodeStageVolume just as the copy
   * begins, marks it initialized, and its pod writes raw data (no filesystem signature).
   */
  const firstStageMeanwhile = async (copy: (w: ControllerWorld, id: string) => Promise<unknown>) => {
    const w = await controllerWorld();
    const id = volumeIdOf(await w.CreateVolume('raw-src'));
    const code = await whileItWaits(
      w,
      id,
      () => copy(w, id),
      async () => {
        await w.volumes.markInitialized(id, 'node n1 (raw block)');
        const h = await fs.open(w.volumes.imagePath(id), 'r+');
        await h.write(Buffer.alloc(MiB, 0x5a), 0, MiB, 64 * 1024);
        await h.close();
      },
    );
    return { w, id, code };
  };

  it('a snapshot records it initialized, so restoring its raw data as a filesystem is refused', async () => {
    const { w, code } = await firstStageMeanwhile((w, id) => w.CreateSnapshot('snap', id));
    const [snap] = (await w.snapshots.list(undefined, 0, () => true)).snapshots;
    // Recorded "never initialized", the restore would be made a filesystem volume that its first stage
    // formats: the restored data destroyed.
    const restore = await codeOf(
      w.CreateVolume('restored', { caps: [mountCapability()], source: fromSnapshot(snap?.id ?? '') }),
    );
    expect({ code, initialized: snap?.initialized, restore }).toEqual({
      code: 'OK',
      initialized: true,
      restore: 'INVALID_ARGUMENT',
    });
  });

  it('a clone decided on the volume as it was is not made; its retry sees the raw data', async () => {
    const clone = (w: ControllerWorld, id: string) =>
      w.CreateVolume('clone', { caps: [mountCapability()], source: fromVolume(id) });
    const { w, id, code } = await firstStageMeanwhile(clone);
    const retry = await codeOf(clone(w, id));
    expect({ code, retry, volumes: (await w.volumes.list(undefined, 0)).volumes.map((v) => v.id) }).toEqual({
      code: 'ABORTED',
      retry: 'INVALID_ARGUMENT',
      volumes: [id],
    });
  });
});

describe("a restore whose snapshot is replaced while it waits for the snapshot's lock", () => {
  it('is not made from the other snapshot: ABORTED, so that a retry decides again', async () => {
    const w = await controllerWorld();
    const src = volumeIdOf(await w.CreateVolume('src'));
    const other = volumeIdOf(await w.CreateVolume('other'));
    const snap = (await w.CreateSnapshot('snap', src)).snapshot?.snapshot_id ?? '';
    const file = w.pool.layout.snapshotMeta(snap);
    const code = await whileItWaits(
      w,
      snap,
      () => w.CreateVolume('restored', { source: fromSnapshot(snap) }),
      // Another controller deleted it and made a snapshot of the same name, of another volume.
      async () => {
        const meta = JSON.parse(await fs.readFile(file, 'utf8')) as Record<string, unknown>;
        const later = new Date(Date.now() + 1000).toISOString();
        await fs.writeFile(file, JSON.stringify({ ...meta, sourceVolumeId: other, createdAt: later }));
      },
    );
    expect(code).toBe('ABORTED');
  });
});

describe('a retried CreateVolume from a source', () => {
  // The provisioner retries a slow copy whose call it timed out; the volume was made meanwhile.
  const retried = async (
    change: (w: ControllerWorld, src: string, snap: string) => Promise<unknown>,
    source: 'volume' | 'snapshot',
  ) => {
    const w = await controllerWorld();
    const src = volumeIdOf(await w.CreateVolume('src'));
    const snap = (await w.CreateSnapshot('snap', src)).snapshot?.snapshot_id ?? '';
    const ask = {
      bytes: 64 * MiB,
      caps: [mountCapability()],
      source: source === 'volume' ? fromVolume(src) : fromSnapshot(snap),
    };
    const made = volumeIdOf(await w.CreateVolume('copy', ask));
    await change(w, src, snap);
    let id: string | undefined;
    const again = await codeOf(
      w.CreateVolume('copy', ask).then((r) => {
        id = r.volume?.volume_id;
      }),
    );
    return { same: id === made, again };
  };

  it.each<
    [string, 'volume' | 'snapshot', (w: ControllerWorld, src: string, snap: string) => Promise<unknown>]
  >([
    [
      'a clone whose source was expanded since',
      'volume',
      (w, src) =>
        w.volumes.update(src, 'test', async (m) => {
          await fs.truncate(w.volumes.imagePath(src), 128 * MiB);
          return { ...m, capacityBytes: 128 * MiB };
        }),
    ],
    [
      'a clone whose source a pod has written raw data to since',
      'volume',
      async (w, src) => {
        await w.volumes.markInitialized(src, 'node n1 (raw block)', 512);
        const h = await fs.open(w.volumes.imagePath(src), 'r+');
        await h.write(Buffer.alloc(MiB, 0x5a), 0, MiB, 64 * 1024);
        await h.close();
      },
    ],
    ['a restore whose snapshot was deleted since', 'snapshot', (w, _src, snap) => w.DeleteSnapshot(snap)],
  ])('%s answers OK with the volume it made', async (_what, source, change) => {
    expect(await retried(change, source)).toEqual({ same: true, again: 'OK' });
  });
});

describe('a copy of a volume whose first stage marks it initialized while the copy runs', () => {
  // The stage takes no pool lock of the volume's to write the marker: the copy read "never
  // initialized" under its lock, then the pod's data (or half of a filesystem) may have reached it.
  const markedDuring = async (before: number, copy: (w: ControllerWorld, id: string) => Promise<string>) => {
    const w = await controllerWorld();
    const id = volumeIdOf(await w.CreateVolume('src'));
    await w.volumes.markInitialized(id, 'node n1 (raw block)', 4096);
    const real = w.volumes.initialization.bind(w.volumes);
    let calls = 0;
    const spy = vi
      .spyOn(w.volumes, 'initialization')
      .mockImplementation((v) => (v === id && calls++ < before ? Promise.resolve(undefined) : real(v)));
    // Every look at the marker, the quick one (an lstat) included, sees it as the mock says.
    const quick = vi
      .spyOn(w.volumes, 'isInitialized')
      .mockImplementation(async (v) => (await w.volumes.initialization(v)) !== undefined);
    try {
      return await copy(w, id);
    } finally {
      spy.mockRestore();
      quick.mockRestore();
    }
  };

  it('a snapshot is not made (ABORTED): neither blank nor initialized would be true of it', async () => {
    const code = await markedDuring(1, (w, id) => codeOf(w.CreateSnapshot('snap', id)));
    expect(code).toBe('ABORTED');
  });

  it('a clone is not made (ABORTED), and its retry records the source initialized, with its sector size', async () => {
    const recorded = await markedDuring(2, async (w, id) => {
      const first = await codeOf(w.CreateVolume('clone', { source: fromVolume(id) }));
      const clone = volumeIdOf(await w.CreateVolume('clone', { source: fromVolume(id) }));
      return `${first} ${JSON.stringify(await w.volumes.initialization(clone))}`;
    });
    expect(recorded).toBe('ABORTED {"sectorSize":4096}');
  });
});

describe('a group snapshot whose freeze ended before its copy did', () => {
  it('fails, and no member is ever listed as ready, then or after', async () => {
    const w = await controllerWorld();
    const a = volumeIdOf(await w.CreateVolume('ga', { caps: [mountCapability()] }));
    const b = volumeIdOf(await w.CreateVolume('gb', { caps: [mountCapability()] }));
    // Node n1 has `a` staged for writing: the controller asks n1 to freeze it for the copy.
    await w.volumes.takeLease(a, writerLease('n1'));
    const listed = async () => (await w.snapshots.list(undefined, 0, () => true)).snapshots.map((s) => s.id);
    // n1 answers "frozen", but its freeze runs out (thawed by the node's clock) once the members are
    // copied, before the controller's last look: the copies may hold writes made after the instant.
    let copies = 0;
    const create = w.snapshots.create.bind(w.snapshots);
    w.snapshots.create = (meta, copy, opts) =>
      create(
        meta,
        async (image, lock) => {
          const r = await copy(image, lock);
          copies++;
          return r;
        },
        opts,
      );
    const seenAtLastLook: string[][] = [];
    w.d.board.answer = async (_node, req): Promise<QuiesceAnswer> => {
      if (copies < 2) return { volumeId: req.volumeId, state: 'frozen', message: 'frozen' };
      seenAtLastLook.push(await listed());
      return { volumeId: req.volumeId, state: 'expired', message: 'thawed when its time was up' };
    };
    const code = await codeOf(w.CreateVolumeGroupSnapshot('g1', [a, b]));
    expect({
      code,
      copies,
      seenAtLastLook: seenAtLastLook[0],
      listedAfter: await listed(),
      left: await fs.readdir(w.pool.layout.snapshotsDir),
    }).toEqual({ code: 'FAILED_PRECONDITION', copies: 2, seenAtLastLook: [], listedAfter: [], left: [] });
  });

  it('whose freezes held, is ready with every member listed', async () => {
    const w = await controllerWorld();
    const a = volumeIdOf(await w.CreateVolume('ga', { caps: [mountCapability()] }));
    await w.volumes.takeLease(a, writerLease('n1'));
    w.d.board.answer = (_node, req): Promise<QuiesceAnswer> =>
      Promise.resolve({ volumeId: req.volumeId, state: 'frozen', message: 'frozen' });
    const res = await w.CreateVolumeGroupSnapshot('g1', [a]);
    const listed = (await w.snapshots.list(undefined, 0, () => true)).snapshots;
    expect({
      ready: res.group_snapshot?.ready_to_use,
      members: res.group_snapshot?.snapshots?.map((m) => m.snapshot_id),
      listed: listed.map((m) => [m.id, m.sourceVolumeId]),
    }).toEqual({
      ready: true,
      members: listed.map((m) => m.id),
      listed: [[expect.any(String), a]],
    });
  });
});

/**
 * A world with one mounted volume `a`, whose group snapshot "g1" (`groupId`) takes a pool lock the
 * test can lose (its signal, its assertHeld) with `lost`.
 */
async function groupWithLosableLock() {
  const w = await controllerWorld();
  const a = volumeIdOf(await w.CreateVolume('ga', { caps: [mountCapability()] }));
  const groupId = groupSnapshotIdForName('g1');
  const lost = new AbortController();
  losableGroupLock(w, groupId, lost);
  return { w, a, groupId, lost };
}

/** Makes the pool lock of `groupId` in `w` one the test can lose (its signal, its assertHeld) with `lost`. */
function losableGroupLock(w: ControllerWorld, groupId: string, lost: AbortController): void {
  const pool = w.pool as unknown as { withLock: (...a: unknown[]) => Promise<unknown> };
  const orig = pool.withLock.bind(w.pool);
  pool.withLock = (key: unknown, purpose: unknown, fn: unknown, ...rest: unknown[]) => {
    if (key !== groupId) return orig(key, purpose, fn, ...rest);
    return orig(
      key,
      purpose,
      (l: HeldLock) =>
        (fn as (l: HeldLock) => Promise<unknown>)({
          ...l,
          signal: lost.signal,
          assertHeld: () => {
            if (lost.signal.aborted) throw busy('lost');
          },
        }),
      ...rest,
    );
  };
}

describe('a group snapshot whose record was not written ready (killed after its members were)', () => {
  it('lists and restores none of its members, and its retry makes it whole', async () => {
    const w = await controllerWorld();
    const a = volumeIdOf(await w.CreateVolume('ga'));
    const b = volumeIdOf(await w.CreateVolume('gb'));
    const made = (await w.CreateVolumeGroupSnapshot('g', [a, b])).group_snapshot;
    const members = (made?.snapshots ?? []).map((s) => s.snapshot_id).sort();
    const file = w.pool.layout.groupMeta(made?.group_snapshot_id ?? '');
    const group = JSON.parse(await fs.readFile(file, 'utf8')) as Record<string, unknown>;
    await fs.writeFile(file, JSON.stringify({ ...group, state: 'creating' }));
    const listed = (await w.snapshots.list(undefined, 0, () => true)).snapshots.map((s) => s.id);
    const restore = await codeOf(w.CreateVolume('restored', { source: fromSnapshot(members[0] ?? '') }));
    const again = (await w.CreateVolumeGroupSnapshot('g', [a, b])).group_snapshot;
    const after = (await w.snapshots.list(undefined, 0, () => true)).snapshots.map((s) => s.id).sort();
    expect({ listed, restore, ready: again?.ready_to_use, after }).toEqual({
      listed: [],
      restore: 'NOT_FOUND',
      ready: true,
      after: members,
    });
  });
});

describe('a group snapshot and the names and locks it shares with others', () => {
  it('answers ALREADY_EXISTS to the same name with other parameters (spec), OK to the same ones', async () => {
    const w = await controllerWorld();
    const a = volumeIdOf(await w.CreateVolume('pa'));
    const meta = { 'csi.storage.k8s.io/volumegroupsnapshot/name': 'one' };
    await w.CreateVolumeGroupSnapshot('g', [a], meta);
    expect({
      same: await codeOf(w.CreateVolumeGroupSnapshot('g', [a], meta)),
      other: await codeOf(
        w.CreateVolumeGroupSnapshot('g', [a], { 'csi.storage.k8s.io/volumegroupsnapshot/name': 'two' }),
      ),
    }).toEqual({ same: 'OK', other: 'ALREADY_EXISTS' });
  });

  it("never takes, nor deletes, a user's snapshot named as one of its members", async () => {
    const w = await controllerWorld();
    const a = volumeIdOf(await w.CreateVolume('ga', { caps: [mountCapability()] }));
    const b = volumeIdOf(await w.CreateVolume('gb', { caps: [mountCapability()] }));
    const groupId = groupSnapshotIdForName('g1');
    // A CO (or a hostile caller) names its own snapshot of `b` as the group's member of `a` would be.
    const own = (await w.CreateSnapshot(`${groupId}/${a}`, b)).snapshot?.snapshot_id;
    const res = await w.CreateVolumeGroupSnapshot('g1', [a]);
    const members = res.group_snapshot?.snapshots ?? [];
    const ownAfter = own ? await w.snapshots.get(own) : undefined;
    expect({
      ready: res.group_snapshot?.ready_to_use,
      memberSources: members.map((m) => m.source_volume_id),
      memberIsOwn: members.some((m) => m.snapshot_id === own),
      ownSource: ownAfter?.sourceVolumeId,
      ownInGroup: Boolean(ownAfter?.groupSnapshotId),
    }).toEqual({ ready: true, memberSources: [a], memberIsOwn: false, ownSource: b, ownInGroup: false });
  });

  it('waits while another controller holds the group (its pool lock), and then finds it done', async () => {
    const w = await controllerWorld();
    const a = volumeIdOf(await w.CreateVolume('ga', { caps: [mountCapability()] }));
    const groupId = groupSnapshotIdForName('g1');
    let call: Promise<unknown> | undefined;
    let seenMeanwhile: unknown;
    await w.pool.withLock(groupId, 'another controller', async () => {
      call = w.CreateVolumeGroupSnapshot('g1', [a]);
      call.catch(() => undefined);
      await new Promise((r) => setTimeout(r, 300));
      // Nothing of the group may be written by a call that does not hold it.
      seenMeanwhile = await w.snapshots.inspectGroup(groupId);
    });
    const res = (await call) as Awaited<ReturnType<typeof w.CreateVolumeGroupSnapshot>>;
    expect({
      meanwhile: (seenMeanwhile as { state: string }).state,
      ready: res.group_snapshot?.ready_to_use,
    }).toEqual({
      meanwhile: 'absent',
      ready: true,
    });
  });

  it("whose pool lock was lost deletes nothing in its cleanup: the group is the new holder's", async () => {
    const { w, a, groupId, lost } = await groupWithLosableLock();
    const snaps = w.snapshots as unknown as { markReady: (...a: unknown[]) => Promise<unknown> };
    snaps.markReady = async () => {
      // A stalled past the lease: B took the group over, redid it and answered the CO "ready".
      lost.abort(new Error('another process took the lock over'));
      const g = await w.snapshots.readGroup(groupId);
      if (!g) throw new Error('the group record is missing');
      await w.snapshots.writeGroup({ ...g, state: 'ready' });
      // A's member no longer is what it made (B remade it): A's markReady fails, as the real one does.
      throw busy('changed by another call');
    };
    const code = await codeOf(w.CreateVolumeGroupSnapshot('g1', [a]));
    const after = await w.snapshots.inspectGroup(groupId);
    expect({ code, groupAfter: after.state }).toEqual({ code: 'ABORTED', groupAfter: 'ok' });
  });

  it('whose pool lock was lost before its members were marked ready marks none', async () => {
    const { w, a, lost } = await groupWithLosableLock();
    const create = w.snapshots.create.bind(w.snapshots);
    w.snapshots.create = async (meta, copy, opts) => {
      const made = await create(meta, copy, opts);
      lost.abort(new Error('another process took the lock over')); // once the copies are made
      return made;
    };
    const code = await codeOf(w.CreateVolumeGroupSnapshot('g1', [a]));
    const listed = (await w.snapshots.list(undefined, 0, () => true)).snapshots;
    expect({ code, ready: listed.map((m) => m.id) }).toEqual({ code: 'ABORTED', ready: [] });
  });
});
