/** `loopvol status`: the pool at a glance, and what this host has attached and mounted from it. */
import { kernelHost, type MountEntry } from '../host/host.js';
import { isUnder, lookAtPoolOnHost, type PoolLoop } from '../audit/host-look.js';
import { readInventory, stateOf } from '../audit/inventory.js';
import { Capacity } from '../pool/capacity.js';
import {
  ago,
  bytes,
  cliExec,
  cliLogger,
  COMMON_HELP,
  COMMON_OPTIONS,
  EXIT,
  EXIT_HELP,
  openPool,
  parse,
  positiveNumber,
  printJson,
  runCommand,
  table,
} from './common.js';

export const STATUS_USAGE =
  'loopvol status [--pool-dir DIR] [--overcommit-ratio R] [--json]\n' +
  '  The pool: its id, path and filesystem, whether it can reflink, its capacity (total, free, promised\n' +
  '  to sparse volumes, what the overcommit ratio leaves), counts of volumes, snapshots, group snapshots,\n' +
  '  quarantined records and trash, the nodes and their heartbeats; and what this host has attached and\n' +
  '  mounted from the pool.\n' +
  COMMON_HELP +
  "  --overcommit-ratio R  the server's --overcommit-ratio, for the room left to sparse volumes (default 1)\n" +
  EXIT_HELP;

/** The filesystem that holds `p`: the deepest mount whose mount point contains it. */
function filesystemOf(mounts: readonly MountEntry[], p: string): MountEntry | undefined {
  return mounts
    .filter((m) => isUnder(p, m.mountPoint))
    .sort((a, b) => a.mountPoint.length - b.mountPoint.length)
    .at(-1);
}

const describeLoop = (p: PoolLoop) => ({
  device: p.loop.path,
  image: p.image.path,
  kind: p.image.kind,
  id: p.image.id ?? null,
  readOnly: p.loop.readOnly,
  mounts: p.mounts.map((m) => m.mountPoint),
});

export async function status(argv: string[]): Promise<number> {
  return runCommand('status', async () => {
    const { values } = parse(argv, { ...COMMON_OPTIONS, 'overcommit-ratio': { type: 'string' } });
    const ratio = positiveNumber('overcommit-ratio', values['overcommit-ratio'], 1);
    const log = cliLogger('silent');
    const pool = await openPool(values['pool-dir'], log);
    const x = cliExec(log);
    const inv = await readInventory(pool, log, { staleSeconds: 60 });
    const capacity = await Capacity.of(pool, Math.max(1, ratio)).report();
    const reflink = await pool.fs.canReflink().catch(() => undefined);
    const hostView = await lookAtPoolOnHost(pool, kernelHost, x);
    const fsEntry = filesystemOf(hostView.mounts, pool.root);
    const count = <T>(items: readonly T[], state: (t: T) => string): Record<string, number> => {
      const out: Record<string, number> = {};
      for (const t of items) out[state(t)] = (out[state(t)] ?? 0) + 1;
      return out;
    };
    const recordState = (r: (typeof inv.volumes)[number] | (typeof inv.snapshots)[number]): string =>
      stateOf(r.record, r.image !== undefined);
    const report = {
      pool: {
        id: pool.id,
        path: pool.root,
        filesystem: fsEntry ? `${fsEntry.fsType} (${fsEntry.source})` : 'unknown',
        reflink: reflink ?? null,
      },
      capacity: { ...capacity, overcommitRatio: ratio },
      volumes: { total: inv.volumes.length, byState: count(inv.volumes, recordState) },
      snapshots: { total: inv.snapshots.length, byState: count(inv.snapshots, recordState) },
      groupSnapshots: inv.groups.length,
      quarantined: inv.quarantine.length,
      trash: inv.trash.length,
      nodes: [...inv.nodes.values()].map((n) => ({
        node: n.node,
        host: n.record?.host ?? null,
        heartbeatAgeSeconds: n.heartbeatAgeSeconds === undefined ? null : Math.round(n.heartbeatAgeSeconds),
        fenced: n.fenced.length,
      })),
      host: { loops: hostView.loops.map(describeLoop) },
    };
    if (values.json) {
      printJson(report);
      return EXIT.ok;
    }
    const states = (by: Record<string, number>): string =>
      Object.entries(by)
        .map(([s, n]) => `${n} ${s}`)
        .join(', ');
    const lines = [
      `pool         ${pool.id || '(no id)'} at ${pool.root}`,
      `filesystem   ${report.pool.filesystem}, ${reflink === undefined ? 'reflink unknown' : reflink ? 'reflink: snapshots and clones are instant' : 'no reflink: snapshots and clones are byte copies'}`,
      `capacity     ${bytes(capacity.totalBytes)} total, ${bytes(capacity.freeBytes)} free, ${bytes(capacity.promisedBytes)} promised to sparse volumes; room for ${bytes(capacity.availableBytes)} more (overcommit ratio ${ratio})`,
      `volumes      ${inv.volumes.length}${inv.volumes.length ? ` (${states(report.volumes.byState)})` : ''}`,
      `snapshots    ${inv.snapshots.length}${inv.snapshots.length ? ` (${states(report.snapshots.byState)})` : ''}, ${inv.groups.length} group snapshot(s)`,
      `quarantined  ${inv.quarantine.length}${inv.quarantine.length ? ' (see loopvol check)' : ''}`,
      `trash        ${inv.trash.length} entr${inv.trash.length === 1 ? 'y' : 'ies'}`,
    ];
    process.stdout.write(`${lines.join('\n')}\n\n`);
    if (report.nodes.length > 0) {
      process.stdout.write(
        table(
          ['NODE', 'HOST', 'HEARTBEAT', 'FENCED'],
          [...inv.nodes.values()].map((n) => [
            n.node,
            n.record?.host ?? '-',
            ago(n.heartbeatAgeSeconds),
            String(n.fenced.length),
          ]),
        ),
      );
      process.stdout.write('\n');
    }
    if (hostView.loops.length === 0) {
      process.stdout.write('this host has no loop device of this pool\n');
    } else {
      process.stdout.write(`this host has ${hostView.loops.length} loop device(s) of this pool:\n`);
      process.stdout.write(
        table(
          ['DEVICE', 'IMAGE', 'ID', 'MODE', 'MOUNTED AT'],
          hostView.loops.map((p) => [
            p.loop.path,
            p.image.kind,
            p.image.id ?? '-',
            p.loop.readOnly ? 'ro' : 'rw',
            p.mounts.map((m) => m.mountPoint).join(', ') || '-',
          ]),
        ),
      );
    }
    return EXIT.ok;
  });
}
