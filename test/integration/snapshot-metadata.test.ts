/**
 * Changed block tracking, proven by rebuilding (root only): random writes, overwrites and discards on a
 * real block volume (staged and published by the driver, written through its loop device), snapshot A;
 * more of them, snapshot B. Copying only A's allocated ranges from A's image into an empty file, then
 * only the A→B delta's ranges from B's image, must give B's image byte for byte. On a pool that shares
 * extents (XFS with reflink, in a loop-mounted file) and on one that cannot (ext4), for several seeds,
 * sizes and write patterns. On the reflink pool the delta must also be precise: no larger than the
 * blocks written or discarded between the snapshots.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { blockCap, TestEnv } from '../helpers/env.js';
import { isRoot, MiB, scratchFilesystem, sha256 } from '../helpers/host.js';
import { publish, stage, teardown } from '../helpers/volumes.js';
import {
  allocated,
  copyRanges,
  delta,
  metadataClient,
  totalBytes,
  type Tuple,
  wellFormed,
} from '../helpers/metadata.js';
import type { SnapshotMetadataClient } from '../../src/gen/csi/v1/SnapshotMetadata.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const BLOCK = 4096;

/** xorshift32: the same seed, the same volume history. */
function rng(seed: number): (n: number) => number {
  let x = seed >>> 0 || 1;
  return (n) => {
    x ^= x << 13;
    x ^= x >>> 17;
    x ^= x << 5;
    return (x >>> 0) % n;
  };
}

type Op =
  | { kind: 'write'; offset: number; length: number; fill: number }
  | { kind: 'discard'; offset: number; length: number };
type Pattern = 'tiny' | 'runs' | 'edges';

/** A history step for `pattern`: writes (random bytes), overwrites, discards, and zeros written over data. */
function ops(pattern: Pattern, size: number, r: (n: number) => number, count: number): Op[] {
  const out: Op[] = [];
  const blocks = size / BLOCK;
  for (let i = 0; i < count; i++) {
    const choice = r(10);
    if (pattern === 'tiny') {
      // 4 KiB writes, some unaligned small ones, a few discards of single blocks.
      if (choice < 6) out.push({ kind: 'write', offset: r(blocks) * BLOCK, length: BLOCK, fill: 1 + r(255) });
      else if (choice < 8)
        out.push({ kind: 'write', offset: r(size - 100), length: 1 + r(100), fill: 1 + r(255) });
      else if (choice < 9) out.push({ kind: 'discard', offset: r(blocks) * BLOCK, length: BLOCK });
      else out.push({ kind: 'write', offset: r(blocks) * BLOCK, length: BLOCK, fill: 0 });
    } else if (pattern === 'runs') {
      const len = Math.min(size, (1 + r(64)) * 16 * BLOCK);
      const offset = r((size - len) / BLOCK + 1) * BLOCK;
      if (choice < 7) out.push({ kind: 'write', offset, length: len, fill: 1 + r(255) });
      else out.push({ kind: 'discard', offset, length: len });
    } else {
      // The first and last bytes and blocks of the volume, and runs that end at its last byte.
      const edge = [
        { offset: 0, length: 1 },
        { offset: size - 1, length: 1 },
        { offset: size - BLOCK, length: BLOCK },
        { offset: size - 8 * BLOCK, length: 8 * BLOCK },
        { offset: BLOCK - 1, length: 2 },
      ][r(5)] ?? { offset: 0, length: 1 };
      if (choice < 8) out.push({ kind: 'write', ...edge, fill: 1 + r(255) });
      else
        out.push({
          kind: 'discard',
          offset: Math.floor(edge.offset / BLOCK) * BLOCK,
          length: Math.ceil(((edge.offset % BLOCK) + edge.length) / BLOCK) * BLOCK,
        });
    }
  }
  return out;
}

/** Applies `list` to the block device at `dev`; returns the 4 KiB blocks touched. */
async function apply(dev: string, list: readonly Op[], r: (n: number) => number): Promise<Set<number>> {
  const touched = new Set<number>();
  const handle = await fs.open(dev, 'r+');
  try {
    for (const op of list) {
      for (let b = Math.floor(op.offset / BLOCK); b < Math.ceil((op.offset + op.length) / BLOCK); b++)
        touched.add(b);
      if (op.kind === 'write') {
        const buf = Buffer.alloc(op.length, op.fill);
        // Not one repeated byte: a content comparison must see real differences.
        for (let i = 0; i < buf.length; i += 97) buf[i] = op.fill === 0 ? 0 : r(256);
        await handle.write(buf, 0, buf.length, op.offset);
      }
    }
    await handle.sync();
  } finally {
    await handle.close();
  }
  for (const op of list) {
    if (op.kind === 'discard')
      execFileSync('blkdiscard', ['-o', String(op.offset), '-l', String(op.length), dev]);
  }
  return touched;
}

describe.skipIf(!isRoot()).each([
  ['xfs', true],
  ['ext4', false],
] as const)('rebuilding snapshots from their metadata, pool on %s', (poolFs, reflink) => {
  let base = '';
  let d: DriverProcess;
  let client: SnapshotMetadataClient;

  beforeAll(async () => {
    base = await env.dir(`cbt-${poolFs}`);
    const scratch = await scratchFilesystem(base, poolFs, 1024);
    env.declareOwn(scratch.mountPoint, scratch.device);
    d = await env.driver({ dir: base, poolDir: path.join(scratch.mountPoint, 'pool'), logLevel: 'info' });
    client = metadataClient(d.endpoint);
  });
  afterAll(() => {
    client.close();
  });

  const cases: [Pattern, number, number][] = [
    ['tiny', 8 * MiB, 1],
    ['tiny', 64 * MiB, 2],
    ['runs', 16 * MiB, 3],
    ['runs', 96 * MiB, 4],
    ['edges', 8 * MiB, 5],
    ['edges', 32 * MiB, 6],
    ['tiny', 32 * MiB, 7],
  ];

  it.each(cases)('pattern %s, %d bytes, seed %d', async (pattern, size, seed) => {
    const r = rng(seed * 7919 + (reflink ? 1 : 0));
    const name = `cbt-${pattern}-${size}-${seed}`;
    const cap = blockCap();
    const vol = await d.clients.controller.CreateVolume({
      name,
      capacity_range: { required_bytes: String(size) },
      volume_capabilities: [cap],
    });
    const id = vol.volume?.volume_id ?? '';
    const staging = path.join(base, `staging-${name}`);
    const target = path.join(base, 'pod', name);
    const session = async <T>(fn: () => Promise<T>): Promise<T> => {
      await stage(d, id, staging, cap);
      await publish(d, id, staging, target, cap);
      try {
        return await fn();
      } finally {
        await teardown(d, id, staging, target);
      }
    };
    const count = pattern === 'runs' ? 12 : pattern === 'edges' ? 6 : 150;
    await session(() => apply(target, ops(pattern, size, r, count), r));
    const a = await d.clients.controller.CreateSnapshot({ name: `${name}-a`, source_volume_id: id });
    const touched = await session(() => apply(target, ops(pattern, size, r, count), r));
    const b = await d.clients.controller.CreateSnapshot({ name: `${name}-b`, source_volume_id: id });
    const aId = a.snapshot?.snapshot_id ?? '';
    const bId = b.snapshot?.snapshot_id ?? '';
    const aImage = path.join(d.poolDir, 'snapshots', aId, 'disk.img');
    const bImage = path.join(d.poolDir, 'snapshots', bId, 'disk.img');

    const alloc = await allocated(client, { snapshot_id: aId, starting_offset: 0, max_results: 0 });
    expect(alloc.code).toBe('OK');
    const changed = await delta(client, {
      base_snapshot_id: aId,
      target_snapshot_id: bId,
      starting_offset: 0,
      max_results: 7,
    });
    expect(changed.code).toBe('OK');
    for (const s of [alloc, changed]) {
      expect(wellFormed(s.tuples)).toBe(true);
      for (const m of s.messages) {
        expect(m.volume_capacity_bytes).toBe(String(size));
        expect(m.block_metadata_type).toBe('VARIABLE_LENGTH');
      }
      expect(s.tuples.every((t: Tuple) => t.offset + t.length <= size)).toBe(true);
    }
    expect(changed.messages.every((m) => m.block_metadata.length <= 7)).toBe(true);

    // Rebuild A from its allocated ranges, then B from A and the delta.
    const rebuilt = path.join(base, `${name}.rebuilt`);
    await fs.writeFile(rebuilt, '');
    await fs.truncate(rebuilt, size);
    await copyRanges(aImage, rebuilt, alloc.tuples);
    expect(await sha256(rebuilt)).toBe(await sha256(aImage));
    expect(await sha256(rebuilt)).not.toBe(await sha256(bImage)); // the delta has work to do
    expect(changed.tuples.length).toBeGreaterThan(0);
    await copyRanges(bImage, rebuilt, changed.tuples);
    expect(await sha256(rebuilt)).toBe(await sha256(bImage));
    await fs.rm(rebuilt);

    // The method the pool allows, as the call's log line says: extent maps alone (no data read) where
    // extents are shared, contents elsewhere.
    const logged = await d.waitForLog((l) => l.includes('"GetMetadataDelta"') && l.includes(bId));
    expect(logged).toBe(true);
    const line = d
      .logs()
      .filter((l) => l.includes('"GetMetadataDelta"') && l.includes(bId))
      .map((l) => JSON.parse(l) as { via?: string; bytesRead?: number; code?: string })
      .at(-1);
    expect(line).toMatchObject({ code: 'OK', via: reflink ? 'extents' : 'contents' });
    if (reflink) expect(line?.bytesRead).toBe(0);

    // Precision: on a reflink pool, the delta is the blocks written or discarded between A and B
    // (rounded out to 4 KiB blocks), plus at most SLACK.
    const written = touched.size * BLOCK;
    if (reflink) expect(totalBytes(changed.tuples)).toBeLessThanOrEqual(written + SLACK);
    // Everywhere: never more than what either snapshot holds.
    expect(totalBytes(changed.tuples)).toBeLessThanOrEqual(2 * size);
  });
});

/** What the reflink delta may report beyond the blocks written between the snapshots: none. */
const SLACK = 0;
