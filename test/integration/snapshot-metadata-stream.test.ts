/**
 * The SnapshotMetadata streams to the letter (root only): the spec's error codes, max_results and
 * starting_offset at their boundaries, resuming an interrupted stream, and a cancelled stream that
 * stops reading (contents) or kills its tool (extent maps) at once. A client that does not read pauses
 * the work instead of letting it run on.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { SnapshotMetadataClient } from '../../src/gen/csi/v1/SnapshotMetadata.js';
import type { DriverProcess } from '../helpers/driver.js';
import { blockCap, TestEnv } from '../helpers/env.js';
import { isRoot, MiB, scratchFilesystem } from '../helpers/host.js';
import { allocated, delta, metadataClient, type Tuple } from '../helpers/metadata.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const K = 1024;
const SIZE = 8 * MiB;
/** The data of the first snapshot: a block at 0, 64 KiB at 1 MiB, a block at 5 MiB, the last block. */
const LAYOUT: Tuple[] = [
  { offset: 0, length: 4 * K },
  { offset: MiB, length: 64 * K },
  { offset: 5 * MiB, length: 4 * K },
  { offset: SIZE - 4 * K, length: 4 * K },
];

async function writeAt(file: string, tuples: readonly Tuple[], fill: number): Promise<void> {
  const h = await fs.open(file, 'r+');
  try {
    for (const t of tuples) await h.write(Buffer.alloc(t.length, fill), 0, t.length, t.offset);
    await h.sync();
  } finally {
    await h.close();
  }
}

async function volumeWithSnapshots(
  d: DriverProcess,
  name: string,
  size: number,
  first: (image: string) => Promise<void>,
  second: (image: string) => Promise<void>,
): Promise<{ volumeId: string; a: string; b: string }> {
  const vol = await d.clients.controller.CreateVolume({
    name,
    capacity_range: { required_bytes: String(size) },
    volume_capabilities: [blockCap()],
  });
  const volumeId = vol.volume?.volume_id ?? '';
  const image = path.join(d.poolDir, 'volumes', volumeId, 'disk.img');
  await first(image);
  const a = await d.clients.controller.CreateSnapshot({ name: `${name}-a`, source_volume_id: volumeId });
  await second(image);
  const b = await d.clients.controller.CreateSnapshot({ name: `${name}-b`, source_volume_id: volumeId });
  return { volumeId, a: a.snapshot?.snapshot_id ?? '', b: b.snapshot?.snapshot_id ?? '' };
}

describe.skipIf(!isRoot())('the SnapshotMetadata streams', () => {
  let d: DriverProcess;
  let client: SnapshotMetadataClient;
  let a = '';
  let b = '';
  let other = '';

  beforeAll(async () => {
    d = await env.driver({ dir: await env.dir('cbt-stream'), logLevel: 'info' });
    client = metadataClient(d.endpoint);
    ({ a, b } = await volumeWithSnapshots(
      d,
      'cbt-stream',
      SIZE,
      (img) => writeAt(img, LAYOUT, 0x41),
      (img) => writeAt(img, [{ offset: 2 * MiB, length: 4 * K }], 0x42),
    ));
    ({ a: other } = await volumeWithSnapshots(
      d,
      'cbt-other',
      SIZE,
      (img) => writeAt(img, [{ offset: 0, length: 4 * K }], 1),
      () => Promise.resolve(),
    ));
  });
  afterAll(() => {
    client.close();
  });

  const all = (req: { starting_offset?: number | string; max_results?: number }) =>
    allocated(client, { snapshot_id: a, starting_offset: 0, max_results: 0, ...req });

  it('lists the data ranges, merged, with the capacity and style in every message', async () => {
    const s = await all({});
    expect(s.code).toBe('OK');
    expect(s.tuples).toEqual(LAYOUT);
    expect(s.messages).toHaveLength(1);
    expect(s.messages[0]).toMatchObject({
      block_metadata_type: 'VARIABLE_LENGTH',
      volume_capacity_bytes: String(SIZE),
    });
  });

  it.each([
    [1, [1, 1, 1, 1]],
    [3, [3, 1]],
    [4, [4]],
    [5, [4]],
  ])('max_results %d gives messages of %j tuples', async (max, sizes) => {
    const s = await all({ max_results: max });
    expect(s.code).toBe('OK');
    expect(s.messages.map((m) => m.block_metadata.length)).toEqual(sizes);
    expect(s.tuples).toEqual(LAYOUT);
    for (const m of s.messages) expect(m.volume_capacity_bytes).toBe(String(SIZE));
  });

  it.each<[string, number, Tuple[]]>([
    ['zero', 0, LAYOUT],
    ['inside the first range', 2 * K, [{ offset: 2 * K, length: 2 * K }, ...LAYOUT.slice(1)]],
    ['at the end of the first range', 4 * K, LAYOUT.slice(1)],
    ['in a hole', 3 * MiB, LAYOUT.slice(2)],
    [
      'at the last byte of a range',
      MiB + 64 * K - 1,
      [{ offset: MiB + 64 * K - 1, length: 1 }, ...LAYOUT.slice(2)],
    ],
    ['at the last byte of the volume', SIZE - 1, [{ offset: SIZE - 1, length: 1 }]],
    ['at the end of the volume', SIZE, []],
  ])('starting_offset %s: no range ends at or before it', async (_what, from, expected) => {
    const s = await all({ starting_offset: from });
    expect(s.code).toBe('OK');
    expect(s.tuples).toEqual(expected);
    const first = s.tuples[0];
    if (first) expect(from).toBeLessThan(first.offset + first.length);
    // Even with nothing to say, one message tells the capacity.
    expect(s.messages.length).toBeGreaterThanOrEqual(1);
    expect(s.messages[0]?.volume_capacity_bytes).toBe(String(SIZE));
  });

  it('resumes an interrupted stream from the next byte after what it received', async () => {
    const cut = await all({ max_results: 1 });
    expect(cut.tuples).toEqual(LAYOUT);
    const first = await allocated(client, { snapshot_id: a, starting_offset: 0, max_results: 1 }, 2);
    expect(first.code).toBe('STOPPED');
    const last = first.tuples.at(-1);
    const rest = await all({ max_results: 1, starting_offset: (last?.offset ?? 0) + (last?.length ?? 0) });
    expect([...first.tuples, ...rest.tuples]).toEqual(LAYOUT);
  });

  it('answers the delta between two snapshots of one volume', async () => {
    const s = await delta(client, {
      base_snapshot_id: a,
      target_snapshot_id: b,
      starting_offset: 0,
      max_results: 0,
    });
    expect(s.code).toBe('OK');
    expect(s.tuples).toEqual([{ offset: 2 * MiB, length: 4 * K }]);
    const past = await delta(client, {
      base_snapshot_id: a,
      target_snapshot_id: b,
      starting_offset: 3 * MiB,
      max_results: 0,
    });
    expect(past).toMatchObject({ code: 'OK', tuples: [] });
    expect(past.messages).toHaveLength(1);
  });

  it.each<[string, string, () => Promise<{ code: string }>]>([
    ['no snapshot_id', 'INVALID_ARGUMENT', () => allocated(client, { snapshot_id: '' })],
    ['an unknown snapshot', 'NOT_FOUND', () => allocated(client, { snapshot_id: `snap-${'0'.repeat(32)}` })],
    ['a malformed id', 'NOT_FOUND', () => allocated(client, { snapshot_id: '../../etc' })],
    ['a negative starting_offset', 'OUT_OF_RANGE', () => all({ starting_offset: -1 })],
    ['a starting_offset past the volume', 'OUT_OF_RANGE', () => all({ starting_offset: SIZE + 1 })],
    ['a huge starting_offset', 'OUT_OF_RANGE', () => all({ starting_offset: '9223372036854775807' })],
    ['a negative max_results', 'INVALID_ARGUMENT', () => all({ max_results: -1 })],
    [
      'delta: no base',
      'INVALID_ARGUMENT',
      () => delta(client, { base_snapshot_id: '', target_snapshot_id: b }),
    ],
    [
      'delta: no target',
      'INVALID_ARGUMENT',
      () => delta(client, { base_snapshot_id: a, target_snapshot_id: '' }),
    ],
    [
      'delta: unknown base',
      'NOT_FOUND',
      () => delta(client, { base_snapshot_id: `snap-${'1'.repeat(32)}`, target_snapshot_id: b }),
    ],
    [
      'delta: unknown target',
      'NOT_FOUND',
      () => delta(client, { base_snapshot_id: a, target_snapshot_id: `snap-${'2'.repeat(32)}` }),
    ],
    [
      'delta: a base of another volume',
      'INVALID_ARGUMENT',
      () => delta(client, { base_snapshot_id: other, target_snapshot_id: b }),
    ],
    [
      'delta: a base taken after the target',
      'INVALID_ARGUMENT',
      () => delta(client, { base_snapshot_id: b, target_snapshot_id: a }),
    ],
    [
      'delta: the same snapshot twice',
      'INVALID_ARGUMENT',
      () => delta(client, { base_snapshot_id: a, target_snapshot_id: a }),
    ],
    [
      'delta: a negative starting_offset',
      'OUT_OF_RANGE',
      () => delta(client, { base_snapshot_id: a, target_snapshot_id: b, starting_offset: -4096 }),
    ],
    [
      'delta: a starting_offset past the volume',
      'OUT_OF_RANGE',
      () => delta(client, { base_snapshot_id: a, target_snapshot_id: b, starting_offset: SIZE + 4096 }),
    ],
    [
      'delta: a negative max_results',
      'INVALID_ARGUMENT',
      () => delta(client, { base_snapshot_id: a, target_snapshot_id: b, max_results: -5 }),
    ],
  ])('%s is %s', async (_what, code, call) => {
    const s = await call();
    expect(s.code).toBe(code);
  });

  it('keeps secrets out of its log', async () => {
    await allocated(client, { snapshot_id: a, secrets: { token: 'hunter2-metadata' } });
    await delta(client, {
      base_snapshot_id: a,
      target_snapshot_id: b,
      secrets: { token: 'hunter2-metadata' },
    });
    expect(await d.waitForLog((l) => l.includes('"GetMetadataDelta"'))).toBe(true);
    expect(d.logs().join('\n')).not.toContain('hunter2');
  });
});

/** Children of `pid` running `comm`. */
async function children(pid: number, comm: string): Promise<number[]> {
  const out: number[] = [];
  for (const e of await fs.readdir('/proc')) {
    if (!/^\d+$/.test(e)) continue;
    const stat = await fs.readFile(`/proc/${e}/stat`, 'utf8').catch(() => '');
    const m = /^\d+ \((.*)\) \S+ (\d+)/.exec(stat);
    if (m && m[1] === comm && Number(m[2]) === pid) out.push(Number(e));
  }
  return out;
}

/** Bytes the process has read through read(2) and the like. */
async function rchar(pid: number): Promise<number> {
  const io = await fs.readFile(`/proc/${pid}/io`, 'utf8');
  return Number(/rchar: (\d+)/.exec(io)?.[1] ?? 0);
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe.skipIf(!isRoot()).each([
  ['ext4', 'contents'],
  ['xfs', 'extents'],
] as const)('a cancelled stream, pool on %s (%s)', (poolFs, via) => {
  it('pauses while the client does not read, and stops its work when cancelled', async () => {
    const base = await env.dir(`cbt-cancel-${poolFs}`);
    const scratch = await scratchFilesystem(base, poolFs, 1024);
    env.declareOwn(scratch.mountPoint, scratch.device);
    const d = await env.driver({
      dir: base,
      poolDir: path.join(scratch.mountPoint, 'pool'),
      logLevel: 'info',
    });
    const client = metadataClient(d.endpoint);
    const size = 256 * MiB;
    // Every block written in A; every other block rewritten in B: 32,768 separate changed ranges.
    const { a, b } = await volumeWithSnapshots(
      d,
      'cbt-cancel',
      size,
      (img) => writeAt(img, [{ offset: 0, length: size }], 0x11),
      async (img) => {
        const h = await fs.open(img, 'r+');
        const blk = Buffer.alloc(4 * K, 0x22);
        for (let off = 0; off < size; off += 8 * K) await h.write(blk, 0, blk.length, off);
        await h.sync();
        await h.close();
      },
    );
    const pid = d.proc.pid ?? 0;
    const stream = client.GetMetadataDelta(
      { base_snapshot_id: a, target_snapshot_id: b, starting_offset: 0, max_results: 1 },
      { deadline: new Date(Date.now() + 120_000) },
    );
    let got = 0;
    stream.on('data', () => {
      got++;
      if (got === 1) stream.pause();
    });
    const ended = new Promise<string>((resolve) => {
      stream.on('error', (e: { code: number }) => {
        resolve(String(e.code));
      });
      stream.on('end', () => {
        resolve('end');
      });
    });
    // The client reads nothing more: the driver fills the transport's buffers, then waits.
    let before = await rchar(pid);
    for (let i = 0; i < 100; i++) {
      await sleep(100);
      const now = await rchar(pid);
      if (now === before) break;
      before = now;
    }
    if (via === 'extents') expect(await children(pid, 'xfs_io')).toHaveLength(2); // paused, not finished
    stream.cancel();
    expect(await ended).toBe('1'); // CANCELLED
    await sleep(300);
    const after = await rchar(pid);
    await sleep(500);
    // Nothing more is read once the call has stopped (a few KiB of housekeeping at most).
    expect((await rchar(pid)) - after).toBeLessThan(256 * K);
    expect(await children(pid, 'xfs_io')).toEqual([]);
    expect(await d.waitForLog((l) => l.includes('"GetMetadataDelta"') && l.includes('CANCELLED'))).toBe(true);
    const line = d
      .logs()
      .map(
        (l) =>
          JSON.parse(l) as {
            method?: string;
            code?: string;
            via?: string;
            bytesRead?: number;
            ranges?: number;
          },
      )
      .find((l) => l.method === 'GetMetadataDelta' && l.code === 'CANCELLED');
    expect(line?.via).toBe(via);
    // It stopped part way: not every range was found, not every byte read.
    expect(line?.ranges ?? 0).toBeLessThan(size / (8 * K));
    if (via === 'contents') expect(line?.bytesRead ?? 0).toBeLessThan(2 * size);
    client.close();
  });
});
