/**
 * The gRPC server on the CSI endpoint: a unix socket (created with its parent directory, a stale socket
 * from a crash removed, a live one refused) or TCP for debugging, and a graceful stop.
 */
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import * as grpc from '@grpc/grpc-js';
import type { Logger } from 'pino';
import type { Endpoint } from '../config.js';
import { errnoCode } from '../errors.js';

export class EndpointError extends Error {
  override readonly name = 'EndpointError';
}

/** True when something accepts connections on the unix socket at `socketPath`. */
export function socketIsLive(socketPath: string): Promise<boolean> {
  return new Promise((resolve) => {
    const conn = net.connect({ path: socketPath });
    const done = (live: boolean): void => {
      conn.destroy();
      resolve(live);
    };
    conn.once('connect', () => {
      done(true);
    });
    conn.once('error', () => {
      done(false);
    });
    conn.setTimeout(2000, () => {
      done(true); // something holds it but does not answer: do not steal it
    });
  });
}

async function prepareUnixSocket(socketPath: string, log: Logger): Promise<void> {
  await fs.mkdir(path.dirname(socketPath), { recursive: true, mode: 0o750 });
  let stat;
  try {
    stat = await fs.lstat(socketPath);
  } catch (err) {
    if (errnoCode(err) === 'ENOENT') return;
    throw err;
  }
  if (!stat.isSocket()) {
    throw new EndpointError(`${socketPath} exists and is not a socket; refusing to replace it`);
  }
  if (await socketIsLive(socketPath)) {
    throw new EndpointError(`another process is already serving ${socketPath}`);
  }
  log.info({ socket: socketPath }, 'removing a stale socket left by an earlier run');
  await fs.unlink(socketPath);
}

export function endpointUrl(endpoint: Endpoint): string {
  return endpoint.kind === 'unix'
    ? `unix://${endpoint.path}`
    : `${endpoint.host.includes(':') ? `[${endpoint.host}]` : endpoint.host}:${endpoint.port}`;
}

export async function listen(server: grpc.Server, endpoint: Endpoint, log: Logger): Promise<void> {
  if (endpoint.kind === 'unix') await prepareUnixSocket(endpoint.path, log);
  await new Promise<void>((resolve, reject) => {
    server.bindAsync(endpointUrl(endpoint), grpc.ServerCredentials.createInsecure(), (err) => {
      if (err) reject(new EndpointError(`cannot listen on ${endpointUrl(endpoint)}: ${err.message}`));
      else resolve();
    });
  });
  if (endpoint.kind === 'unix') await fs.chmod(endpoint.path, 0o660);
}

/**
 * Stops accepting calls, lets those in flight finish for up to `timeoutMs`, then cancels the rest,
 * and removes the socket.
 */
export async function stop(
  server: grpc.Server,
  endpoint: Endpoint,
  timeoutMs: number,
  log: Logger,
): Promise<void> {
  await new Promise<void>((resolve) => {
    const timer = setTimeout(() => {
      log.warn({ timeoutMs }, 'calls still running at the shutdown timeout; cancelling them');
      server.forceShutdown();
      resolve();
    }, timeoutMs);
    server.tryShutdown(() => {
      clearTimeout(timer);
      resolve();
    });
  });
  if (endpoint.kind === 'unix') await fs.rm(endpoint.path, { force: true });
}
