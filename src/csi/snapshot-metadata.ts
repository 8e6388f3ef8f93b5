/**
 * The CSI SnapshotMetadata service (changed block tracking), spec.md "Snapshot Metadata Service RPCs":
 * GetMetadataAllocated streams the data ranges of a snapshot, GetMetadataDelta the ranges that changed
 * between two snapshots of one volume. Both describe ranges in the VARIABLE_LENGTH style (extents as
 * the filesystem has them, merged), ascending and never overlapping, at most `max_results` a message,
 * each message carrying the volume's capacity. `starting_offset` resumes an interrupted stream: no
 * range ends at or before it (a range across it is cut to start there).
 *
 * Errors as the spec's tables have them: a missing id or a negative max_results INVALID_ARGUMENT; an
 * unknown snapshot NOT_FOUND; a starting_offset below zero or past the volume's size OUT_OF_RANGE; a
 * base snapshot of another volume, or taken after the target, INVALID_ARGUMENT (the target must be "a
 * second snapshot in the same volume, created after the base"). Changed block tracking is always on
 * here (extent maps on reflink pools, contents elsewhere), so FAILED_PRECONDITION is never needed.
 */
import { failedPrecondition, invalidArgument, notFound, outOfRange } from '../errors.js';
import type { GetMetadataAllocatedResponse } from '../gen/csi/v1/GetMetadataAllocatedResponse.js';
import type { SnapshotMetadataHandlers } from '../gen/csi/v1/SnapshotMetadata.js';
import type { Range } from '../pool/extents.js';
import type { MetadataStats, PinnedSnapshot, SnapshotMetadataReader } from '../pool/snapshot-metadata.js';
import { type StreamContext, type StreamMethods, streamMethod } from '../server/stream.js';
import { requireField } from './validate.js';

/** Ranges a message carries when the request leaves it to us (max_results 0). */
export const DEFAULT_MAX_RESULTS = 1024;
/**
 * A range found this long after the last message goes out at once with those before it, so a slow
 * scan (contents compared on a pool without reflink) still sends what a client can resume from.
 */
const FLUSH_MS = 1_000;

type Message = GetMetadataAllocatedResponse; // the delta response has the same fields

/** starting_offset: an int64 that arrives as a decimal string. Below zero is OUT_OF_RANGE (spec table). */
export function parseStartingOffset(value: string | number | undefined): number {
  const text = String(value ?? '0').trim() || '0';
  let big: bigint;
  try {
    big = BigInt(text);
  } catch {
    throw invalidArgument('starting_offset is not a number.');
  }
  if (big < 0n) throw outOfRange(`starting_offset ${text} is negative.`);
  // Larger than any volume this driver can hold: past the volume's size.
  if (big > BigInt(Number.MAX_SAFE_INTEGER)) return Number.MAX_SAFE_INTEGER;
  return Number(big);
}

export function parseMaxResults(value: number | undefined): number {
  const n = value ?? 0;
  if (!Number.isInteger(n) || n < 0) throw invalidArgument(`max_results must not be negative (got ${n}).`);
  return n === 0 ? DEFAULT_MAX_RESULTS : n;
}

/**
 * Groups ranges into messages of at most `max` tuples, each range cut to start at `from` or later.
 * At least one message is sent, so even a snapshot with no data tells its capacity.
 */
export async function* messages(
  ranges: AsyncIterable<Range>,
  opts: { max: number; from: number; capacityBytes: number; flushMs?: number },
): AsyncGenerator<Message> {
  const message = (list: Range[]): Message => ({
    block_metadata_type: 'VARIABLE_LENGTH',
    volume_capacity_bytes: String(opts.capacityBytes),
    block_metadata: list.map((r) => ({ byte_offset: String(r.offset), size_bytes: String(r.length) })),
  });
  const flushMs = opts.flushMs ?? FLUSH_MS;
  let batch: Range[] = [];
  let sent = 0;
  let last = Date.now();
  let prevEnd = opts.from;
  for await (const r of ranges) {
    const start = Math.max(r.offset, opts.from, prevEnd);
    const end = Math.min(r.offset + r.length, opts.capacityBytes);
    if (end <= start) continue;
    batch.push({ offset: start, length: end - start });
    prevEnd = end;
    if (batch.length >= opts.max || Date.now() - last >= flushMs) {
      yield message(batch);
      sent++;
      batch = [];
      last = Date.now();
    }
  }
  if (batch.length > 0 || sent === 0) yield message(batch);
}

export interface SnapshotMetadataDeps {
  reader: SnapshotMetadataReader;
}

async function pinned(reader: SnapshotMetadataReader, id: string, field: string): Promise<PinnedSnapshot> {
  const snap = await reader.pin(id);
  if (!snap) throw notFound(`Snapshot ${id} (${field}) does not exist.`);
  return snap;
}

function checkOffset(from: number, capacityBytes: number): void {
  if (from > capacityBytes) {
    throw outOfRange(`starting_offset ${from} is past the end of the volume (${capacityBytes} bytes).`);
  }
}

function noteStats(ctx: StreamContext, stats: MetadataStats): void {
  ctx.note({ via: stats.method, ranges: stats.ranges, bytesRead: stats.bytesRead });
}

export function snapshotMetadataService({
  reader,
}: SnapshotMetadataDeps): StreamMethods<SnapshotMetadataHandlers> {
  return {
    GetMetadataAllocated: streamMethod({
      validate: (req) => ({
        id: requireField(req.snapshot_id, 'snapshot_id'),
        from: parseStartingOffset(req.starting_offset),
        max: parseMaxResults(req.max_results),
      }),
      run: async function* (v, ctx) {
        const snap = await pinned(reader, v.id, 'snapshot_id');
        const stats: MetadataStats = { bytesRead: 0, ranges: 0 };
        try {
          checkOffset(v.from, snap.capacityBytes);
          yield* messages(reader.allocated(ctx, snap, v.from, stats), {
            max: v.max,
            from: v.from,
            capacityBytes: snap.capacityBytes,
          });
        } finally {
          noteStats(ctx, stats);
          await snap.close();
        }
      },
    }),

    GetMetadataDelta: streamMethod({
      validate: (req) => {
        const base = requireField(req.base_snapshot_id, 'base_snapshot_id');
        const target = requireField(req.target_snapshot_id, 'target_snapshot_id');
        if (base === target) {
          throw invalidArgument('base_snapshot_id and target_snapshot_id name the same snapshot.');
        }
        return {
          base,
          target,
          from: parseStartingOffset(req.starting_offset),
          max: parseMaxResults(req.max_results),
        };
      },
      run: async function* (v, ctx) {
        const base = await pinned(reader, v.base, 'base_snapshot_id');
        const stats: MetadataStats = { bytesRead: 0, ranges: 0 };
        try {
          const target = await pinned(reader, v.target, 'target_snapshot_id');
          try {
            const [b, t] = [base.meta, target.meta];
            if (b.sourceVolumeId !== t.sourceVolumeId) {
              throw invalidArgument(
                `Snapshot ${b.id} is of volume ${b.sourceVolumeId} and ${t.id} of volume ${t.sourceVolumeId}: a delta needs two snapshots of one volume.`,
              );
            }
            if (Date.parse(b.createdAt) > Date.parse(t.createdAt)) {
              throw invalidArgument(
                `The base snapshot ${b.id} (${b.createdAt}) was taken after the target ${t.id} (${t.createdAt}); swap them.`,
              );
            }
            checkOffset(v.from, target.capacityBytes);
            yield* messages(reader.delta(ctx, base, target, v.from, stats), {
              max: v.max,
              from: v.from,
              capacityBytes: target.capacityBytes,
            });
          } finally {
            await target.close();
          }
        } finally {
          noteStats(ctx, stats);
          await base.close();
        }
      },
    }),
  };
}

/** Both methods answering FAILED_PRECONDITION with `why` (a process still waiting for its pool). */
export function snapshotMetadataRefusing(why: () => string): StreamMethods<SnapshotMetadataHandlers> {
  const refuse = streamMethod<unknown, Message, null>({
    validate: () => null,
    run: () => ({
      [Symbol.asyncIterator]: () => ({ next: () => Promise.reject(failedPrecondition(`${why()}.`)) }),
    }),
  });
  return { GetMetadataAllocated: refuse, GetMetadataDelta: refuse };
}
