/**
 * The CSI GroupController service: volume group snapshots. All members are copied while every source
 * is locked and frozen (where mounted on this host), so they stand for one instant. A group that a
 * crash interrupted is redone whole on retry: keeping the members already copied would mix instants.
 */
import fs from 'node:fs/promises';
import { alreadyExists, invalidArgument, notFound } from '../errors.js';
import type { GroupControllerHandlers } from '../gen/csi/v1/GroupController.js';
import type { VolumeGroupSnapshot } from '../gen/csi/v1/VolumeGroupSnapshot.js';
import { groupMemberIdFor, groupSnapshotIdForName, isGroupSnapshotId, isVolumeId } from '../pool/ids.js';
import type { GroupSnapshotMeta, SnapshotMeta, VolumeMeta } from '../pool/types.js';
import type { SnapshotStore } from '../pool/snapshots.js';
import { method, type Methods } from '../server/call.js';
import { type CopyDeps, withConsistentSources } from './consistency.js';
import { sameStrings } from './create-volume.js';
import { parseSnapshotParameters } from './snapshots.js';
import { snapshotMessage, timestamp } from './messages.js';
import { requireField } from './validate.js';

export interface GroupDeps extends CopyDeps {
  snapshots: SnapshotStore;
}

/** A member's name, for people to read; its id is not derived from it (see groupMemberIdFor). */
const memberName = (groupId: string, volumeId: string): string => `${groupId}/${volumeId}`;

function sameSet(a: readonly string[], b: readonly string[]): boolean {
  const sa = [...new Set(a)].sort();
  const sb = [...new Set(b)].sort();
  return sa.length === sb.length && sa.every((x, i) => x === sb[i]);
}

export function groupService(d: GroupDeps): Methods<GroupControllerHandlers> {
  const { pool, snapshots, volumes } = d;

  async function groupMessage(group: GroupSnapshotMeta): Promise<VolumeGroupSnapshot> {
    const members: SnapshotMeta[] = [];
    for (const id of group.snapshotIds) {
      const s = await snapshots.get(id);
      if (s) members.push(s);
    }
    return {
      group_snapshot_id: group.id,
      snapshots: members.map(snapshotMessage),
      creation_time: timestamp(group.createdAt),
      ready_to_use: group.state === 'ready' && members.length === group.snapshotIds.length,
    };
  }

  function checkListed(group: GroupSnapshotMeta, listed: readonly string[]): void {
    if (listed.length > 0 && !sameSet(listed, group.snapshotIds)) {
      throw invalidArgument(`snapshot_ids do not match the members of group snapshot ${group.id}.`);
    }
  }

  return {
    GroupControllerGetCapabilities: method({
      validate: () => null,
      quiet: true,
      run: () =>
        Promise.resolve({ capabilities: [{ rpc: { type: 'CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT' } }] }),
    }),

    CreateVolumeGroupSnapshot: method({
      validate: (req) => {
        const name = requireField(req.name, 'name');
        if (req.source_volume_ids.length === 0) throw invalidArgument('source_volume_ids is required.');
        for (const id of req.source_volume_ids) requireField(id, 'source_volume_ids[]');
        if (new Set(req.source_volume_ids).size !== req.source_volume_ids.length) {
          throw invalidArgument('source_volume_ids lists a volume twice.');
        }
        return {
          name,
          id: groupSnapshotIdForName(name),
          sources: [...req.source_volume_ids],
          parameters: parseSnapshotParameters(req.parameters),
        };
      },
      locks: (v) => [v.id, ...v.sources],
      // The group's pool lock keeps a second controller (a standby after a failover) from redoing, and
      // so deleting, a group this one is still copying.
      run: (v, ctx) =>
        pool.withLock(v.id, 'CreateVolumeGroupSnapshot', async (groupLock) => {
          const record = await snapshots.inspectGroup(v.id);
          if (record.state === 'damaged') await snapshots.quarantineGroup(v.id, record.reason, groupLock);
          if (record.state === 'absent') await snapshots.refuseQuarantinedGroup(v.id);
          const existing = record.state === 'ok' ? record.value : undefined;
          if (existing?.state === 'ready') {
            if (!sameSet(existing.sourceVolumeIds, v.sources)) {
              throw alreadyExists(
                `A group snapshot named ${JSON.stringify(v.name)} already exists, of other volumes.`,
              );
            }
            if (!sameStrings(existing.parameters, v.parameters)) {
              throw alreadyExists(
                `A group snapshot named ${JSON.stringify(v.name)} already exists, with other parameters.`,
              );
            }
            return { group_snapshot: await groupMessage(existing) };
          }
          const sources: VolumeMeta[] = [];
          for (const id of v.sources) {
            const meta = isVolumeId(id) ? await volumes.get(id) : undefined;
            if (!meta) throw notFound(`Volume ${id} does not exist.`);
            sources.push(meta);
          }
          if (existing) {
            ctx.log.warn({ groupSnapshotId: v.id }, 'redoing an interrupted group snapshot from scratch');
            groupLock.assertHeld();
            await snapshots.deleteGroup(v.id, existing.snapshotIds, groupLock);
          }
          const memberIds = sources.map((s) => groupMemberIdFor(v.id, s.id));
          const group: GroupSnapshotMeta = {
            format: 1,
            id: v.id,
            name: v.name,
            state: 'creating',
            sourceVolumeIds: v.sources,
            snapshotIds: memberIds,
            parameters: v.parameters,
            createdAt: new Date().toISOString(),
          };
          groupLock.assertHeld();
          await snapshots.writeGroup(group);
          // The members stay "creating" (unlisted, not restorable) until the copy is known to be good:
          // withConsistentSources checks that every freeze held until the last copy ended, after them.
          let takenAt = group.createdAt;
          try {
            const made = await withConsistentSources(ctx, d, v.sources, async (plan) => {
              const at = plan.takenAt;
              const copied: SnapshotMeta[] = [];
              for (const [i, src] of sources.entries()) {
                const held = plan.source(src.id); // as it stands now that it is locked
                const member: SnapshotMeta = {
                  format: 1,
                  id: memberIds[i] ?? '',
                  name: memberName(v.id, src.id),
                  state: 'creating',
                  sourceVolumeId: src.id,
                  sizeBytes: held.meta.capacityBytes,
                  fsType: held.meta.fsType,
                  initialized: held.initialized,
                  parameters: v.parameters,
                  groupSnapshotId: v.id,
                  createdAt: at.toISOString(),
                };
                const { snapshot } = await snapshots.create(
                  member,
                  async (image) => {
                    await plan.copy(src.id, image);
                    return {
                      takenAt: at,
                      // The copy's size, as CreateSnapshot records it: an image an expansion cut short
                      // left larger than its record restores into a volume it fits.
                      sizeBytes: (await fs.stat(image)).size,
                      fsType: held.meta.fsType,
                      initialized: held.initialized,
                      sectorSize: held.sectorSize,
                    };
                  },
                  { ready: false },
                );
                copied.push(snapshot);
              }
              takenAt = at.toISOString();
              return copied;
            });
            for (const member of made) {
              groupLock.assertHeld();
              await snapshots.markReady(member);
            }
          } catch (err) {
            // With the group's lock lost, another process may own this group now (and have finished
            // it): what is there is that process's, not this one's to clear.
            if (groupLock.signal.aborted) throw err;
            // Nothing of a failed group is kept: its members are copies nobody may use.
            await snapshots.deleteGroup(v.id, memberIds, groupLock).catch((cleanupErr: unknown) => {
              ctx.log.error(
                { groupSnapshotId: v.id, err: cleanupErr },
                'could not remove a failed group snapshot',
              );
            });
            throw err;
          }
          const ready: GroupSnapshotMeta = { ...group, state: 'ready', createdAt: takenAt };
          groupLock.assertHeld();
          await snapshots.writeGroup(ready);
          ctx.log.info({ groupSnapshotId: v.id, members: memberIds.length }, 'created group snapshot');
          return { group_snapshot: await groupMessage(ready) };
        }),
    }),

    DeleteVolumeGroupSnapshot: method({
      validate: (req) => ({
        id: requireField(req.group_snapshot_id, 'group_snapshot_id'),
        listed: req.snapshot_ids,
      }),
      locks: (v) => [v.id],
      run: async ({ id, listed }) => {
        if (!isGroupSnapshotId(id)) return {};
        return pool.withLock(id, 'DeleteVolumeGroupSnapshot', async (groupLock) => {
          const record = await snapshots.inspectGroup(id);
          if (record.state === 'damaged') await snapshots.quarantineGroup(id, record.reason, groupLock);
          if (record.state !== 'ok') return {};
          const group = record.value;
          checkListed(group, listed);
          groupLock.assertHeld();
          await snapshots.deleteGroup(id, group.snapshotIds, groupLock);
          return {};
        });
      },
    }),

    GetVolumeGroupSnapshot: method({
      validate: (req) => ({
        id: requireField(req.group_snapshot_id, 'group_snapshot_id'),
        listed: req.snapshot_ids,
      }),
      quiet: true,
      run: async ({ id, listed }) => {
        const group = isGroupSnapshotId(id) ? await snapshots.readGroup(id) : undefined;
        if (group?.state !== 'ready') throw notFound(`Group snapshot ${id} does not exist.`);
        checkListed(group, listed);
        return { group_snapshot: await groupMessage(group) };
      },
    }),
  };
}
