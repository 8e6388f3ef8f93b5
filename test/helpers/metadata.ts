/** A client of the SnapshotMetadata service (server-streaming), and the range arithmetic its tests use. */
import fs from 'node:fs/promises';
import * as grpc from '@grpc/grpc-js';
import { csiProto } from '../../src/server/proto.js';
import { CHANNEL_OPTIONS } from './grpc.js';
import type { GetMetadataAllocatedRequest } from '../../src/gen/csi/v1/GetMetadataAllocatedRequest.js';
import type { GetMetadataAllocatedResponse__Output } from '../../src/gen/csi/v1/GetMetadataAllocatedResponse.js';
import type { GetMetadataDeltaRequest } from '../../src/gen/csi/v1/GetMetadataDeltaRequest.js';
import type { SnapshotMetadataClient } from '../../src/gen/csi/v1/SnapshotMetadata.js';

export interface Tuple {
  offset: number;
  length: number;
}

export interface StreamResult {
  messages: GetMetadataAllocatedResponse__Output[];
  tuples: Tuple[];
  /** 'OK' or the gRPC code name the stream ended with. */
  code: string;
  details: string;
}

export function metadataClient(endpoint: string): SnapshotMetadataClient {
  return new (csiProto().csi.v1.SnapshotMetadata)(
    endpoint,
    grpc.credentials.createInsecure(),
    CHANNEL_OPTIONS,
  );
}

export const tuplesOf = (messages: readonly GetMetadataAllocatedResponse__Output[]): Tuple[] =>
  messages.flatMap((m) =>
    m.block_metadata.map((b) => ({ offset: Number(b.byte_offset), length: Number(b.size_bytes) })),
  );

/** Reads a whole stream (or its first `stopAfter` messages, then cancels it). */
export function collect(
  stream: grpc.ClientReadableStream<GetMetadataAllocatedResponse__Output>,
  stopAfter = Infinity,
): Promise<StreamResult> {
  return new Promise((resolve) => {
    const messages: GetMetadataAllocatedResponse__Output[] = [];
    let settled = false;
    const done = (code: string, details: string): void => {
      if (settled) return;
      settled = true;
      resolve({ messages, tuples: tuplesOf(messages), code, details });
    };
    stream.on('data', (m: GetMetadataAllocatedResponse__Output) => {
      if (settled) return;
      messages.push(m);
      if (messages.length >= stopAfter) {
        done('STOPPED', '');
        stream.cancel();
      }
    });
    stream.on('error', (err: grpc.ServiceError) => {
      done(grpc.status[err.code], err.details);
    });
    stream.on('end', () => {
      done('OK', '');
    });
  });
}

const deadline = (): grpc.CallOptions => ({ deadline: new Date(Date.now() + 300_000) });

export function allocated(
  client: SnapshotMetadataClient,
  req: GetMetadataAllocatedRequest,
  stopAfter?: number,
): Promise<StreamResult> {
  return collect(client.GetMetadataAllocated(req, deadline()), stopAfter);
}

export function delta(
  client: SnapshotMetadataClient,
  req: GetMetadataDeltaRequest,
  stopAfter?: number,
): Promise<StreamResult> {
  return collect(client.GetMetadataDelta(req, deadline()), stopAfter);
}

export const totalBytes = (tuples: readonly Tuple[]): number => tuples.reduce((s, t) => s + t.length, 0);

/** Ascending, and no tuple overlaps or touches the one before it across the whole stream. */
export function wellFormed(tuples: readonly Tuple[]): boolean {
  for (let i = 0; i < tuples.length; i++) {
    const t = tuples[i];
    if (!t || t.length <= 0 || t.offset < 0) return false;
    const prev = tuples[i - 1];
    if (prev && prev.offset + prev.length > t.offset) return false;
  }
  return true;
}

/** Copies the bytes of `tuples` from `src` into `dst` at the same offsets, a MiB at a time. */
export async function copyRanges(src: string, dst: string, tuples: readonly Tuple[]): Promise<void> {
  const from = await fs.open(src, 'r');
  const to = await fs.open(dst, 'r+');
  const buf = Buffer.alloc(2 ** 20);
  try {
    for (const t of tuples) {
      for (let off = t.offset; off < t.offset + t.length;) {
        const n = Math.min(buf.length, t.offset + t.length - off);
        const { bytesRead } = await from.read(buf, 0, n, off);
        if (bytesRead !== n) throw new Error(`short read at ${off} of ${src}`);
        await to.write(buf, 0, n, off);
        off += n;
      }
    }
  } finally {
    await from.close();
    await to.close();
  }
}
