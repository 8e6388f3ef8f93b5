/** The per-call wrapper and graceful stop, on an in-process gRPC server with scripted methods. */
import fs from 'node:fs/promises';
import { afterAll, describe, expect, it } from 'vitest';
import { csiProto } from '../../src/server/proto.js';
import { invalidArgument, notFound } from '../../src/errors.js';
import type { ControllerHandlers } from '../../src/gen/csi/v1/Controller.js';
import { buildService, method, type Methods } from '../../src/server/call.js';
import { stop } from '../../src/server/server.js';
import { codeOf, csiClients, errorOf } from '../helpers/grpc.js';
import { until } from '../helpers/host.js';
import { removeServeDirs, serveInProcess } from '../helpers/serve.js';

afterAll(removeServeDirs);

async function serve(methods: Methods<ControllerHandlers>) {
  const def = csiProto().csi.v1.Controller.service;
  const s = await serveInProcess('call', (server, deps) => {
    server.addService(def, buildService<ControllerHandlers>('Controller', def, methods, deps));
  });
  return { ...s, clients: csiClients(s.url) };
}

describe('the per-call wrapper', () => {
  it('validates before running, holds in-flight keys (ABORTED for the loser), and logs one line per call', async () => {
    let release: () => void = () => undefined;
    let runs = 0;
    const gate = new Promise<void>((r) => (release = r));
    const s = await serve({
      CreateVolume: method({
        validate: (req) => {
          if (req.name === '') throw invalidArgument('name is required.');
          return req.name;
        },
        locks: (name) => [`vol:${name}`],
        run: async () => {
          runs++;
          await gate;
          return { volume: { volume_id: 'vol-1', capacity_bytes: '1' } };
        },
      }),
    });
    expect(await codeOf(s.clients.controller.CreateVolume({ name: '' }))).toBe('INVALID_ARGUMENT');
    expect(runs).toBe(0);
    const first = s.clients.controller.CreateVolume({ name: 'a', secrets: { key: 'top-secret-value' } });
    await until(() => runs === 1);
    const second = await errorOf(s.clients.controller.CreateVolume({ name: 'a' }));
    expect(second.code).toBe('ABORTED');
    const other = codeOf(s.clients.controller.CreateVolume({ name: 'b' })); // another key: not refused
    await until(() => runs === 2);
    release();
    expect(await other).toBe('OK');
    expect((await first).volume?.volume_id).toBe('vol-1');
    const calls = s.lines.filter((l) => l.msg === 'call' || l.msg === 'call failed');
    expect(calls.map((l) => l.code)).toEqual(expect.arrayContaining(['INVALID_ARGUMENT', 'ABORTED', 'OK']));
    for (const l of calls) {
      expect(l).toMatchObject({
        method: 'CreateVolume',
        reqId: expect.any(String) as unknown,
        ms: expect.any(Number) as unknown,
      });
    }
    expect(JSON.stringify(s.lines)).not.toContain('top-secret-value');
    s.clients.close();
    await stop(s.server, s.endpoint, 1000, s.log);
  });

  it('answers UNIMPLEMENTED for methods it lacks, maps domain errors, and hides unexpected ones', async () => {
    const s = await serve({
      DeleteVolume: method({
        validate: () => null,
        run: () => Promise.reject(new TypeError('cannot read x of undefined at /secret/path.ts:1')),
      }),
      ControllerGetVolume: method({
        validate: () => null,
        run: () => Promise.reject(notFound('Volume v does not exist.')),
      }),
    });
    expect(await codeOf(s.clients.controller.ListVolumes({}))).toBe('UNIMPLEMENTED');
    const internal = await errorOf(s.clients.controller.DeleteVolume({ volume_id: 'x' }));
    expect(internal.code).toBe('INTERNAL');
    expect(internal.details).not.toContain('/secret/path');
    const logged = s.lines.find((l) => l.method === 'DeleteVolume');
    expect(JSON.stringify(logged)).toContain('/secret/path');
    expect(await errorOf(s.clients.controller.ControllerGetVolume({ volume_id: 'v' }))).toEqual({
      code: 'NOT_FOUND',
      details: 'Volume v does not exist.',
    });
    s.clients.close();
    await stop(s.server, s.endpoint, 1000, s.log);
  });
  it("aborts a call's signal when the caller gives up, whether the call read the signal before or after", async () => {
    const seen: Record<string, boolean> = {};
    let answered: AbortSignal | undefined;
    const s = await serve({
      CreateVolume: method({
        validate: (req) => req.name,
        run: async (name, ctx) => {
          if (name === 'early') {
            const signal = ctx.signal;
            await new Promise((r) => setTimeout(r, 600));
            seen[name] = signal.aborted;
          } else {
            await new Promise((r) => setTimeout(r, 600));
            seen[name] = ctx.signal.aborted;
          }
          return { volume: { volume_id: name, capacity_bytes: '1' } };
        },
      }),
      DeleteVolume: method({
        validate: () => null,
        run: (_v, ctx) => {
          answered = ctx.signal; // an answered call's signal stays quiet when the stream closes after
          return Promise.resolve({});
        },
      }),
    });
    for (const name of ['early', 'late'])
      expect(await codeOf(s.clients.controller.CreateVolume({ name }, { timeoutMs: 200 }))).toBe(
        'DEADLINE_EXCEEDED',
      );
    expect(await codeOf(s.clients.controller.DeleteVolume({ volume_id: 'v' }))).toBe('OK');
    await new Promise((r) => setTimeout(r, 800));
    expect(seen).toEqual({ early: true, late: true });
    expect(answered?.aborted).toBe(false);
    const lateLines = s.lines.filter((l) => l.method === 'CreateVolume');
    expect(lateLines.map((l) => l.late)).toEqual([true, true]);
    s.clients.close();
    await stop(s.server, s.endpoint, 1000, s.log);
  });
});

describe('counting calls in and out', () => {
  it('counts every call out once, also one whose answering throws (logged, not thrown)', async () => {
    const counts = { begin: 0, end: 0 };
    const def = csiProto().csi.v1.Controller.service;
    const s = await serveInProcess('count', (server, deps) => {
      server.addService(
        def,
        buildService<ControllerHandlers>(
          'Controller',
          def,
          {
            DeleteVolume: method({ validate: () => null, run: () => Promise.resolve({}) }),
            ControllerGetVolume: method({
              validate: () => null,
              run: () => Promise.reject(notFound('Volume v does not exist.')),
            }),
          },
          {
            ...deps,
            tracker: {
              begin: () => counts.begin++,
              end: () => counts.end++,
            },
            observer: {
              observe: (_service, method) => {
                if (method === 'ControllerGetVolume') throw new Error('metrics broke');
              },
            },
          },
        ),
      );
    });
    const clients = csiClients(s.url);
    expect(await codeOf(clients.controller.DeleteVolume({ volume_id: 'v' }))).toBe('OK');
    expect(await codeOf(clients.controller.CreateVolume({ name: 'x' }))).toBe('UNIMPLEMENTED');
    // Answering throws before the answer: the caller sees its deadline, the driver lives on.
    expect(await codeOf(clients.controller.ControllerGetVolume({ volume_id: 'v' }, { timeoutMs: 500 }))).toBe(
      'DEADLINE_EXCEEDED',
    );
    expect(counts).toEqual({ begin: 3, end: 3 });
    expect(s.lines.filter((l) => l.msg === 'could not answer the call')).toHaveLength(1);
    clients.close();
    await stop(s.server, s.endpoint, 1000, s.log);
  });
});

describe('stop', () => {
  it('refuses new calls, lets a call in flight finish, and removes the socket', async () => {
    let started = false;
    let finished = false;
    const s = await serve({
      CreateVolume: method({
        validate: () => null,
        run: async () => {
          started = true;
          await new Promise((r) => setTimeout(r, 400));
          finished = true;
          return { volume: { volume_id: 'vol-slow', capacity_bytes: '1' } };
        },
      }),
    });
    const slow = s.clients.controller.CreateVolume({ name: 'slow' });
    await until(() => started);
    const stopping = stop(s.server, s.endpoint, 5000, s.log);
    const late = await codeOf(
      csiClients(`unix://${s.endpoint.path}`).controller.CreateVolume({ name: 'late' }, { timeoutMs: 1000 }),
    );
    expect(late).not.toBe('OK');
    expect((await slow).volume?.volume_id).toBe('vol-slow');
    await stopping;
    expect(finished).toBe(true);
    await expect(fs.lstat(s.endpoint.path)).rejects.toThrow(/ENOENT/);
    s.clients.close();
  });

  it('cancels calls that outlive the shutdown timeout', async () => {
    let started = false;
    const s = await serve({
      CreateVolume: method({
        validate: () => null,
        run: () => {
          started = true;
          return new Promise(() => undefined);
        },
      }),
    });
    const stuck = codeOf(s.clients.controller.CreateVolume({ name: 'stuck' }));
    await until(() => started);
    const t0 = Date.now();
    await stop(s.server, s.endpoint, 300, s.log);
    expect(Date.now() - t0).toBeLessThan(2000);
    expect(await stuck).not.toBe('OK');
    s.clients.close();
  });
});
