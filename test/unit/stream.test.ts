/**
 * The streaming wrapper and the SnapshotMetadata message rules, on an in-process gRPC server with
 * scripted methods: validation before any work, one log line per call, the one error map, backpressure
 * and cancellation that closes the work.
 */
import * as grpc from '@grpc/grpc-js';
import { afterAll, describe, expect, it } from 'vitest';
import {
  DEFAULT_MAX_RESULTS,
  messages,
  parseMaxResults,
  parseStartingOffset,
} from '../../src/csi/snapshot-metadata.js';
import { pluginCapabilities } from '../../src/csi/identity.js';
import { invalidArgument, notFound } from '../../src/errors.js';
import type { GetMetadataAllocatedResponse } from '../../src/gen/csi/v1/GetMetadataAllocatedResponse.js';
import type { SnapshotMetadataHandlers } from '../../src/gen/csi/v1/SnapshotMetadata.js';
import type { Range } from '../../src/pool/extents.js';
import { csiProto } from '../../src/server/proto.js';
import { stop } from '../../src/server/server.js';
import { buildStreamingService, streamMethod, type StreamMethods } from '../../src/server/stream.js';
import { allocated, collect as collectStream, metadataClient } from '../helpers/metadata.js';
import { removeServeDirs, serveInProcess } from '../helpers/serve.js';

afterAll(removeServeDirs);

async function* ranges(list: readonly Range[]): AsyncGenerator<Range> {
  for (const r of list) {
    await Promise.resolve();
    yield r;
  }
}
const collect = async <T>(it: AsyncIterable<T>): Promise<T[]> => {
  const out: T[] = [];
  for await (const x of it) out.push(x);
  return out;
};

describe('request fields', () => {
  it('reads starting_offset as the spec asks: negative is OUT_OF_RANGE', () => {
    expect(parseStartingOffset('0')).toBe(0);
    expect(parseStartingOffset('')).toBe(0);
    expect(parseStartingOffset('4096')).toBe(4096);
    expect(() => parseStartingOffset('-1')).toThrow(expect.objectContaining({ kind: 'out_of_range' }));
    expect(parseStartingOffset('9223372036854775807')).toBe(Number.MAX_SAFE_INTEGER);
  });
  it('reads max_results: 0 is ours to choose, negative is INVALID_ARGUMENT', () => {
    expect(parseMaxResults(0)).toBe(DEFAULT_MAX_RESULTS);
    expect(parseMaxResults(3)).toBe(3);
    expect(() => parseMaxResults(-1)).toThrow(expect.objectContaining({ kind: 'invalid_argument' }));
  });
  it('advertises SNAPSHOT_METADATA_SERVICE where the controller is served, and only there', () => {
    const types = (mode: 'all' | 'controller' | 'node') =>
      pluginCapabilities({ mode }).capabilities?.map((c) => c.service?.type);
    expect(types('controller')).toContain('SNAPSHOT_METADATA_SERVICE');
    expect(types('all')).toContain('SNAPSHOT_METADATA_SERVICE');
    expect(types('node')).not.toContain('SNAPSHOT_METADATA_SERVICE');
  });
});

describe('messages', () => {
  const opts = { max: 2, from: 0, capacityBytes: 1000 };
  it('holds at most max tuples, every one with the capacity and the style', async () => {
    const m = await collect(
      messages(
        ranges([
          { offset: 0, length: 10 },
          { offset: 20, length: 10 },
          { offset: 40, length: 10 },
        ]),
        opts,
      ),
    );
    expect(m.map((x) => x.block_metadata?.length)).toEqual([2, 1]);
    for (const x of m)
      expect(x).toMatchObject({ volume_capacity_bytes: '1000', block_metadata_type: 'VARIABLE_LENGTH' });
  });
  it('cuts a range across starting_offset, and past the capacity', async () => {
    const m = await collect(
      messages(
        ranges([
          { offset: 0, length: 10 },
          { offset: 20, length: 10 },
          { offset: 990, length: 100 },
        ]),
        { ...opts, from: 25, max: 10 },
      ),
    );
    expect(m[0]?.block_metadata).toEqual([
      { byte_offset: '25', size_bytes: '5' },
      { byte_offset: '990', size_bytes: '10' },
    ]);
  });
  it('sends one message, with no tuples, when there is nothing', async () => {
    const m = await collect(messages(ranges([]), opts));
    expect(m).toEqual([
      { block_metadata_type: 'VARIABLE_LENGTH', volume_capacity_bytes: '1000', block_metadata: [] },
    ]);
  });
});

async function serve(methods: StreamMethods<SnapshotMetadataHandlers>) {
  const def = csiProto().csi.v1.SnapshotMetadata.service;
  const s = await serveInProcess('stream', (server, deps) => {
    server.addService(
      def,
      buildStreamingService<SnapshotMetadataHandlers>('SnapshotMetadata', def, methods, deps),
    );
  });
  const client = metadataClient(s.url);
  return {
    client,
    lines: s.lines,
    close: async () => {
      client.close();
      await stop(s.server, s.endpoint, 1000, s.log);
    },
  };
}

const msg = (n: number): GetMetadataAllocatedResponse => ({
  block_metadata_type: 'VARIABLE_LENGTH',
  volume_capacity_bytes: '1000',
  block_metadata: [{ byte_offset: String(n * 10), size_bytes: '1' }],
});

describe('the streaming wrapper', () => {
  it('validates before any work, maps errors, and logs one line per call with what the work noted', async () => {
    let runs = 0;
    const s = await serve({
      GetMetadataAllocated: streamMethod({
        validate: (req) => {
          if (req.snapshot_id === '') throw invalidArgument('snapshot_id is required.');
          return req.snapshot_id;
        },
        run: async function* (id, ctx) {
          runs++;
          ctx.note({ ranges: 2 });
          await Promise.resolve();
          yield msg(1);
          if (id === 'fails-midway') throw notFound('Snapshot went away.');
          yield msg(2);
        },
      }),
    });
    try {
      expect(await allocated(s.client, { snapshot_id: '' })).toMatchObject({ code: 'INVALID_ARGUMENT' });
      expect(runs).toBe(0);
      const ok = await allocated(s.client, { snapshot_id: 'snap', secrets: { k: 'sekrit' } });
      expect(ok).toMatchObject({
        code: 'OK',
        tuples: [
          { offset: 10, length: 1 },
          { offset: 20, length: 1 },
        ],
      });
      const cut = await allocated(s.client, { snapshot_id: 'fails-midway' });
      expect(cut).toMatchObject({
        code: 'NOT_FOUND',
        details: 'Snapshot went away.',
        tuples: [{ offset: 10, length: 1 }],
      });
      const calls = s.lines.filter((l) => l.method === 'GetMetadataAllocated');
      expect(calls.map((l) => [l.code, l.messages])).toEqual([
        ['INVALID_ARGUMENT', 0],
        ['OK', 2],
        ['NOT_FOUND', 1],
      ]);
      expect(calls[1]).toMatchObject({ ranges: 2, snapshot_id: 'snap' });
      expect(JSON.stringify(s.lines)).not.toContain('sekrit');
    } finally {
      await s.close();
    }
  });

  it('counts every call out once, also one whose answering throws (logged, not thrown)', async () => {
    const counts = { begin: 0, end: 0 };
    const def = csiProto().csi.v1.SnapshotMetadata.service;
    let observed = 0;
    const served = await serveInProcess('stream-count', (server, deps) => {
      server.addService(
        def,
        buildStreamingService<SnapshotMetadataHandlers>(
          'SnapshotMetadata',
          def,
          {
            GetMetadataAllocated: streamMethod({
              validate: () => null,
              run: async function* () {
                await Promise.resolve();
                yield msg(1);
              },
            }),
          },
          {
            ...deps,
            tracker: { begin: () => counts.begin++, end: () => counts.end++ },
            observer: {
              observe: () => {
                if (observed++ === 1) throw new Error('metrics broke');
              },
            },
          },
        ),
      );
    });
    const client = metadataClient(served.url);
    try {
      expect((await allocated(client, { snapshot_id: 'a' })).code).toBe('OK');
      // Answering throws before the stream's end: the caller sees its deadline, the driver lives on.
      const cut = await collectStream(
        client.GetMetadataAllocated({ snapshot_id: 'b' }, { deadline: new Date(Date.now() + 500) }),
      );
      expect(cut.code).toBe('DEADLINE_EXCEEDED');
      expect(counts).toEqual({ begin: 2, end: 2 });
      expect(served.lines.filter((l) => l.msg === 'could not answer the call')).toHaveLength(1);
    } finally {
      client.close();
      await stop(served.server, served.endpoint, 1000, served.log);
    }
  });

  it('answers UNIMPLEMENTED for a method it does not have', async () => {
    const s = await serve({});
    try {
      expect((await allocated(s.client, { snapshot_id: 'x' })).code).toBe('UNIMPLEMENTED');
    } finally {
      await s.close();
    }
  });

  it('waits for a slow reader, and closes the work when the client cancels', async () => {
    let produced = 0;
    const state = { closed: false, aborted: false };
    const s = await serve({
      GetMetadataAllocated: streamMethod({
        validate: () => null,
        run: async function* (_v, ctx) {
          ctx.signal.addEventListener('abort', () => (state.aborted = true));
          try {
            for (let i = 0; i < 1_000_000; i++) {
              produced++;
              await Promise.resolve();
              yield {
                ...msg(i),
                block_metadata: Array.from({ length: 500 }, (_, k) => ({
                  byte_offset: String(i * 1000 + k),
                  size_bytes: '1',
                })),
              };
            }
          } finally {
            state.closed = true;
          }
        },
      }),
    });
    try {
      const stream = s.client.GetMetadataAllocated({ snapshot_id: 'x' });
      stream.on('data', () => {
        stream.pause();
      });
      const ended = new Promise<number>((resolve) =>
        stream.on('error', (e: grpc.ServiceError) => {
          resolve(e.code);
        }),
      );
      await new Promise((r) => setTimeout(r, 500));
      const paused = produced;
      await new Promise((r) => setTimeout(r, 300));
      expect(produced).toBe(paused); // not running ahead of the reader
      expect(produced).toBeLessThan(1_000_000);
      stream.cancel();
      expect(await ended).toBe(grpc.status.CANCELLED);
      for (let i = 0; i < 50 && !state.closed; i++) await new Promise((r) => setTimeout(r, 20));
      expect(state).toEqual({ closed: true, aborted: true });
      for (let i = 0; i < 50 && !s.lines.some((l) => l.code === 'CANCELLED'); i++)
        await new Promise((r) => setTimeout(r, 20));
      expect(s.lines.filter((l) => l.method === 'GetMetadataAllocated').map((l) => l.code)).toEqual([
        'CANCELLED',
      ]);
    } finally {
      await s.close();
    }
  });
});
