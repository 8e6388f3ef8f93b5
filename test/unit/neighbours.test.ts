/**
 * Which of a volume's loop devices another node plugin on this host may be using (src/node/neighbours.ts):
 * the decisions alone, from leases and a host view written out by hand. The kernel's side is in
 * test/integration/neighbours.test.ts.
 */
import { describe, expect, it } from 'vitest';
import type { LoopDevice } from '../../src/host/host.js';
import type { MountEntry } from '../../src/host/mounts.js';
import type { Exec } from '../../src/exec/runner.js';
import { holdReused } from '../../src/node/held.js';
import { lookBesideNeighbours, othersLoops, untouchable } from '../../src/node/neighbours.js';
import { namedLoop, type NodeDeps, type OnHost } from '../../src/node/on-host.js';
import { keptDevice, type Lease } from '../../src/pool/types.js';

const BOOT = 'boot-1';

const loop = (n: number, readOnly = true): LoopDevice => ({
  name: `loop${n}`,
  path: `/dev/loop${n}`,
  majorMinor: `7:${n}`,
  backingFile: '/pool/volumes/vol-1/disk.img',
  backing: { dev: '1', ino: '2' },
  readOnly,
  directIo: true,
  autoclear: false,
  sizeBytes: 1 << 26,
});

const mountOf = (n: number, mountPoint: string): MountEntry => ({
  id: 100 + n,
  parent: 1,
  majorMinor: `7:${n}`,
  root: '/',
  mountPoint,
  options: ['ro'],
  fsType: 'ext4',
  source: `/dev/loop${n}`,
  superOptions: ['ro'],
});

const lease = (node: string, more: Partial<Lease> = {}): Lease => ({
  node,
  stagingPath: `/staging/${node}`,
  accessType: 'mount',
  mode: 'MULTI_NODE_READER_ONLY',
  readonly: true,
  since: '2026-12-02T00:00:00Z',
  bootId: BOOT,
  ...more,
});

function world(leases: Lease[], loops: LoopDevice[], mounts: MountEntry[] = []): { d: NodeDeps; on: OnHost } {
  const d = {
    nodeId: 'me',
    bootId: BOOT,
    volumes: { leases: () => Promise.resolve(leases) },
  } as unknown as NodeDeps;
  const on: OnHost = {
    id: 'vol-1',
    image: '/pool/volumes/vol-1/disk.img',
    imageId: undefined,
    loops,
    allLoops: loops,
    mounts,
  };
  return { d, on };
}

const names = async (p: Promise<Set<string>>): Promise<string[]> => [...(await p)].sort();

describe("another node's stage under way on this host", () => {
  it('makes every unused device of the volume untouchable, but not the one this node staged', async () => {
    const { d, on } = world(
      [lease('me', { device: 'loop1' }), lease('other')],
      [loop(1), loop(2), loop(3, false)],
      [mountOf(1, '/staging/me')],
    );
    expect(await names(othersLoops(d, on))).toEqual([]);
    expect(await names(untouchable(d, on))).toEqual(['loop2', 'loop3']);
  });

  it("leaves a device any mount here uses to the usual judgement (this node's pods, or a staging that shows it)", async () => {
    const { d, on } = world([lease('other')], [loop(1), loop(2)], [mountOf(1, '/pods/p1')]);
    expect(await names(untouchable(d, on))).toEqual(['loop2']);
  });

  it("keeps this node's raw block device, which only its lease names (unused until published)", async () => {
    const { d, on } = world(
      [lease('me', { accessType: 'block', device: 'loop4' }), lease('other')],
      [loop(4), loop(5)],
    );
    expect(await names(untouchable(d, on))).toEqual(['loop5']);
  });

  it('counts no stage under way once the other staging shows its device', async () => {
    const { d, on } = world([lease('other')], [loop(1), loop(2)], [mountOf(1, '/staging/other')]);
    expect(await names(othersLoops(d, on))).toEqual(['loop1']);
    expect(await names(untouchable(d, on))).toEqual(['loop1']);
  });

  it("ignores another host's lease and a revoked one: they name nothing attached here", async () => {
    const { d, on } = world(
      [lease('far', { bootId: 'boot-2' }), lease('gone', { revokedAt: '2026-12-02T00:00:01Z' })],
      [loop(1), loop(2)],
    );
    expect(await names(untouchable(d, on))).toEqual([]);
  });

  it("takes a lease at this node's own staging path for its own, whatever node it names", async () => {
    const { d, on } = world([lease('me'), lease('other', { stagingPath: '/staging/me' })], [loop(1)]);
    expect(await names(untouchable(d, on))).toEqual([]);
  });

  it("takes a raw block lease that names no device yet for a stage under way, not for this node's device", async () => {
    const { d, on } = world(
      [lease('me', { accessType: 'block', device: 'loop1' }), lease('other', { accessType: 'block' })],
      [loop(1), loop(2)],
    );
    expect(await names(othersLoops(d, on))).toEqual([]);
    expect(await names(untouchable(d, on))).toEqual(['loop2']);
  });

  it('does not keep a raw block device for this node by a name its lease kept from another boot or attachment', async () => {
    const seq = (l: LoopDevice, s: string): LoopDevice => ({ ...l, seq: s });
    const other = lease('other');
    const block = (more: Partial<Lease>) => lease('me', { accessType: 'block', device: 'loop1', ...more });
    const judged = async (own: Lease, l: LoopDevice): Promise<string[]> => {
      const w = world([own, other], [l]);
      return names(untouchable(w.d, w.on));
    };
    expect(await judged(block({ bootId: 'boot-0' }), loop(1))).toEqual(['loop1']);
    expect(await judged(block({ deviceSeq: '5' }), seq(loop(1), '9'))).toEqual(['loop1']);
    expect(await judged(block({ deviceSeq: '5' }), seq(loop(1), '5'))).toEqual([]);
    expect(await judged(block({}), seq(loop(1), '9'))).toEqual([]); // named before numbers were kept
  });

  it("leaves no unused device to a filesystem staging's lease: its device is the one its mount uses", async () => {
    const { d, on } = world([lease('me', { device: 'loop1' }), lease('other')], [loop(1)]);
    expect(await names(untouchable(d, on))).toEqual(['loop1']);
  });

  it("takes another node's lease whose device name is another attachment now for a stage under way", async () => {
    const seq = (l: LoopDevice, s: string): LoopDevice => ({ ...l, seq: s });
    // Its device was loop1 at number 3; loop1 is number 7 now (this node's own), and loop2 is unused.
    const { d, on } = world(
      [
        lease('me', { accessType: 'block', device: 'loop1', deviceSeq: '7' }),
        lease('other', { accessType: 'block', device: 'loop1', deviceSeq: '3' }),
      ],
      [seq(loop(1), '7'), seq(loop(2), '8')],
    );
    expect(await names(othersLoops(d, on))).toEqual([]);
    expect(await names(untouchable(d, on))).toEqual(['loop2']);
  });
});

describe('the leases read before the look and after it (lookBesideNeighbours)', () => {
  it("keeps a neighbour's device whose unstage released the lease between the look and the reading after it", async () => {
    // The look saw loop1 unmounted (the neighbour had unmounted it and was about to detach it); by the
    // reading after, its lease was gone. Only the reading before shows whose it was.
    const { d, on } = world([], [loop(1)]);
    expect(await names(untouchable(d, on))).toEqual([]);
    const before = { ...on, leasesBefore: [lease('other', { device: 'loop1' })] };
    expect(await names(untouchable(d, before))).toEqual(['loop1']);
  });

  it('reads the leases before it looks at the host, and untouchable reads them again after', async () => {
    const order: string[] = [];
    const readings = [[lease('other', { device: 'loop1' })], []];
    const d = {
      nodeId: 'me',
      bootId: BOOT,
      volumes: {
        imagePath: () => '/pool/volumes/vol-1/disk.img',
        leases: () => {
          order.push('leases');
          return Promise.resolve(readings.shift() ?? []);
        },
      },
      host: {
        fileId: () => Promise.resolve(undefined),
        loops: () => {
          order.push('loops');
          return Promise.resolve([loop(1)]);
        },
        mounts: () => {
          order.push('mounts');
          return Promise.resolve([]);
        },
      },
    } as unknown as NodeDeps;
    const on = await lookBesideNeighbours(d, {} as Exec, 'vol-1');
    expect(await names(untouchable(d, on))).toEqual(['loop1']);
    expect(order).toEqual(['leases', 'loops', 'mounts', 'leases']);
  });
});

describe('the device a lease names (namedLoop)', () => {
  const seq = (l: LoopDevice, s: string | undefined): LoopDevice => ({ ...l, ...(s ? { seq: s } : {}) });
  const named = (more: Partial<Lease>, l: LoopDevice): string | undefined =>
    namedLoop([l], lease('me', { accessType: 'block', device: 'loop1', ...more }), BOOT)?.name;
  it('is that attachment only in this boot and, where both show one, at the same disk sequence number', () => {
    expect(named({}, loop(1))).toBe('loop1');
    expect(named({ deviceSeq: '4' }, seq(loop(1), '4'))).toBe('loop1');
    expect(named({ deviceSeq: '4' }, seq(loop(1), '5'))).toBeUndefined();
    expect(named({ deviceSeq: '4' }, seq(loop(1), undefined))).toBe('loop1'); // a kernel that shows none
    expect(named({ bootId: 'boot-0' }, loop(1))).toBeUndefined();
    const older: Lease = { ...lease('me', { accessType: 'block', device: 'loop1' }) };
    delete older.bootId; // an older release's lease
    expect(namedLoop([loop(1)], older, BOOT)?.name).toBe('loop1');
    expect(named({}, loop(2))).toBeUndefined();
  });
});

describe('the device a lease taken before its attach keeps (keptDevice)', () => {
  const before = lease('me', { accessType: 'block', device: 'loop1', deviceSeq: '4' });
  const again = lease('me', { accessType: 'block' });
  it('keeps the name and number named in the same boot, or by a release that recorded no boot', () => {
    expect(keptDevice(again, before)).toEqual({ device: 'loop1', deviceSeq: '4' });
    const older: Lease = { ...before };
    delete older.bootId;
    expect(keptDevice(again, older)).toEqual({ device: 'loop1', deviceSeq: '4' });
  });
  it('keeps nothing named in another boot, and what a lease names itself wins', () => {
    expect(keptDevice(again, { ...before, bootId: 'boot-0' })).toEqual({});
    expect(keptDevice({ ...again, device: 'loop2' }, before)).toEqual({ device: 'loop2' });
  });
});

describe('a leftover a stage would reuse (holdReused)', () => {
  /** `d` whose host shows `readings` at its rereads, one each (undefined: detached meanwhile). */
  function reuse(leases: Lease[], readings: (LoopDevice | undefined)[], openable = true) {
    const events: string[] = [];
    const d = {
      nodeId: 'me',
      bootId: BOOT,
      volumes: { leases: () => Promise.resolve(leases) },
      host: {
        hold: () => {
          events.push('hold');
          if (!openable) return Promise.resolve(undefined);
          return Promise.resolve({
            release: () => {
              events.push('release');
              return Promise.resolve();
            },
          });
        },
        reread: () => {
          const r = readings.shift();
          return r ? Promise.resolve(r) : Promise.reject(new Error('detached meanwhile'));
        },
      },
    } as unknown as NodeDeps;
    const { on } = world(leases, [loop(1)]);
    return { d, on, events };
  }
  const refuse = () => new Error('still open');
  const live = (yes: boolean) => () => Promise.resolve(yes);
  const marked = { ...loop(1), autoclear: true };

  it('is held and reused when it is still that attachment and no neighbour holds a lease', async () => {
    const { d, on, events } = reuse([lease('me')], [loop(1)]);
    const got = await holdReused(d, on, loop(1), live(false), refuse);
    expect({ name: got.loop?.name, held: got.pin !== undefined, events }).toEqual({
      name: 'loop1',
      held: true,
      events: ['hold'],
    });
  });

  it("is left alone, not even held, while a neighbour's lease is there (unless live)", async () => {
    const { d, on, events } = reuse([lease('other', { device: 'loop1' })], [loop(1)]);
    expect(await holdReused(d, on, loop(1), live(false), refuse)).toEqual({});
    expect(events).toEqual([]);
  });

  it('is reused when marked to go but live: a device beside it would be a second filesystem', async () => {
    const { d, on } = reuse([lease('other')], [marked]);
    const got = await holdReused(d, on, loop(1), live(true), refuse);
    expect(got.loop?.autoclear).toBe(true);
  });

  it('is let go of when detached meanwhile, and refused when marked to go but held by another', async () => {
    const gone = reuse([], [undefined, undefined]);
    expect(await holdReused(gone.d, gone.on, loop(1), live(false), refuse)).toEqual({});
    expect(gone.events).toEqual(['hold', 'release']);
    const kept = reuse([], [marked, marked]);
    await expect(holdReused(kept.d, kept.on, loop(1), live(false), refuse)).rejects.toThrow('still open');
    expect(kept.events).toEqual(['hold', 'release']);
  });

  it('is not used when it cannot be held (its detach under way), and refused then if live', async () => {
    const going = reuse([], [loop(1)], false);
    expect(await holdReused(going.d, going.on, loop(1), live(false), refuse)).toEqual({});
    const liveGoing = reuse([], [loop(1)], false);
    await expect(holdReused(liveGoing.d, liveGoing.on, loop(1), live(true), refuse)).rejects.toThrow(
      'still open',
    );
  });

  it("counts no lease of another boot, nor a revoked one that recorded no boot, as a neighbour's", async () => {
    const { d, on } = reuse(
      [
        lease('gone', { bootId: 'boot-0' }),
        lease('old', { bootId: undefined, revokedAt: '2026-12-01T00:00:00Z' }),
      ],
      [loop(1)],
    );
    expect((await holdReused(d, on, loop(1), live(false), refuse)).loop?.name).toBe('loop1');
  });
});
