/** `loopvol volumes` and `loopvol snapshots`: one line each, with the PVC they were made for. */
import {
  pvcOf,
  readSnapshots,
  readVolumes,
  stateOf,
  storesFor,
  type VolumeInfo,
} from '../audit/inventory.js';
import {
  bytes,
  cliLogger,
  COMMON_HELP,
  COMMON_OPTIONS,
  EXIT,
  EXIT_HELP,
  openPool,
  parse,
  printJson,
  runCommand,
  table,
} from './common.js';

export const VOLUMES_USAGE =
  'loopvol volumes [--pool-dir DIR] [--pvc NAME|NAMESPACE/NAME] [--node NODE] [--json]\n' +
  '  One line per volume: id, PVC (namespace/name) and PV from the labels the provisioner recorded, size,\n' +
  '  allocated bytes, filesystem (or block), allocation, state, the nodes it is published to and staged on\n' +
  '  (a revoked lease is marked "revoked"), and when it was created.\n' +
  COMMON_HELP +
  '  --pvc NAME            only volumes of PVCs of that name (NAME) or that one PVC (NAMESPACE/NAME)\n' +
  '  --node NODE           only volumes published to or staged on NODE\n' +
  EXIT_HELP;

export const SNAPSHOTS_USAGE =
  'loopvol snapshots [--pool-dir DIR] [--volume ID] [--pvc NAME|NAMESPACE/NAME] [--json]\n' +
  '  One line per snapshot: id, name, source volume and its PVC, size, allocated bytes, filesystem,\n' +
  '  state, group snapshot, and the instant it stands for.\n' +
  COMMON_HELP +
  '  --volume ID           only snapshots of that volume\n' +
  '  --pvc NAME            only snapshots of volumes of PVCs of that name (or NAMESPACE/NAME)\n' +
  EXIT_HELP;

function pvcMatches(filter: string | undefined, pvc: { namespace: string; name: string }): boolean {
  if (filter === undefined) return true;
  return filter.includes('/') ? `${pvc.namespace}/${pvc.name}` === filter : pvc.name === filter;
}

const orDash = (s: string): string => (s === '' ? '-' : s);

function volumeRow(v: VolumeInfo) {
  const meta = v.record.state === 'ok' ? v.record.value : undefined;
  const pvc = meta ? pvcOf(meta) : { namespace: '', name: '', pv: '' };
  return {
    id: v.id,
    name: meta?.name ?? null,
    pvc: pvc.name ? { namespace: pvc.namespace, name: pvc.name } : null,
    pv: pvc.pv || null,
    sizeBytes: meta?.capacityBytes ?? v.image?.sizeBytes ?? null,
    allocatedBytes: v.image?.allocatedBytes ?? null,
    fsType: meta ? (meta.fsType === 'none' ? 'block' : meta.fsType) : null,
    allocation: meta?.allocation ?? null,
    state: stateOf(v.record, v.image !== undefined),
    publishedTo: v.attachments.map((a) => a.node),
    stagedOn: v.leases.map((l) => ({
      node: l.node,
      revoked: l.revokedAt !== undefined,
      fenced: l.fencedAt !== undefined,
      device: l.device ?? null,
    })),
    createdAt: meta?.createdAt ?? null,
    contentSource: meta?.contentSource ?? null,
  };
}

export async function volumes(argv: string[]): Promise<number> {
  return runCommand('volumes', async () => {
    const { values } = parse(argv, {
      ...COMMON_OPTIONS,
      pvc: { type: 'string' },
      node: { type: 'string' },
    });
    const log = cliLogger('silent');
    const pool = await openPool(values['pool-dir'], log);
    const rows = (await readVolumes(pool, storesFor(pool, log).volumes))
      .map(volumeRow)
      .filter((r) => pvcMatches(values.pvc, r.pvc ?? { namespace: '', name: '' }))
      .filter(
        (r) =>
          values.node === undefined ||
          r.publishedTo.includes(values.node) ||
          r.stagedOn.some((l) => l.node === values.node),
      );
    if (values.json) {
      printJson(rows);
      return EXIT.ok;
    }
    process.stdout.write(
      table(
        [
          'ID',
          'PVC',
          'PV',
          'SIZE',
          'ALLOCATED',
          'FS',
          'ALLOCATION',
          'STATE',
          'PUBLISHED',
          'STAGED',
          'CREATED',
        ],
        rows.map((r) => [
          r.id,
          r.pvc ? `${r.pvc.namespace}/${r.pvc.name}` : '-',
          orDash(r.pv ?? ''),
          bytes(r.sizeBytes ?? undefined),
          bytes(r.allocatedBytes ?? undefined),
          r.fsType ?? '-',
          r.allocation ?? '-',
          r.state,
          orDash(r.publishedTo.join(',')),
          orDash(
            r.stagedOn
              .map((l) => `${l.node}${l.revoked ? (l.fenced ? '(revoked,fenced)' : '(revoked)') : ''}`)
              .join(','),
          ),
          r.createdAt ?? '-',
        ]),
      ),
    );
    return EXIT.ok;
  });
}

export async function snapshots(argv: string[]): Promise<number> {
  return runCommand('snapshots', async () => {
    const { values } = parse(argv, {
      ...COMMON_OPTIONS,
      volume: { type: 'string' },
      pvc: { type: 'string' },
    });
    const log = cliLogger('silent');
    const pool = await openPool(values['pool-dir'], log);
    const stores = storesFor(pool, log);
    const sources = new Map((await readVolumes(pool, stores.volumes)).map((v) => [v.id, v]));
    const rows = (await readSnapshots(pool, stores.snapshots))
      .map((s) => {
        const meta = s.record.state === 'ok' ? s.record.value : undefined;
        const source = meta ? sources.get(meta.sourceVolumeId) : undefined;
        const sourceMeta = source?.record.state === 'ok' ? source.record.value : undefined;
        const pvc = sourceMeta ? pvcOf(sourceMeta) : undefined;
        return {
          id: s.id,
          name: meta?.name ?? null,
          sourceVolumeId: meta?.sourceVolumeId ?? null,
          sourcePvc: pvc?.name ? { namespace: pvc.namespace, name: pvc.name } : null,
          sizeBytes: meta?.sizeBytes ?? s.image?.sizeBytes ?? null,
          allocatedBytes: s.image?.allocatedBytes ?? null,
          fsType: meta ? (meta.fsType === 'none' ? 'block' : meta.fsType) : null,
          state: stateOf(s.record, s.image !== undefined),
          groupSnapshotId: meta?.groupSnapshotId || null,
          createdAt: meta?.createdAt ?? null,
        };
      })
      .filter((r) => values.volume === undefined || r.sourceVolumeId === values.volume)
      .filter(
        (r) => values.pvc === undefined || pvcMatches(values.pvc, r.sourcePvc ?? { namespace: '', name: '' }),
      );
    if (values.json) {
      printJson(rows);
      return EXIT.ok;
    }
    process.stdout.write(
      table(
        ['ID', 'NAME', 'SOURCE', 'SOURCE PVC', 'SIZE', 'ALLOCATED', 'FS', 'STATE', 'GROUP', 'CREATED'],
        rows.map((r) => [
          r.id,
          r.name ?? '-',
          r.sourceVolumeId ?? '-',
          r.sourcePvc ? `${r.sourcePvc.namespace}/${r.sourcePvc.name}` : '-',
          bytes(r.sizeBytes ?? undefined),
          bytes(r.allocatedBytes ?? undefined),
          r.fsType ?? '-',
          r.state,
          r.groupSnapshotId ?? '-',
          r.createdAt ?? '-',
        ]),
      ),
    );
    return EXIT.ok;
  });
}
