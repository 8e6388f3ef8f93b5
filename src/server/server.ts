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
function socketIsLive(socketPath: string): Promise<boolean> {
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

/** The longest path a unix socket can have (sun_path less its terminating NUL). */
const MAX_SOCKET_PATH = 107;
/** How often a waiting successor says it still waits. */
const PRESENCE_LOG_MS = 10_000;
/** How long a predecessor may go on serving its socket before a successor takes it for a second plugin. */
const SERVING_GRACE_MS = 3_000;

/**
 * Waits until no earlier process of this node plugin runs on this host, then says that this one does,
 * until it has stopped. A DaemonSet may start the new container while the old one still finishes its
 * calls (it stops listening on the CSI socket at once); only once it is gone may the new one take over
 * its locks and thaw what it left. The signal is a unix socket `<endpoint>.presence` that the process
 * listens on for its whole life: the kernel closes it when the process ends, however it ends.
 * Returns what closes it (the last step of stopping).
 */
export async function awaitPredecessor(socketPath: string, log: Logger): Promise<() => Promise<void>> {
  // A unix socket's path has at most 107 bytes: the name beside the endpoint, or a short one there.
  const presence = [`${socketPath}.presence`, path.join(path.dirname(socketPath), '.lvp')].find(
    (p) => Buffer.byteLength(p) <= MAX_SOCKET_PATH,
  );
  if (presence === undefined) {
    log.warn(
      { socket: socketPath },
      'the endpoint path is too long for a presence socket beside it: a successor will not wait for this process to exit',
    );
    return () => Promise.resolve();
  }
  await fs.mkdir(path.dirname(presence), { recursive: true, mode: 0o750 });
  const since = performance.now();
  let said = 0;
  let servingSince: number | undefined;
  while (await socketIsLive(presence)) {
    // Still serving, not stopping (a signal takes a moment to act): after a few seconds of that, two
    // plugins on one socket is a mistake, said as such.
    if (await socketIsLive(socketPath)) {
      servingSince ??= performance.now();
      if (performance.now() - servingSince > SERVING_GRACE_MS)
        throw new EndpointError(`another process is already serving ${socketPath}`);
    } else servingSince = undefined;
    const waited = performance.now() - since;
    if (waited >= said) {
      log.warn(
        { presence, waitedSeconds: Math.round(waited / 1000) },
        'the previous process of this node plugin is still finishing its calls; waiting for it to exit',
      );
      said += PRESENCE_LOG_MS;
    }
    await new Promise((r) => setTimeout(r, 200));
  }
  if (said > 0)
    log.info(
      { waitedSeconds: Math.round((performance.now() - since) / 1000) },
      'the previous process has exited',
    );
  await fs.rm(presence, { force: true });
  const server = net.createServer((conn) => conn.end());
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(presence, () => {
      server.off('error', reject);
      resolve();
    });
  });
  server.unref();
  return () =>
    new Promise<void>((resolve) => {
      server.close(() => {
        resolve();
      });
    });
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
