/**
 * `loopvol release-node`: an operator's word that a node is gone for good, for the volumes that were
 * force-detached from it and wait for it to confirm that it stopped writing them.
 */
import os from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { pvcOf, readVolumes, storesFor } from '../audit/inventory.js';
import { isNodeId } from '../pool/ids.js';
import { HEARTBEAT_MS, NodeRegistry } from '../pool/nodes.js';
import {
  cliLogger,
  COMMON_HELP,
  COMMON_OPTIONS,
  EXIT,
  openPool,
  parse,
  positiveNumber,
  printJson,
  runCommand,
  table,
  UsageError,
} from './common.js';

/** Two missed heartbeats and a second: a plugin that runs rewrites its heartbeat within this. */
const MIN_WATCH_SECONDS = (2 * HEARTBEAT_MS) / 1000 + 1;
const DEFAULT_WATCH_SECONDS = (3 * HEARTBEAT_MS) / 1000 + 1;

export const RELEASE_USAGE =
  'loopvol release-node --node NODE [--yes] [--pool-dir DIR] [--watch-seconds N] [--json]\n' +
  '  For a node that is powered off, or cut off from the pool for good: releases the volumes that were\n' +
  '  force-detached from it while staged there and that it has not confirmed (revoked leases), so another\n' +
  '  node may stage them. A node whose plugin runs confirms by itself within seconds, so this first watches\n' +
  "  the node's heartbeat and refuses while it changes. Two nodes writing one volume corrupt it: use this\n" +
  '  only when the node cannot write (powered off, or fenced by your infrastructure). Should the node come\n' +
  '  back, its plugin still freezes whatever it has of those volumes mounted.\n' +
  '  Without --yes it only lists what it would release.\n' +
  '  --node NODE           the node (its --nodeid)\n' +
  '  --yes                 do it\n' +
  `  --watch-seconds N     how long the heartbeat must stay unchanged (default ${DEFAULT_WATCH_SECONDS}, at least ${MIN_WATCH_SECONDS})\n` +
  COMMON_HELP +
  "Exit status: 0 released (or, without --yes, listed; or nothing to release), 1 the node's heartbeat\n" +
  '  changed (nothing released), 2 bad flags, 3 the pool could not be read.\n';

export async function releaseNode(argv: string[]): Promise<number> {
  return runCommand('release-node', async () => {
    const { values } = parse(argv, {
      ...COMMON_OPTIONS,
      node: { type: 'string' },
      yes: { type: 'boolean', default: false },
      'watch-seconds': { type: 'string' },
    });
    const node = values.node;
    if (node === undefined || !isNodeId(node))
      throw new UsageError(`--node ${node ?? ''}: a node name is required`);
    const watch = positiveNumber('watch-seconds', values['watch-seconds'], DEFAULT_WATCH_SECONDS);
    if (watch < MIN_WATCH_SECONDS) {
      throw new UsageError(
        `--watch-seconds ${watch}: must be at least ${MIN_WATCH_SECONDS} (two heartbeats and a second)`,
      );
    }
    const log = cliLogger();
    const pool = await openPool(values['pool-dir'], log);
    const { volumes } = storesFor(pool, log);
    const waiting = async () =>
      (await readVolumes(pool, volumes))
        .map((v) => ({ v, lease: v.leases.find((l) => l.node === node && l.revokedAt !== undefined) }))
        .filter((x) => x.lease !== undefined && x.lease.fencedAt === undefined && !x.lease.readonly);
    const found = await waiting();
    const rows = found.map(({ v, lease }) => {
      const pvc = v.record.state === 'ok' ? pvcOf(v.record.value) : undefined;
      return {
        id: v.id,
        pvc: pvc?.name ? `${pvc.namespace}/${pvc.name}` : '-',
        revokedAt: lease?.revokedAt ?? '',
        accessType: lease?.accessType ?? '',
      };
    });
    const say = (text: string, json: Record<string, unknown>): void => {
      if (values.json) printJson({ node, ...json, volumes: rows });
      else process.stdout.write(text);
    };
    if (found.length === 0) {
      say(`node ${node}: no volume waits for it to confirm; nothing to release\n`, { released: false });
      return EXIT.ok;
    }
    const listing = table(
      ['VOLUME', 'PVC', 'ACCESS', 'DETACHED AT'],
      rows.map((r) => [r.id, r.pvc, r.accessType, r.revokedAt]),
    );
    if (!values.yes) {
      say(
        `${listing}node ${node}: ${found.length} volume(s) wait for it to confirm. Make sure it cannot write ` +
          `(powered off, or fenced), then run again with --yes.\n`,
        { released: false },
      );
      return EXIT.ok;
    }
    // Judged by this process's own clock, never by comparing another host's timestamps.
    const watcher = new NodeRegistry(pool.layout, watch * 1000);
    await watcher.seenDead(node);
    if (!values.json) process.stderr.write(`watching node ${node}'s heartbeat for ${watch} s…\n`);
    await sleep(watch * 1000 + 50);
    if (!(await watcher.seenDead(node))) {
      process.stderr.write(
        `loopvol release-node: node ${node}'s heartbeat changed in the last ${watch} s: its plugin runs, and ` +
          `confirms by itself once it has frozen what it has (if it does not, see its log and 'loopvol check' ` +
          `on that node); nothing was released\n`,
      );
      return EXIT.problems;
    }
    const how = `released by an operator (loopvol release-node on ${os.hostname()}) after its heartbeat stayed unchanged for ${watch} s`;
    // What was listed and still waits (one confirmed meanwhile, or deleted, is left as it is).
    const still = new Set((await waiting()).map((x) => x.v.id));
    const released = found.filter((x) => still.has(x.v.id)).map((x) => x.v.id);
    for (const id of released) await volumes.markFenced(id, node, how);
    say(`${listing}node ${node}: released ${released.length} volume(s); other nodes may stage them now\n`, {
      released: true,
      releasedIds: released,
    });
    return EXIT.ok;
  });
}
