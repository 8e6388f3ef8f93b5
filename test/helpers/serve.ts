/** An in-process gRPC server of the driver's per-call wrapper, on a unix socket, its log kept as JSON objects. */
import fs from 'node:fs/promises';
import path from 'node:path';
import { Writable } from 'node:stream';
import * as grpc from '@grpc/grpc-js';
import { pino } from 'pino';
import { ExecRunner } from '../../src/exec/runner.js';
import type { CallDeps } from '../../src/server/call.js';
import { InFlight } from '../../src/server/inflight.js';
import { listen } from '../../src/server/server.js';
import { tempDir } from './driver.js';

const dirs: string[] = [];

/** Removes every server's directory (call from afterAll). */
export async function removeServeDirs(): Promise<void> {
  for (const d of dirs.splice(0)) await fs.rm(d, { recursive: true, force: true });
}

/** A server whose services `add` puts on it, with the wrapper's dependencies and a log read back by the test. */
export async function serveInProcess(tag: string, add: (server: grpc.Server, deps: CallDeps) => void) {
  const dir = await tempDir(tag);
  dirs.push(dir);
  const lines: Record<string, unknown>[] = [];
  const sink = new Writable({
    write(chunk: Buffer, _enc, cb) {
      for (const l of chunk.toString().split('\n'))
        if (l) lines.push(JSON.parse(l) as Record<string, unknown>);
      cb();
    },
  });
  const log = pino({ level: 'debug' }, sink);
  const server = new grpc.Server();
  add(server, { log, runner: new ExecRunner(), inflight: new InFlight() });
  const endpoint = { kind: 'unix' as const, path: path.join(dir, 'csi.sock') };
  await listen(server, endpoint, log);
  return { server, endpoint, url: `unix://${endpoint.path}`, lines, log };
}
