/**
 * Snapshots: CreateSnapshot copies a volume's image at one instant (consistency.ts), idempotent by name
 * and crash-safe (pool/snapshots.ts); delete, list and get read the pool.
 */
import fs from 'node:fs/promises';
import { alreadyExists, invalidArgument, notFound } from '../errors.js';
import type { ControllerHandlers } from '../gen/csi/v1/Controller.js';
import { isSnapshotId, isVolumeId, snapshotIdForName } from '../pool/ids.js';
import type { SnapshotMeta } from '../pool/types.js';
import { method, type Methods } from '../server/call.js';
import { withConsistentSources } from './consistency.js';
import type { ControllerDeps } from './controller.js';
import { snapshotMessage } from './messages.js';
import { K8S_PREFIX } from './parameters.js';
import { invalidToken, requireField } from './validate.js';

/** Keys under csi.storage.k8s.io/ that the snapshotter adds; nothing else is a known snapshot parameter. */
export function parseSnapshotParameters(params: Record<string, string>): Record<string, string> {
  for (const key of Object.keys(params)) {
    if (!key.startsWith(K8S_PREFIX)) {
      throw invalidArgument(
        `Snapshot parameter ${JSON.stringify(key)} is not known; loopvol takes no snapshot parameters.`,
      );
    }
  }
  return params;
}

export function snapshotMethods(
  d: ControllerDeps,
): Pick<Methods<ControllerHandlers>, 'CreateSnapshot' | 'DeleteSnapshot' | 'ListSnapshots' | 'GetSnapshot'> {
  const { volumes, snapshots } = d;
  return {
    CreateSnapshot: method({
      validate: (req) => {
        const name = requireField(req.name, 'name');
        const source = requireField(req.source_volume_id, 'source_volume_id');
        return {
          name,
          source,
          id: snapshotIdForName(name),
          parameters: parseSnapshotParameters(req.parameters),
        };
      },
      locks: (v) => [v.id, v.source],
      run: async (v, ctx) => {
        const found = await snapshots.inspect(v.id);
        const existing = found.state === 'ok' && found.value.state === 'ready' ? found.value : undefined;
        if (existing) {
          if (existing.sourceVolumeId !== v.source) {
            throw alreadyExists(
              `A snapshot named ${JSON.stringify(v.name)} already exists, of volume ${existing.sourceVolumeId}.`,
            );
          }
          return { snapshot: snapshotMessage(existing) };
        }
        // An early answer; what the snapshot records of its source is read again under the source's lock.
        const src = isVolumeId(v.source) ? await volumes.get(v.source) : undefined;
        if (!src) throw notFound(`Volume ${v.source} does not exist.`);
        const meta: SnapshotMeta = {
          format: 1,
          id: v.id,
          name: v.name,
          state: 'creating',
          sourceVolumeId: v.source,
          sizeBytes: src.capacityBytes,
          fsType: src.fsType,
          initialized: false,
          parameters: v.parameters,
          groupSnapshotId: '',
          createdAt: new Date().toISOString(),
        };
        const { snapshot, created } = await snapshots.create(meta, (image) =>
          withConsistentSources(ctx, d, [v.source], async (plan) => {
            const held = plan.source(v.source);
            await plan.copy(v.source, image);
            return {
              takenAt: plan.takenAt,
              sizeBytes: (await fs.stat(image)).size,
              fsType: held.meta.fsType,
              initialized: held.initialized,
              sectorSize: held.sectorSize,
            };
          }),
        );
        if (!created && snapshot.sourceVolumeId !== v.source) {
          throw alreadyExists(
            `A snapshot named ${JSON.stringify(v.name)} already exists, of volume ${snapshot.sourceVolumeId}.`,
          );
        }
        return { snapshot: snapshotMessage(snapshot) };
      },
    }),

    DeleteSnapshot: method({
      validate: (req) => ({ id: requireField(req.snapshot_id, 'snapshot_id') }),
      locks: (v) => [v.id],
      run: async ({ id }) => {
        await snapshots.delete(id);
        return {};
      },
    }),

    ListSnapshots: method({
      validate: (req) => {
        if (req.max_entries < 0) throw invalidArgument('max_entries must not be negative.');
        if (req.starting_token !== '' && !isSnapshotId(req.starting_token))
          throw invalidToken(req.starting_token);
        return {
          max: req.max_entries,
          token: req.starting_token === '' ? undefined : req.starting_token,
          snapshotId: req.snapshot_id,
          sourceId: req.source_volume_id,
        };
      },
      quiet: true,
      run: async ({ max, token, snapshotId, sourceId }) => {
        if (snapshotId !== '') {
          const one = isSnapshotId(snapshotId) ? await snapshots.get(snapshotId) : undefined;
          const match = one && (sourceId === '' || one.sourceVolumeId === sourceId) ? [one] : [];
          return { entries: match.map((s) => ({ snapshot: snapshotMessage(s) })), next_token: '' };
        }
        const { snapshots: page, next } = await snapshots.list(
          token,
          max,
          (s) => sourceId === '' || s.sourceVolumeId === sourceId,
        );
        return { entries: page.map((s) => ({ snapshot: snapshotMessage(s) })), next_token: next ?? '' };
      },
    }),

    GetSnapshot: method({
      validate: (req) => ({ id: requireField(req.snapshot_id, 'snapshot_id') }),
      quiet: true,
      run: async ({ id }) => {
        const meta = isSnapshotId(id) ? await snapshots.get(id) : undefined;
        if (!meta) throw notFound(`Snapshot ${id} does not exist.`);
        return { snapshot: snapshotMessage(meta) };
      },
    }),
  };
}
