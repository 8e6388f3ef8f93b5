/**
 * One node plugin of a node at a time on a host. A DaemonSet may start the new container while the old
 * one still finishes its calls (it stops listening on the CSI socket at once); only once it is gone may
 * the new one take over its locks and thaw what it left. And two plugins of one node serving at once
 * (a second DaemonSet, or a rollout that moved the socket while the old one still serves) would each
 * take the other's devices for its own leftovers: two loop devices of one image, a filesystem checked
 * while the other mounts it.
 *
 * The signal is a unix socket the process listens on for its whole life (the kernel closes it when the
 * process ends, however it ends), answering with the endpoint it serves: `<endpoint>.presence` (`.lvp`
 * beside the endpoint when its path is at the 107-byte limit of a unix socket), and `.lvn-<hash of the
 * driver name and node id>` in the endpoint's directory, which every plugin of the node whose endpoint
 * is there shares.
 */
import { createHash } from 'node:crypto';
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import type { Logger } from 'pino';
import { EndpointError, socketIsLive } from './server.js';

/** The longest path a unix socket can have (sun_path less its terminating NUL). */
const MAX_SOCKET_PATH = 107;
/** How often a waiting successor says it still waits. */
const PRESENCE_LOG_MS = 10_000;
/** How long a predecessor may go on serving its socket before a successor takes it for a second plugin. */
const SERVING_GRACE_MS = 3_000;

const fits = (p: string): boolean => Buffer.byteLength(p) <= MAX_SOCKET_PATH;

/** What the process at presence socket `p` serves; undefined when none listens, '' when it says nothing. */
function answerOf(p: string): Promise<string | undefined> {
  return new Promise((resolve) => {
    const conn = net.connect({ path: p });
    let said = '';
    const done = (v: string | undefined): void => {
      conn.destroy();
      resolve(v);
    };
    conn.on('data', (b: Buffer) => (said += b.toString()));
    conn.once('end', () => {
      done(said);
    });
    conn.once('error', () => {
      done(undefined);
    });
    conn.setTimeout(2000, () => {
      done(''); // something holds it but does not answer: alive
    });
  });
}

export interface Presence {
  /** The lock role of this plugin: a successor that waited for this one's presence names itself so too. */
  role: string | undefined;
  /** Closes the presence sockets (the last step of stopping). */
  leave(): Promise<void>;
}

/**
 * Waits until no other process of node `nodeId`'s plugin runs beside `socketPath` on this host (one
 * still serving its endpoint after a grace period is a second plugin: an error), then says that this
 * one does, until it has stopped.
 */
export async function awaitPredecessor(
  socketPath: string,
  plugin: { driverName: string; nodeId: string },
  log: Logger,
): Promise<Presence> {
  const { nodeId } = plugin;
  const dir = path.dirname(socketPath);
  const own = [`${socketPath}.presence`, path.join(dir, '.lvp')].find(fits);
  // The plugin of this node for this driver (the kubelet knows one per driver name on a node).
  const hash = createHash('sha256').update([plugin.driverName, nodeId].join('\0')).digest('hex').slice(0, 16);
  const lvn = path.join(dir, `.lvn-${hash}`);
  const node = fits(lvn) ? lvn : undefined;
  const presences = [own, node].filter((p): p is string => p !== undefined);
  if (presences.length === 0) {
    log.warn(
      { socket: socketPath },
      'the endpoint path is too long for a presence socket beside it: a successor will not wait for this process to exit',
    );
    return { role: undefined, leave: () => Promise.resolve() };
  }
  await fs.mkdir(dir, { recursive: true, mode: 0o750 });
  const since = performance.now();
  let said = 0;
  let servingSince: number | undefined;
  for (;;) {
    const answers = await Promise.all(presences.map(answerOf));
    const live = answers.find((a) => a !== undefined);
    if (live === undefined) break;
    // Still serving, not stopping (a signal takes a moment to act): after a few seconds of that, two
    // plugins at once is a mistake, said as such. An older release's presence says nothing: its
    // endpoint was this one.
    const serves = live === '' ? socketPath : live;
    if (await socketIsLive(serves)) {
      servingSince ??= performance.now();
      if (performance.now() - servingSince > SERVING_GRACE_MS) {
        throw new EndpointError(
          serves === socketPath
            ? `another process is already serving ${socketPath}`
            : `another plugin of node ${nodeId} is serving ${serves} on this host; two would stage the same volumes side by side`,
        );
      }
    } else servingSince = undefined;
    const waited = performance.now() - since;
    if (waited >= said) {
      log.warn(
        { presence: presences, waitedSeconds: Math.round(waited / 1000) },
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
  const servers: net.Server[] = [];
  for (const p of presences) {
    await fs.rm(p, { force: true });
    const server = net.createServer((conn) => conn.end(socketPath));
    await new Promise<void>((resolve, reject) => {
      server.once('error', reject);
      server.listen(p, () => {
        server.off('error', reject);
        resolve();
      });
    });
    server.unref();
    servers.push(server);
  }
  return {
    // Any plugin of the node that waited on the same presence is this one's successor.
    role: `node:${nodeId}@${node ?? own ?? ''}`,
    leave: () =>
      Promise.all(
        servers.map(
          (s) =>
            new Promise<void>((resolve) =>
              s.close(() => {
                resolve();
              }),
            ),
        ),
      ).then(() => undefined),
  };
}
