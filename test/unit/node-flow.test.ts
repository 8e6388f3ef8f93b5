/**
 * The node algorithms (src/node/) against an in-memory kernel (FakeHost) and a real pool in a temp
 * directory: what each flow does to the host, step by step, and that every refusal and every failure
 * leaves the host and the pool as they were (no loop device, no mount, no lease, no target).
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { conflict } from '../../src/errors.js';
import { bindExec } from '../../src/exec/runner.js';
import { OnlineGrowthUnsupported } from '../../src/host/filesystem.js';
import { expandVolume } from '../../src/node/grow.js';
import { stageVolume } from '../../src/node/stage.js';
import { volumeStats } from '../../src/node/stats.js';
import { allocatedBytes } from '../../src/pool/images.js';
import { Pool } from '../../src/pool/pool.js';
import type { Capability, FsType } from '../../src/pool/types.js';
import { commandError, FakeHost, type ImageContent } from '../helpers/fake-host.js';
import {
  anotherHost,
  attachTo,
  cap,
  codeOf,
  during,
  log,
  MiB,
  must,
  newVolume,
  NODE,
  noCommands,
  publish,
  removeWorlds,
  SIZE,
  stage,
  STAGING,
  TARGET,
  unpublish,
  unstage,
  type World,
  world,
} from '../helpers/node-world.js';

afterAll(removeWorlds);

/** Nothing of the volume is left on the host or in its lease; the CO's staging directory is still there. */
async function expectNothingLeft(w: World, id: string): Promise<void> {
  expect([...w.host.attached.keys()]).toEqual([]);
  expect(w.host.table).toEqual([]);
  expect(await w.volumes.lease(id, NODE)).toBeUndefined();
  expect(w.host.kindOf(TARGET)).toBe('absent');
  expect(w.host.kindOf(STAGING)).toBe('directory');
}

const formats = (w: World): string[] => w.host.ops.filter((o) => o.startsWith('format'));

const pause = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Runs the stage's lease that names the device through `around` (`take` writes it); other leases as they are. */
function aroundNaming(
  w: World,
  around: (take: () => Promise<unknown>, id: string) => Promise<unknown>,
): void {
  const takeLease = w.d.volumes.takeLease.bind(w.d.volumes);
  w.d.volumes.takeLease = async (vid, lease, opts) =>
    lease.device === undefined
      ? takeLease(vid, lease, opts)
      : ((await around(() => takeLease(vid, lease, opts), vid)) as Awaited<ReturnType<typeof takeLease>>);
}

/** A volume staged and published whose staging mount went (unmounted by hand, a lost mount) while the pod's bind of it stays. */
async function stagingMountGone(): Promise<{ w: World; id: string }> {
  const w = await world();
  const { id } = await newVolume(w);
  await stage(w, id);
  await publish(w, id);
  w.host.table.splice(
    w.host.table.findIndex((m) => m.mountPoint === STAGING),
    1,
  );
  return { w, id };
}

describe('NodeStageVolume', () => {
  it('formats a fresh volume once, marks it initialized and mounts it', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    await stage(w, id);
    expect(w.host.ops).toEqual([
      `attach ${image} rw`,
      'probe /dev/loop0',
      'format ext4 /dev/loop0',
      `mkdir ${STAGING}`,
      `mount ext4 /dev/loop0 ${STAGING} -o errors=remount-ro`,
    ]);
    expect(w.host.mountsAt(STAGING)).toMatchObject([
      { source: '/dev/loop0', fsType: 'ext4', options: ['rw'] },
    ]);
    expect(await w.volumes.isInitialized(id)).toBe(true);
    expect(await w.volumes.lease(id, NODE)).toMatchObject({ stagingPath: STAGING, accessType: 'mount' });
  });

  it('probes while its lease is made to name the device, and formats and mounts only once it does', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    aroundNaming(w, async (take) => {
      await pause(50);
      await take();
      w.host.ops.push('lease names the device');
    });
    const named = async (): Promise<void> => {
      w.host.ops.push(`lease names ${(await w.volumes.lease(id, NODE))?.device ?? 'nothing'}`);
    };
    const [format, mount] = [w.host.format.bind(w.host), w.host.mount.bind(w.host)];
    w.host.format = async (cx, fsType, device) => {
      await named();
      await format(cx, fsType, device);
    };
    w.host.mount = async (cx, m) => {
      await named();
      await mount(cx, m);
    };
    await stage(w, id);
    expect(w.host.ops.filter((o) => !o.startsWith('attach') && !o.startsWith('mkdir'))).toEqual([
      'probe /dev/loop0',
      'lease names the device',
      'lease names loop0',
      'format ext4 /dev/loop0',
      'lease names loop0',
      `mount ext4 /dev/loop0 ${STAGING} -o errors=remount-ro`,
    ]);
  });

  it('answers a second stage from the mount table, touching nothing', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    expect(await during(w, () => stage(w, id))).toEqual({ code: 'OK', ops: [] });
    expect(w.host.table).toHaveLength(1);
    expect([...w.host.attached.keys()]).toEqual(['loop0']);
  });

  it('keeps the filesystem it made at the next stage: checks it, never formats again', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    await stage(w, id);
    await unstage(w, id);
    expect(await during(w, () => stage(w, id))).toEqual({
      code: 'OK',
      ops: [
        `attach ${image} rw`,
        'probe /dev/loop0',
        'check ext4 /dev/loop0',
        `mkdir ${STAGING}`,
        `mount ext4 /dev/loop0 ${STAGING} -o errors=remount-ro`,
      ],
    });
    expect(formats(w)).toHaveLength(1);
  });

  it('stages again through the device a pod still has mounted when the staging mount is gone: never a second one', async () => {
    const { w, id } = await stagingMountGone();
    const { code, ops } = await during(w, () => stage(w, id));
    expect(code).toBe('OK');
    // The live filesystem is mounted again from its own device: no attach, no check, no format.
    expect(ops).toEqual([
      'probe /dev/loop0',
      `mkdir ${STAGING}`,
      `mount ext4 /dev/loop0 ${STAGING} -o errors=remount-ro`,
      `thaw ${STAGING}`,
    ]);
    expect([...w.host.attached.keys()]).toEqual(['loop0']);
    expect(new Set(w.host.table.map((m) => m.source))).toEqual(new Set(['/dev/loop0']));
  });

  it('never stages as raw block a device under a filesystem a pod still has mounted', async () => {
    const { w, id } = await stagingMountGone();
    const block = { accessType: 'block' as const, fsType: '' };
    expect(await during(w, () => stage(w, id, block))).toEqual({ code: 'FAILED_PRECONDITION', ops: [] });
    expect((await w.volumes.lease(id, NODE))?.accessType).toBe('mount');
  });

  it('formats a fresh read-only staging through a read-write attachment, then mounts it read-only', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    await stage(w, id, { mode: 'SINGLE_NODE_READER_ONLY' });
    expect(w.host.ops).toEqual([
      `attach ${image} ro`,
      'probe /dev/loop0',
      'detach loop0',
      `attach ${image} rw`,
      'format ext4 /dev/loop0',
      'detach loop0',
      `attach ${image} ro`,
      `mkdir ${STAGING}`,
      `mount ext4 /dev/loop0 ${STAGING} -o ro,noload`,
    ]);
    expect(must(w.host.attached.get('loop0'), 'loop0').readOnly).toBe(true);
    expect(w.host.mountsAt(STAGING)[0]?.options).toContain('ro');
  });

  it('gives pods read-only binds of a filesystem the pool records as published read-only, staged as its mode says', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    const att = {
      node: NODE,
      readonly: true,
      accessType: 'mount',
      mode: 'SINGLE_NODE_WRITER',
      since: 'x',
    } as const;
    await w.volumes.publish(id, att, 8);
    // No publish context: the attachment record says read-only. The staging is read-write (its journal
    // replayed and checked: a read-only device would hide what the journal holds).
    await stage(w, id);
    expect(w.host.ops.at(-1)).toBe(`mount ext4 /dev/loop0 ${STAGING} -o errors=remount-ro`);
    expect(w.host.ops.filter((o) => o.startsWith('attach')).at(-1)).toBe(`attach ${image} rw`);
    await publish(w, id, {}, false);
    expect(w.host.mountsAt(TARGET)[0]?.options).toContain('ro');
    expect(await codeOf(stage(w, id))).toBe('OK');
    expect(await codeOf(publish(w, id, {}, false))).toBe('OK');
  });

  it('refuses a read-only publication while a pod still has a read-write bind of the staging', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    const multi = { mode: 'SINGLE_NODE_MULTI_WRITER' } as const;
    await stage(w, id, multi);
    await publish(w, id, multi);
    // Published again, read-only this time (the record says so; the CO passes no context here).
    await w.volumes.publish(
      id,
      { node: NODE, readonly: true, accessType: 'mount', mode: 'SINGLE_NODE_MULTI_WRITER', since: 'x' },
      8,
    );
    const second = `${TARGET}-2`;
    expect(await during(w, () => stage(w, id, multi))).toEqual({ code: 'ALREADY_EXISTS', ops: [] });
    expect(await codeOf(publish(w, id, multi, false, second))).toBe('FAILED_PRECONDITION');
    expect(w.host.mountsAt(second)).toEqual([]);
    await unpublish(w, id);
    expect(await codeOf(stage(w, id, multi))).toBe('OK');
    await publish(w, id, multi, false, second);
    expect(w.host.mountsAt(second)[0]?.options).toContain('ro');
  });

  it('stages a raw block volume published read-only on a read-only device; a mismatched repeat is ALREADY_EXISTS', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    const withContext = (publishedReadOnly: boolean) =>
      stageVolume(w.d, w.x, {
        id,
        staging: STAGING,
        cap: cap({ accessType: 'block', fsType: '' }),
        publishPool: undefined,
        poolId: undefined,
        publishedReadOnly,
      });
    await withContext(false);
    expect(await during(w, () => withContext(true))).toEqual({ code: 'ALREADY_EXISTS', ops: [] });
    await unstage(w, id);
    await withContext(true);
    expect(must(w.host.attached.get('loop0'), 'loop0').readOnly).toBe(true);
    expect(await during(w, () => withContext(false))).toEqual({ code: 'ALREADY_EXISTS', ops: [] });
  });

  it.each<[string, Partial<Capability>]>([
    ['another filesystem', { fsType: 'xfs' }],
    ['read-only access', { mode: 'SINGLE_NODE_READER_ONLY' }],
    ['a read-only mount flag', { mountFlags: ['ro'] }],
  ])('answers ALREADY_EXISTS to a stage at the same path with %s, touching nothing', async (_what, over) => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    expect(await during(w, () => stage(w, id, over))).toEqual({ code: 'ALREADY_EXISTS', ops: [] });
    expect(w.host.mountsAt(STAGING)).toMatchObject([{ source: '/dev/loop0', fsType: 'ext4' }]);
  });

  it('mounts again, and thaws, a device that a frozen unmounted filesystem still holds; no check, no format', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    // A pod went away during a snapshot: the staging mount went, its superblock stayed frozen.
    await w.host.freeze(w.x, STAGING);
    await w.host.unmountAll(w.x, STAGING, undefined, () => true);
    expect(await w.host.claimed('/dev/loop0')).toBe(true);
    expect(await during(w, () => stage(w, id))).toEqual({
      code: 'OK',
      ops: [
        'probe /dev/loop0',
        `mkdir ${STAGING}`,
        `mount ext4 /dev/loop0 ${STAGING} -o errors=remount-ro`,
        `thaw ${STAGING}`,
      ],
    });
    expect(w.host.frozen.size).toBe(0);
  });

  it.each<[FsType, string[]]>([
    [
      'ext4',
      [
        'check ext4 /dev/loop0',
        'grow-offline /dev/loop0',
        `mkdir ${STAGING}`,
        `mount ext4 /dev/loop0 ${STAGING} -o errors=remount-ro`,
      ],
    ],
    [
      'xfs',
      [
        'check xfs /dev/loop0',
        `mkdir ${STAGING}`,
        `mount xfs /dev/loop0 ${STAGING} -o nouuid`,
        'grow-online xfs /dev/loop0',
      ],
    ],
  ])('grows a %s filesystem smaller than its grown image when it stages it', async (fsType, growth) => {
    const w = await world();
    const { id, image } = await newVolume(w, { fsType });
    await stage(w, id, { fsType });
    await unstage(w, id);
    await fs.truncate(image, 2 * SIZE);
    const { code, ops } = await during(w, () => stage(w, id, { fsType }));
    expect(code).toBe('OK');
    expect(ops.slice(2)).toEqual(growth); // after the attach and the probe
    expect(w.host.content.get(image)).toEqual({ kind: 'filesystem', type: fsType, size: 2 * SIZE });
  });
});

describe("what this host's page cache remembers of a device never decides", () => {
  it('reads a blank answer again, the cache dropped, when the marker says another node formatted it since', async () => {
    const w = await world();
    const { id, image } = await newVolume(w, { initialized: true });
    w.host.content.set(image, { kind: 'filesystem', type: 'ext4', size: SIZE });
    // udev read the fresh device before the other node's mkfs; then that node recorded it and let go.
    w.host.cached.set('/dev/loop0', { kind: 'blank' });
    expect(await during(w, () => stage(w, id))).toEqual({
      code: 'OK',
      ops: [
        `attach ${image} rw`,
        'probe /dev/loop0',
        'flush /dev/loop0',
        'probe /dev/loop0',
        'check ext4 /dev/loop0',
        `mkdir ${STAGING}`,
        `mount ext4 /dev/loop0 ${STAGING} -o errors=remount-ro`,
      ],
    });
    expect(formats(w)).toEqual([]);
  });

  it('drops the cache before it probes a device it did not attach (an interrupted call left it)', async () => {
    const w = await world();
    const { id, image } = await newVolume(w, { initialized: true });
    w.host.content.set(image, { kind: 'filesystem', type: 'ext4', size: SIZE });
    await w.host.attach(w.x, image, undefined, { readOnly: false, directIo: false }); // loop0
    w.host.cached.set('/dev/loop0', { kind: 'filesystem', type: 'xfs' }); // what it held before
    const { code, ops } = await during(w, () => stage(w, id));
    expect(code).toBe('OK');
    expect(ops.slice(0, 3)).toEqual(['flush /dev/loop0', 'probe /dev/loop0', 'check ext4 /dev/loop0']);
    expect(w.host.mountsAt(STAGING)).toMatchObject([{ source: '/dev/loop0', fsType: 'ext4' }]);
  });

  it('drops the cache first for a volume other nodes may stage at once (multi-node readers), fresh or not', async () => {
    const w = await world();
    const { id, image } = await newVolume(w, { initialized: true });
    w.host.content.set(image, { kind: 'filesystem', type: 'ext4', size: SIZE });
    // What this host read before another node (sharing the volume) formatted the image.
    w.host.cached.set('/dev/loop0', { kind: 'filesystem', type: 'xfs' });
    const { code, ops } = await during(w, () => stage(w, id, { mode: 'MULTI_NODE_READER_ONLY' }));
    expect(code).toBe('OK');
    expect(ops.slice(0, 3)).toEqual([`attach ${image} ro`, 'flush /dev/loop0', 'probe /dev/loop0']);
    expect(w.host.mountsAt(STAGING)).toMatchObject([{ source: '/dev/loop0', fsType: 'ext4' }]);
  });

  it('formats nothing when it lost the format lock while its lease was being written', async () => {
    const w = await world({ lock: { heartbeatMs: 20 } });
    const { id, image } = await newVolume(w);
    aroundNaming(w, async (take, vid) => {
      // Cut off from the pool meanwhile: another node took the format lock over once this one had it.
      const lock = path.join(w.pool.layout.locksDir, `${vid}.format.lock`);
      while (!(await fs.stat(lock).catch(() => undefined))) await pause(5);
      await fs.writeFile(lock, '{}');
      await pause(1000); // its renewal (every 20 ms) has found it gone, on a loaded machine too
      return take();
    });
    expect(await codeOf(stage(w, id))).toBe('ABORTED');
    expect(formats(w)).toEqual([]);
    expect(w.host.content.get(image)).toBeUndefined();
    expect(await w.volumes.isInitialized(id)).toBe(false);
  });

  it('fails, undoing it all, when the cache cannot be dropped before that second look', async () => {
    const w = await world();
    const { id, image } = await newVolume(w, { initialized: true });
    w.host.content.set(image, { kind: 'filesystem', type: 'ext4', size: SIZE });
    w.host.cached.set('/dev/loop0', { kind: 'blank' });
    w.host.failNext('flush');
    expect(await codeOf(stage(w, id))).toBe('INTERNAL');
    expect(formats(w)).toEqual([]);
    await expectNothingLeft(w, id);
  });
});

describe('a mkfs cut short', () => {
  const xfs = { kind: 'filesystem', type: 'xfs', size: SIZE } as const;

  it("is made again (forced) only when its superblock says unfinished and the volume's record says it began", async () => {
    for (const [unfinished, began, remade] of [
      [true, true, true],
      [true, false, false], // no record of ours: not our mkfs (a mount fails; nothing is formatted)
      [false, true, false], // a finished XFS (it may hold data, whatever became of the marker): kept
    ] as const) {
      const w = await world();
      const { id, image } = await newVolume(w, { fsType: 'xfs' });
      w.host.content.set(image, xfs);
      if (unfinished) w.host.unfinished.add(image);
      if (began) await w.volumes.markFormatting(id, 'node a', 'xfs');
      await stage(w, id, { fsType: 'xfs' });
      expect({ unfinished, began, formats: formats(w) }).toEqual({
        unfinished,
        began,
        formats: remade ? ['format xfs /dev/loop0'] : [],
      });
      expect(await w.volumes.isInitialized(id)).toBe(true);
    }
  });

  it('is not marked or mounted when the marker appeared while it ran (another node took the lock over)', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    const format = w.host.format.bind(w.host);
    w.host.format = async (...args) => {
      await format(...args);
      await w.volumes.markInitialized(id, 'node b (mkfs.ext4)');
    };
    expect(await codeOf(stage(w, id))).toBe('ABORTED');
    expect(w.host.mountsAt(STAGING)).toEqual([]);
    // The retry keeps what is there now, marked by the other node.
    w.host.format = format;
    await stage(w, id);
    expect(formats(w)).toEqual(['format ext4 /dev/loop0']);
    expect(w.host.mountsAt(STAGING)).toMatchObject([{ source: '/dev/loop0', fsType: 'ext4' }]);
  });
  it('is not marked or mounted when the format lock was lost while it ran', async () => {
    const w = await world({ lock: { heartbeatMs: 20 } });
    const { id } = await newVolume(w);
    const format = w.host.format.bind(w.host);
    w.host.format = async (...args) => {
      await format(...args);
      // Another process takes the format lock over (this one was cut off from the pool for a lease).
      await fs.writeFile(path.join(w.pool.layout.locksDir, `${id}.format.lock`), '{}');
      await pause(1000); // its renewal (every 20 ms) has found it gone, on a loaded machine too
    };
    expect(await codeOf(stage(w, id))).toBe('ABORTED');
    expect(w.host.mountsAt(STAGING)).toEqual([]);
    expect(await w.volumes.isInitialized(id)).toBe(false);
  });
});

describe('what a device holds decides whether it is formatted', () => {
  it.each<[string, ImageContent, boolean, Partial<Capability>]>([
    ['another filesystem than asked for', { kind: 'filesystem', type: 'xfs', size: SIZE }, false, {}],
    [
      'a filesystem the driver does not serve',
      { kind: 'filesystem', type: 'vfat', size: SIZE },
      false,
      { fsType: '' },
    ],
    ['a partition table', { kind: 'other', what: 'a dos partition table' }, false, {}],
    ['an encrypted container', { kind: 'other', what: 'a crypto_LUKS signature (crypto)' }, true, {}],
    ['no signature, on a volume that was initialized', { kind: 'blank' }, true, {}],
  ])(
    'refuses a device holding %s with FAILED_PRECONDITION, untouched',
    async (_what, content, initialized, over) => {
      const w = await world();
      const { id, image } = await newVolume(w, { initialized });
      w.host.content.set(image, content);
      expect(await codeOf(stage(w, id, over))).toBe('FAILED_PRECONDITION');
      expect(w.host.ops).toContain('probe /dev/loop0');
      expect(formats(w)).toEqual([]);
      expect(w.host.content.get(image)).toEqual(content);
      expect(await w.volumes.isInitialized(id)).toBe(initialized);
      await expectNothingLeft(w, id);
    },
  );

  // Some pool filesystems report no allocated blocks for a file that holds data: the probe decides.
  it.each<[string, ImageContent, Partial<Capability>, string]>([
    ['keeps the ext4 it finds', { kind: 'filesystem', type: 'ext4', size: SIZE }, {}, 'OK'],
    [
      'keeps the xfs it finds when none was asked',
      { kind: 'filesystem', type: 'xfs', size: SIZE },
      { fsType: '' },
      'OK',
    ],
    [
      'refuses a gpt partition table',
      { kind: 'other', what: 'a gpt partition table' },
      {},
      'FAILED_PRECONDITION',
    ],
  ])(
    'with no allocated blocks but a signature, never formats the image: %s',
    async (_what, content, over, code) => {
      const w = await world();
      const { id, image } = await newVolume(w);
      expect(await allocatedBytes(image)).toBe(0);
      w.host.content.set(image, content);
      expect(await codeOf(stage(w, id, over))).toBe(code);
      expect(w.host.ops).toContain('probe /dev/loop0');
      expect(formats(w)).toEqual([]);
      expect(w.host.content.get(image)).toEqual(content);
      if (code === 'OK' && content.kind === 'filesystem') {
        expect(w.host.mountsAt(STAGING)).toMatchObject([{ fsType: content.type }]);
        expect(await w.volumes.isInitialized(id)).toBe(true);
      }
    },
  );
});

describe('a stage that fails undoes what it did', () => {
  it.each<[string, 'fresh' | 'formatted']>([
    ['attach', 'fresh'],
    ['probe', 'fresh'],
    ['format', 'fresh'],
    ['mkdir', 'fresh'],
    ['mount', 'fresh'],
    ['check', 'formatted'],
    ['mount', 'formatted'],
  ])('when %s fails on a %s volume; a retry then stages it, formatting at most once', async (op, state) => {
    const w = await world();
    const { id, image } = await newVolume(w, { initialized: state === 'formatted' });
    if (state === 'formatted') w.host.content.set(image, { kind: 'filesystem', type: 'ext4', size: SIZE });
    w.host.failNext(op);
    expect(await codeOf(stage(w, id))).toBe('INTERNAL');
    expect(w.host.ops.filter((o) => o.endsWith('(failed)'))).toEqual([expect.stringMatching(`^${op} `)]);
    await expectNothingLeft(w, id);
    // The marker and the disk agree: initialized exactly when a filesystem is there.
    expect(await w.volumes.isInitialized(id)).toBe(w.host.content.get(image)?.kind === 'filesystem');

    expect(await codeOf(stage(w, id))).toBe('OK');
    expect(formats(w).filter((o) => !o.endsWith('(failed)')).length).toBeLessThanOrEqual(1);
    expect(w.host.mountsAt(STAGING)).toMatchObject([{ source: '/dev/loop0', fsType: 'ext4' }]);
  });

  it('formats nothing when its lease cannot name the device (detached from this node meanwhile), and undoes it all', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    aroundNaming(w, async (_take, vid) => {
      await pause(50); // the probe runs meanwhile
      w.host.ops.push('lease refused');
      throw conflict(`Volume ${vid} was detached from node ${NODE}; publish it to this node again first.`);
    });
    expect(await codeOf(stage(w, id))).toBe('FAILED_PRECONDITION');
    const ops = w.host.ops;
    expect(ops.indexOf('probe /dev/loop0')).toBeLessThan(ops.indexOf('lease refused'));
    expect(ops.slice(ops.indexOf('lease refused'))).toEqual(['lease refused', 'detach loop0']);
    expect(w.host.content.get(image)).toBeUndefined(); // never formatted
    expect(await w.volumes.isInitialized(id)).toBe(false);
    await expectNothingLeft(w, id);
  });

  it('a raw block volume whose lease cannot name the device is not marked initialized, and the stage undoes it all', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    aroundNaming(w, async (_take, vid) => {
      await pause(50); // a record written beside the lease would be written meanwhile
      throw conflict(`Volume ${vid} was detached from node ${NODE}; publish it to this node again first.`);
    });
    expect(await codeOf(stage(w, id, { accessType: 'block', fsType: '' }))).toBe('FAILED_PRECONDITION');
    // The marker would fix the volume's sector size for every node and refuse mount clones of it.
    expect(await w.volumes.isInitialized(id)).toBe(false);
    await expectNothingLeft(w, id);
  });

  it('undoes its lease only once the record naming the device is written, when the probe fails first', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    aroundNaming(w, async (take) => {
      await pause(50);
      return take();
    });
    w.host.failNext('probe');
    expect(await codeOf(stage(w, id))).toBe('INTERNAL');
    // A rollback that did not wait would drop the lease first and see the record written again after.
    await pause(100);
    await expectNothingLeft(w, id);
  });

  it('reports FAILED_PRECONDITION when mkfs finds a signature the probe missed, and marks nothing', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    w.host.failNext('format', commandError('mkfs.ext4', '/dev/loop0 contains a xfs file system', 1));
    expect(await codeOf(stage(w, id))).toBe('FAILED_PRECONDITION');
    expect(w.host.content.get(image)).toBeUndefined();
    expect(await w.volumes.isInitialized(id)).toBe(false);
    await expectNothingLeft(w, id);
  });

  it.each(['attach', 'mount'] as const)(
    'undoes a %s that took effect although its command was reported killed',
    async (step) => {
      const w = await world();
      const { id } = await newVolume(w);
      w.host.killAfter(step);
      expect(await codeOf(stage(w, id))).toBe('INTERNAL');
      expect(w.host.ops).toContain(`(${step} reported killed after it took effect)`);
      await expectNothingLeft(w, id);
    },
  );

  it("a killed attach detaches only the device it made, never another volume's or one that was there", async () => {
    const w = await world();
    const other = (await newVolume(w)).id;
    await stage(w, other); // loop0, mounted at STAGING
    const { id } = await newVolume(w);
    w.host.killAfter('attach');
    const staging = `${STAGING}-2`;
    w.host.addPath(staging);
    const code = await codeOf(stage(w, id, {}, staging));
    expect({
      code,
      attached: [...w.host.attached.keys()],
      mounted: w.host.table.map((m) => m.mountPoint),
      lease: await w.volumes.lease(id, NODE),
    }).toEqual({ code: 'INTERNAL', attached: ['loop0'], mounted: [STAGING], lease: undefined });
  });

  it("a killed attach detaches the device it made under a name another volume's device had just before", async () => {
    const w = await world();
    const otherImage = (await newVolume(w)).image;
    await w.host.attach(w.x, otherImage, undefined, { readOnly: false, directIo: false }); // loop0
    const { id } = await newVolume(w);
    const attach = w.host.attach.bind(w.host);
    w.host.attach = async (...args) => {
      w.host.attach = attach;
      // The other volume's unstage detaches loop0 between this stage's look and its losetup --find,
      // which then hands loop0 to this volume; losetup is killed once the kernel attached it.
      w.host.attached.delete('loop0');
      await attach(...args);
      throw commandError('losetup', 'losetup: killed');
    };
    const code = await codeOf(stage(w, id));
    expect({
      code,
      attached: [...w.host.attached.values()].map((l) => l.image),
      lease: await w.volumes.lease(id, NODE),
    }).toEqual({ code: 'INTERNAL', attached: [], lease: undefined });
  });

  it("a kubelet whose root is itself a volume's mount still publishes beneath it (a cluster nested in a pod)", async () => {
    const w = await world();
    const kubelet = '/var/lib/kubelet';
    const outer = (await newVolume(w)).id; // the nested cluster's /var/lib/kubelet, a volume of a pool here
    w.host.emptyDir(kubelet); // what the nested kubelet makes there is on that volume
    await stageVolume(w.d, w.x, {
      id: outer,
      staging: kubelet,
      cap: cap(),
      publishPool: undefined,
      poolId: undefined,
      publishedReadOnly: false,
    });
    w.host.addPath(STAGING);
    w.host.addPath(path.dirname(TARGET));
    const { id } = await newVolume(w);
    // STAGING lies beneath the kubelet's root: inside a mounted volume, unless that is the kubelet's.
    const stageRefused = await codeOf(stage(w, id));
    w.d.kubeletDir = kubelet;
    await stage(w, id);
    w.d.kubeletDir = undefined;
    const refused = await codeOf(publish(w, id));
    w.d.kubeletDir = kubelet;
    const published = await codeOf(publish(w, id));
    expect({ stageRefused, refused, published }).toEqual({
      stageRefused: 'INVALID_ARGUMENT',
      refused: 'INVALID_ARGUMENT',
      published: 'OK',
    });
  });

  it('a pool replaced by another is never read as "volume gone" nor as "never formatted"', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    // Another export mounted where the pool's was, under the driver: another pool is there.
    const aside = `${w.pool.root}.aside`;
    await fs.rename(w.pool.root, aside);
    await Pool.open(w.pool.root, 'another', log);
    const codes = {
      initialized: await codeOf(w.volumes.isInitialized(id)),
      dropLease: await codeOf(w.volumes.dropLease(id, NODE)),
      unpublishFromNode: await codeOf(w.volumes.unpublish(id, NODE)),
    };
    await fs.rm(w.pool.root, { recursive: true });
    await fs.rename(aside, w.pool.root);
    expect({ codes, lease: (await w.volumes.lease(id, NODE))?.node }).toEqual({
      codes: { initialized: 'UNAVAILABLE', dropLease: 'UNAVAILABLE', unpublishFromNode: 'UNAVAILABLE' },
      lease: NODE,
    });
  });

  it('keeps the lease when the rollback cannot detach the volume (something still holds it)', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    w.host.killAfter('mount');
    w.host.failWhen((op) => op.startsWith('umount '), commandError('umount', 'target is busy'));
    expect(await codeOf(stage(w, id))).toBe('INTERNAL');
    expect(w.host.mountsAt(STAGING)).toHaveLength(1); // still mounted: the volume is in use here
    expect(await w.volumes.lease(id, NODE)).toMatchObject({ node: NODE }); // so no other node may stage it
  });

  it('undoes the mount, the attachment and the lease when the caller gives up once it is mounted', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    const caller = new AbortController();
    const x = bindExec(noCommands, { log, signal: caller.signal, deadline: Infinity });
    const mount = w.host.mount.bind(w.host);
    w.host.mount = async (cx, m) => {
      await mount(cx, m);
      caller.abort();
    };
    const staged = stageVolume(w.d, x, {
      id,
      staging: STAGING,
      cap: cap(),
      publishPool: undefined,
      poolId: undefined,
      publishedReadOnly: false,
    });
    expect(await codeOf(staged)).toBe('CANCELLED');
    expect(w.host.ops.slice(-2)).toEqual([`umount ${STAGING}`, 'detach loop0']);
    await expectNothingLeft(w, id);
  });
});

describe('NodeUnstageVolume', () => {
  it('unmounts, detaches and drops the lease; a second unstage touches nothing', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    expect(await during(w, () => unstage(w, id))).toEqual({
      code: 'OK',
      ops: [`thaw ${STAGING}`, `umount ${STAGING}`, 'detach loop0'],
    });
    await expectNothingLeft(w, id);
    expect(await during(w, () => unstage(w, id))).toEqual({ code: 'OK', ops: [] });
  });

  it.each([
    ['its own boot id', false],
    ['a boot id equal to this one (both unreadable)', true],
  ])(
    'tears down its own reader staging of a volume another host, with %s, reads too (the same kubelet staging path)',
    async (_, sameBoot) => {
      const w = await world();
      const { id, image } = await newVolume(w);
      const rox = { mode: 'MULTI_NODE_READER_ONLY' as const };
      const other = anotherHost(w, 'node-c');
      const c = sameBoot ? { ...other, d: { ...other.d, bootId: w.d.bootId } } : other;
      expect(await codeOf(stage(c, id, rox))).toBe('OK');
      w.host.content.set(image, must(c.host.content.get(image), 'the image as node-c formatted it'));
      expect(await codeOf(stage(w, id, rox))).toBe('OK');
      expect(await codeOf(publish(w, id, rox, true))).toBe('OK');
      expect(await codeOf(unpublish(w, id))).toBe('OK');
      expect(await codeOf(unstage(w, id))).toBe('OK');
      await expectNothingLeft(w, id);
      // node-c still reads it, untouched.
      expect((await w.volumes.lease(id, 'node-c'))?.readonly).toBe(true);
      expect(c.host.table.filter((m) => m.mountPoint === STAGING)).toHaveLength(1);
    },
  );

  it('thaws a frozen filesystem before unmounting it, so no superblock is left holding the device', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await w.host.freeze(w.x, STAGING);
    expect(await during(w, () => unstage(w, id))).toEqual({
      code: 'OK',
      ops: [`thaw ${STAGING}`, `umount ${STAGING}`, 'detach loop0'],
    });
    expect(w.host.heldElsewhere.size).toBe(0);
    await expectNothingLeft(w, id);
  });

  it('refuses with FAILED_PRECONDITION while the volume is published, leaving it all in place', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    expect(await during(w, () => unstage(w, id))).toEqual({ code: 'FAILED_PRECONDITION', ops: [] });
    expect(w.host.table.map((m) => m.mountPoint)).toEqual([STAGING, TARGET]);
    expect([...w.host.attached.keys()]).toEqual(['loop0']);
    expect(await w.volumes.lease(id, NODE)).toBeDefined();
  });

  it.each([
    ['by device and inode', true],
    ['by the path sysfs shows, when identities cannot be read', false],
  ])(
    'finds its loop device %s after a new container sees another backing path',
    async (_how, identityReadable) => {
      const w = await world();
      const { id } = await newVolume(w);
      await stage(w, id);
      // The path as the plugin that attached it saw it, in a mount namespace that is gone.
      must(w.host.attached.get('loop0'), 'loop0').backingFile = `/volumes/${id}/disk.img`;
      w.host.identityReadable = identityReadable;
      expect(await during(w, () => unstage(w, id))).toEqual({
        code: 'OK',
        ops: [`thaw ${STAGING}`, `umount ${STAGING}`, 'detach loop0'],
      });
      await expectNothingLeft(w, id);
    },
  );

  it('leaves a loop device at the staging path whose backing file is another one, by identity and by path', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    const loop = must(w.host.attached.get('loop0'), 'loop0');
    loop.identity = { dev: '0:77', ino: '12' };
    // A path naming the volume with another identity is the volume's image through a pool mounted
    // again (the lease's device at its staging path is released: fence-guard.test.ts); another path is not.
    loop.backingFile = '/other-pool/volumes/vol-00000000000000000000000000000000/disk.img';
    expect(await during(w, () => unstage(w, id))).toEqual({ code: 'FAILED_PRECONDITION', ops: [] });
    expect(w.host.mountsAt(STAGING)).toHaveLength(1);
    expect([...w.host.attached.keys()]).toEqual(['loop0']);
  });

  it('refuses with FAILED_PRECONDITION a staging path that holds a foreign mount, and leaves it', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    const foreign = w.host.addForeignMount(STAGING);
    expect(await during(w, () => unstage(w, id))).toEqual({ code: 'FAILED_PRECONDITION', ops: [] });
    expect(w.host.table).toEqual([foreign]);
  });
});

describe('NodePublishVolume', () => {
  it('binds the staged filesystem at a target it creates; a second publish touches nothing', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    expect(await during(w, () => publish(w, id))).toEqual({
      code: 'OK',
      ops: [`mkdir ${path.dirname(TARGET)}`, `mkdir ${TARGET}`, `bind ${STAGING} ${TARGET}`],
    });
    expect(w.host.mountsAt(TARGET)).toMatchObject([{ root: '/', source: '/dev/loop0', fsType: 'ext4' }]);
    expect(await during(w, () => publish(w, id))).toEqual({ code: 'OK', ops: [] });
  });

  it.each([
    ['util-linux keeps them', false],
    ['util-linux drops them, so the bind is remounted', true],
  ])(
    "publishes read-only with the staging mount's nosuid, nodev and noexec when %s",
    async (_how, dropped) => {
      const w = await world();
      const { id } = await newVolume(w);
      await stage(w, id, { mountFlags: ['nosuid', 'nodev', 'noexec'] });
      w.host.bindDropsFlags = dropped;
      const { code, ops } = await during(w, () => publish(w, id, {}, true));
      expect(code).toBe('OK');
      expect(ops).toContain(`bind ${STAGING} ${TARGET} -o ro,nosuid,nodev,noexec`);
      expect(ops.includes(`remount ${TARGET} -o ro,nosuid,nodev,noexec`)).toBe(dropped);
      expect(w.host.mountsAt(TARGET)[0]?.options).toEqual(['ro', 'nosuid', 'nodev', 'noexec']);
      expect(w.host.mountsAt(STAGING)[0]?.options).toEqual(['rw', 'nosuid', 'nodev', 'noexec']);
    },
  );

  it('a retry after a publish cut short between the bind and its remount keeps the security flags', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id, { mountFlags: ['nosuid', 'nodev', 'noexec'] });
    await publish(w, id);
    // What a driver killed right after the bind (on a util-linux that drops the flags) leaves.
    const bound = w.host.mountsAt(TARGET).at(-1);
    if (!bound) throw new Error('not published');
    bound.options = ['rw'];
    expect(await during(w, () => publish(w, id))).toEqual({
      code: 'OK',
      ops: [`remount ${TARGET} -o nosuid,nodev,noexec`],
    });
    expect(w.host.mountsAt(TARGET)[0]?.options).toEqual(['rw', 'nosuid', 'nodev', 'noexec']);
    expect(await during(w, () => publish(w, id))).toEqual({ code: 'OK', ops: [] });
  });

  it.each<[string, boolean]>([
    ['mkdir', false],
    ['bind', false],
    ['remount', true],
  ])('undoes the target when %s fails, leaving the staging as it was', async (op, dropped) => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id, { mountFlags: ['nosuid'] });
    const staged = structuredClone(w.host.table);
    w.host.bindDropsFlags = dropped;
    w.host.failNext(op);
    expect(await codeOf(publish(w, id, {}, true))).toBe('INTERNAL');
    expect(w.host.kindOf(TARGET)).toBe('absent');
    expect(w.host.table).toEqual(staged);
    expect([...w.host.attached.keys()]).toEqual(['loop0']);
    expect(await w.volumes.lease(id, NODE)).toMatchObject({ stagingPath: STAGING });
  });

  it('undoes the target file of a block publish whose bind fails', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id, { accessType: 'block', fsType: '' });
    w.host.failNext('bind');
    const { code, ops } = await during(w, () => publish(w, id, { accessType: 'block', fsType: '' }, true));
    expect(code).toBe('INTERNAL');
    expect(ops).toEqual([
      `mkdir ${path.dirname(TARGET)}`,
      `create ${TARGET}`,
      `bind /dev/loop0 ${TARGET} -o ro (failed)`,
      `remove ${TARGET}`,
    ]);
    expect([...w.host.attached.keys()]).toEqual(['loop0']);
    expect(w.host.table).toEqual([]);
  });

  it('refuses a second target of a single-node-writer volume with FAILED_PRECONDITION, creating nothing', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    const second = `${path.dirname(TARGET)}-2/mount`;
    expect(await during(w, () => publish(w, id, {}, false, second))).toEqual({
      code: 'FAILED_PRECONDITION',
      ops: [],
    });
    expect(w.host.kindOf(second)).toBe('absent');
    expect(w.host.table.map((m) => m.mountPoint)).toEqual([STAGING, TARGET]);
  });

  it('refuses with INVALID_ARGUMENT a target that is a symlink, and binds nothing', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    w.host.addPath(TARGET, { kind: 'symlink', target: '/srv/data' });
    expect(await during(w, () => publish(w, id))).toEqual({ code: 'INVALID_ARGUMENT', ops: [] });
    expect(w.host.kindOf(TARGET)).toBe('symlink');
  });
});

describe('NodeUnpublishVolume', () => {
  it('unmounts and removes the target; a second unpublish touches nothing', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    expect(await during(w, () => unpublish(w, id))).toEqual({
      code: 'OK',
      ops: [`umount ${TARGET}`, `remove ${TARGET}`],
    });
    expect(w.host.kindOf(TARGET)).toBe('absent');
    expect(w.host.mountsAt(STAGING)).toHaveLength(1);
    expect(await during(w, () => unpublish(w, id))).toEqual({ code: 'OK', ops: [] });
  });

  it('undoes a bind that took effect although its command was reported killed', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    w.host.killAfter('bind');
    expect(await codeOf(publish(w, id))).toBe('INTERNAL');
    expect(w.host.mountsAt(TARGET)).toEqual([]);
    expect(w.host.kindOf(TARGET)).toBe('absent');
    expect(w.host.mountsAt(STAGING)).toHaveLength(1);
  });

  it('binds a read-only block publish to the staged device itself, and keeps it at unpublish', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    const block: Partial<Capability> = { accessType: 'block', fsType: '' };
    await stage(w, id, block);
    await publish(w, id, block, true);
    expect(w.host.mountsAt(TARGET)).toMatchObject([{ root: '/loop0', options: ['ro'] }]);
    expect(await during(w, () => unpublish(w, id))).toEqual({
      code: 'OK',
      ops: [`umount ${TARGET}`, `remove ${TARGET}`],
    });
    expect([...w.host.attached.keys()]).toEqual(['loop0']);
  });

  it('attaches a raw block volume at the sector size its data was first written on, on every node', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    const block: Partial<Capability> = { accessType: 'block', fsType: '' };
    const sectors = async (h: World) => h.host.sectorSize(must(h.host.attached.get('loop0'), 'loop0'));
    await stage(w, id, block);
    const first = await sectors(w);
    const marker = JSON.parse(await fs.readFile(path.join(w.root, 'volumes', id, 'initialized'), 'utf8')) as {
      sectorSize?: number;
    };
    await unstage(w, id);
    // Its image now shares blocks on an XFS pool: the kernel would give 4096.
    w.host.kernelSectorSize = 4096;
    await stage(w, id, block);
    const again = await sectors(w);
    await unstage(w, id);
    // Another node whose kernel makes 4096 of the same pool's images from the start.
    const c = anotherHost(w, 'node-c');
    c.host.kernelSectorSize = 4096;
    await w.volumes.unpublish(id, NODE);
    await attachTo(w, id, 'node-c');
    await stage(c, id, block);
    expect({ first, recorded: marker.sectorSize, again, other: await sectors(c) }).toEqual({
      first: 512,
      recorded: 512,
      again: 512,
      other: 512,
    });
  });

  it('attaches again a leftover raw block device that is not at the recorded sector size', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    const block: Partial<Capability> = { accessType: 'block', fsType: '' };
    await stage(w, id, block);
    await unstage(w, id);
    // A stage killed between the attach and setting the device's sector size left this one.
    w.host.kernelSectorSize = 4096;
    await w.host.attach(w.x, image, undefined, { readOnly: false, directIo: false });
    await stage(w, id, block);
    expect([...w.host.attached.values()].map((l) => l.sectorSize)).toEqual([512]);
  });

  it.each<[string, Partial<Capability>]>([
    ['a raw block device not at the recorded sector size', { accessType: 'block', fsType: '' }],
    ['a device attached the other way round', { mode: 'SINGLE_NODE_READER_ONLY' }],
  ])(
    'refuses with FAILED_PRECONDITION to attach a second device while a process holds %s open',
    async (_what, over) => {
      const w = await world();
      const { id, image } = await newVolume(w);
      await stage(w, id, over.accessType === 'block' ? over : {});
      await unstage(w, id);
      // A leftover device (killed calls left it) that some process on this host still has open.
      w.host.kernelSectorSize = 4096;
      await w.host.attach(w.x, image, undefined, { readOnly: false, directIo: false });
      w.host.heldOpen.add('/dev/loop0');
      const { code, ops } = await during(w, () => stage(w, id, over));
      expect(code).toBe('FAILED_PRECONDITION');
      expect(ops.filter((o) => o.startsWith('attach'))).toEqual([]); // no second device
      expect([...w.host.attached.keys()]).toEqual(['loop0']);
      // Still attached and open here: the lease stays, so that no other node stages it meanwhile.
      expect(await w.volumes.lease(id, NODE)).toMatchObject({ node: NODE });
    },
  );

  it("leaves a filesystem volume's device at the kernel's sector size (its filesystem's blocks are larger)", async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await unstage(w, id);
    w.host.kernelSectorSize = 4096;
    await stage(w, id);
    expect(await w.host.sectorSize(must(w.host.attached.get('loop0'), 'loop0'))).toBe(4096);
  });

  it.each<[string, (root: string, id: string) => string]>([
    ['the root', () => '/'],
    ['the pool', (root) => root],
    ["a volume's directory", (root, id) => `${root}/volumes/${id}`],
    ["a volume's image", (root, id) => `${root}/volumes/${id}/disk.img`],
    ['a directory holding the pool', (root) => path.dirname(root)],
    ['a symlink into the pool', () => '/var/lib/kubelet/pods/pod-1/into-pool'],
  ])('refuses %s with INVALID_ARGUMENT and removes nothing', async (_what, target) => {
    const w = await world();
    const { id, image } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    w.host.addPath('/var/lib/kubelet/pods/pod-1/into-pool', { kind: 'symlink', target: `${w.root}/volumes` });
    const before = structuredClone(w.host.table);
    expect(await during(w, () => unpublish(w, id, target(w.root, id)))).toEqual({
      code: 'INVALID_ARGUMENT',
      ops: [],
    });
    expect(w.host.table).toEqual(before);
    expect((await fs.stat(image)).size).toBe(SIZE);
  });

  it('refuses with FAILED_PRECONDITION a target holding a foreign mount, and leaves the mount', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    w.host.addPath(TARGET);
    const foreign = w.host.addForeignMount(TARGET);
    expect(await during(w, () => unpublish(w, id))).toEqual({ code: 'FAILED_PRECONDITION', ops: [] });
    expect(w.host.mountsAt(TARGET)).toEqual([foreign]);
    expect(w.host.kindOf(TARGET)).toBe('directory');
  });

  it('leaves a foreign mount stacked on the target after the look, and the volume under it (FAILED_PRECONDITION)', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    const bind = w.host.mountsAt(TARGET);
    let foreign: unknown;
    const unmountAll = w.host.unmountAll.bind(w.host);
    w.host.unmountAll = (...args) => {
      foreign = w.host.addForeignMount(TARGET); // mounted between the call's look and its umount
      return unmountAll(...args);
    };
    expect(await codeOf(unpublish(w, id))).toBe('FAILED_PRECONDITION');
    expect(w.host.mountsAt(TARGET)).toEqual([...bind, foreign]);
  });

  it.each<[string, (host: FakeHost) => void, string]>([
    [
      'a file holding data',
      (h) => {
        h.addPath(TARGET, { kind: 'file', size: 10 });
      },
      'file',
    ],
    [
      'a symlink',
      (h) => {
        h.addPath(TARGET, { kind: 'symlink', target: '/srv/data' });
      },
      'symlink',
    ],
    [
      'a directory that is not empty',
      (h) => {
        h.addPath(`${TARGET}/notes.txt`, { kind: 'file', size: 3 });
      },
      'directory',
    ],
  ])('never removes %s (FAILED_PRECONDITION)', async (_what, put, kind) => {
    const w = await world();
    const { id } = await newVolume(w);
    w.host.addPath('/srv/data');
    put(w.host);
    expect(await during(w, () => unpublish(w, id))).toEqual({ code: 'FAILED_PRECONDITION', ops: [] });
    expect(w.host.kindOf(TARGET)).toBe(kind);
    expect(w.host.kindOf('/srv/data')).toBe('directory');
  });
});

describe('NodeGetVolumeStats', () => {
  it('reports bytes and inodes of a healthy published volume', async () => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    const used = Math.floor(SIZE / 10); // what the fake's statfs says
    expect(await volumeStats(w.d, w.x, { id, volumePath: TARGET })).toEqual({
      usage: [
        { unit: 'BYTES', total: String(SIZE), available: String(SIZE - used), used: String(used) },
        { unit: 'INODES', total: '1024', available: '1000', used: '24' },
      ],
      condition: { abnormal: false, message: 'The volume is attached, mounted and healthy.' },
    });
  });

  it.each<[string, (w: World) => unknown, RegExp]>([
    [
      'nothing is mounted at the path',
      (w) => w.host.unmountAll(w.x, TARGET, undefined, () => true),
      /not mounted/,
    ],
    [
      'the filesystem went read-only underneath',
      (w) => (must(w.host.mountsAt(TARGET)[0], 'mount').superOptions = ['ro']),
      /went read-only/,
    ],
    [
      'the filesystem does not answer',
      (w) => {
        w.host.failNext('usage', Object.assign(new Error('I/O'), { code: 'EIO' }));
      },
      /does not answer \(EIO\)/,
    ],
    ['the loop device is gone', (w) => w.host.attached.delete('loop0'), /detached or backed by another file/],
  ])('reports an abnormal condition when %s', async (_what, breakIt, message) => {
    const w = await world();
    const { id } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    await breakIt(w);
    const stats = await volumeStats(w.d, w.x, { id, volumePath: TARGET });
    expect(stats.condition.abnormal).toBe(true);
    expect(stats.condition.message).toMatch(message);
  });

  it.each<[string, string, (root: string) => string]>([
    ['an absent path', 'NOT_FOUND', () => '/var/lib/kubelet/pods/pod-9/nothing'],
    ['a relative path', 'NOT_FOUND', () => 'pods/pod-1'],
    ['a path in the pool', 'INVALID_ARGUMENT', (root) => `${root}/volumes`],
  ])('answers %s with %s', async (_what, code, volumePath) => {
    const w = await world();
    const { id } = await newVolume(w);
    expect(await codeOf(volumeStats(w.d, w.x, { id, volumePath: volumePath(w.root) }))).toBe(code);
  });
});

describe('NodeExpandVolume', () => {
  it('refreshes the loop device and grows the mounted filesystem to the grown image', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    await stage(w, id);
    await publish(w, id);
    await fs.truncate(image, 2 * SIZE);
    let size = 0;
    const { code, ops } = await during(w, async () => {
      size = await expandVolume(w.d, w.x, { id, volumePath: TARGET, requiredBytes: 2 * SIZE, limitBytes: 0 });
    });
    expect({ code, ops, size }).toEqual({
      code: 'OK',
      ops: ['refresh loop0', 'grow-online ext4 /dev/loop0'],
      size: 2 * SIZE,
    });
    expect((await w.host.usage(TARGET)).totalBytes).toBe(2 * SIZE);
  });

  it('grows a large filesystem by an expansion smaller than half a percent of it, online and at stage', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    const TiB = 2 ** 40;
    await fs.truncate(image, TiB); // sparse: formatted (by the fake) at 1 TiB
    await stage(w, id);
    await publish(w, id);
    await fs.truncate(image, TiB + 1024 * MiB);
    const online = await during(w, () =>
      expandVolume(w.d, w.x, { id, volumePath: TARGET, requiredBytes: TiB + 1024 * MiB, limitBytes: 0 }),
    );
    await unpublish(w, id);
    await unstage(w, id);
    await fs.truncate(image, TiB + 2048 * MiB);
    await stage(w, id);
    expect({ online: online.ops, staged: (await w.host.usage(STAGING)).totalBytes }).toEqual({
      online: ['refresh loop0', 'grow-online ext4 /dev/loop0'],
      staged: TiB + 2048 * MiB,
    });
  });

  it('leaves an ext4 as large as mkfs made it (a last block group too small to keep): no forced check at stage', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    // 6 MiB short of its device, as mke2fs leaves a 6277 MiB device: resize2fs has nothing to do.
    w.host.content.set(image, { kind: 'filesystem', type: 'ext4', size: SIZE - 6 * MiB });
    const { code, ops } = await during(w, () => stage(w, id));
    expect({ code, grew: ops.filter((op) => op.startsWith('grow')) }).toEqual({ code: 'OK', grew: [] });
  });

  it('grows a filesystem a pod has read-only through its read-write staging mount', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    await stage(w, id);
    await publish(w, id, undefined, true);
    await fs.truncate(image, 2 * SIZE);
    const { code, ops } = await during(w, () =>
      expandVolume(w.d, w.x, { id, volumePath: TARGET, requiredBytes: 2 * SIZE, limitBytes: 0 }),
    );
    expect({ code, ops, size: (await w.host.usage(TARGET)).totalBytes }).toEqual({
      code: 'OK',
      ops: ['refresh loop0', 'grow-online ext4 /dev/loop0'],
      size: 2 * SIZE,
    });
  });

  it('does not grow a filesystem a pod has read-only once an error stopped it (ext4 emergency_ro, rw left in place)', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    await stage(w, id);
    await publish(w, id, undefined, true);
    for (const m of w.host.table) if (m.source === '/dev/loop0') m.superOptions = ['rw', 'emergency_ro'];
    await fs.truncate(image, 2 * SIZE);
    const { code, ops } = await during(w, () =>
      expandVolume(w.d, w.x, { id, volumePath: TARGET, requiredBytes: 2 * SIZE, limitBytes: 0 }),
    );
    expect({ code, grew: ops.filter((op) => op.startsWith('grow')) }).toEqual({
      code: 'FAILED_PRECONDITION',
      grew: [],
    });
  });

  it('refuses a limit below the image without growing a raw block device (its refresh is the growth)', async () => {
    const w = await world();
    const { id, image } = await newVolume(w);
    const block = { accessType: 'block' as const, fsType: '' };
    await stage(w, id, block);
    await publish(w, id, block);
    await fs.truncate(image, 2 * SIZE); // ControllerExpandVolume grew the image
    const { code, ops } = await during(w, () =>
      expandVolume(w.d, w.x, { id, volumePath: TARGET, requiredBytes: 0, limitBytes: SIZE }),
    );
    expect({ code, ops }).toEqual({ code: 'OUT_OF_RANGE', ops: [] });
    expect([...w.host.attached.values()].map((l) => l.sizeBytes)).toEqual([SIZE]);
  });

  it.each<[string, Partial<Capability>, (w: World) => unknown, number, string, number?]>([
    ['the image is smaller than asked for', {}, () => undefined, 4 * SIZE, 'FAILED_PRECONDITION'],
    // spec.md, NodeExpandVolume errors: a capacity range not allowed is OUT_OF_RANGE.
    ['the image is larger than the limit', {}, () => undefined, 0, 'OUT_OF_RANGE', SIZE],
    [
      'the volume is mounted read-only',
      { mode: 'SINGLE_NODE_READER_ONLY' },
      () => undefined,
      0,
      'FAILED_PRECONDITION',
    ],
    [
      'a mounted ext4 cannot be grown here',
      {},
      (w) => {
        w.host.failNext('grow-online', new OnlineGrowthUnsupported('needs CAP_SYS_RESOURCE'));
      },
      0,
      'FAILED_PRECONDITION',
    ],
    [
      'nothing is mounted at the path',
      {},
      (w) => w.host.unmountAll(w.x, TARGET, undefined, () => true),
      0,
      'NOT_FOUND',
    ],
  ])(
    'refuses when %s, leaving the filesystem as it was',
    async (_what, over, setup, required, code, limit = 0) => {
      const w = await world();
      const { id, image } = await newVolume(w);
      await stage(w, id, over);
      await publish(w, id, over);
      await fs.truncate(image, 2 * SIZE);
      await setup(w);
      expect(
        await codeOf(
          expandVolume(w.d, w.x, { id, volumePath: TARGET, requiredBytes: required, limitBytes: limit }),
        ),
      ).toBe(code);
      expect(w.host.content.get(image)).toEqual({ kind: 'filesystem', type: 'ext4', size: SIZE });
    },
  );
});
