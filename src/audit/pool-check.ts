/**
 * What is not as it should be in the pool itself (any host sees the same): records and images that do
 * not match, records that cannot be read, quarantine, holds of nodes that no longer beat, locks whose
 * holder is gone, and old trash. Pure: it judges an Inventory (inventory.ts).
 */
import { isTrashEntry } from '../pool/layout.js';
import type { Finding } from './findings.js';
import type { Inventory, NodeInfo } from './inventory.js';

export interface PoolCheckOptions {
  /** Trash older than this is reported (and removed by gc). */
  trashAgeSeconds: number;
  /** A lock not renewed for this long is reported as stale (holders renew every 15 s). */
  lockStaleSeconds: number;
}

export const DEFAULT_TRASH_AGE_SECONDS = 3600;
export const DEFAULT_LOCK_STALE_SECONDS = 120;

const seconds = (s: number): string => (s < 120 ? `${Math.round(s)} s` : `${Math.round(s / 60)} min`);

function silence(n: NodeInfo | undefined, node: string): string {
  if (!n || n.heartbeatAgeSeconds === undefined)
    return `node ${node} has no heartbeat (nodes/${node}.alive is missing${n?.record ? '' : ', and so is its registration'})`;
  return `node ${node}'s heartbeat has not changed for ${seconds(n.heartbeatAgeSeconds)}`;
}

const GONE_NODE =
  'If the node is gone for good, delete its Kubernetes Node (or taint it node.kubernetes.io/out-of-service): Kubernetes then detaches its volumes, and the driver lets another node stage them once this one has been silent for --node-fence-seconds. If the node is only down, start its node plugin again.';

export function poolFindings(inv: Inventory, opts: PoolCheckOptions): Finding[] {
  const out: Finding[] = [];
  // Held by a call at work (a holder proven gone hides nothing: what it left unfinished is reported).
  const locked = new Set(inv.locks.filter((l) => l.gone === undefined).map((l) => l.key));
  const groupRecords = new Map(inv.groups.map((g) => [g.id, g.record]));
  const damagedSnapshots = new Set(
    inv.snapshots.filter((s) => s.record.state === 'damaged').map((s) => s.id),
  );
  /** What removes member `id` of group `group` (a creation interrupted before its group was ready). */
  const memberAction = (id: string, dir: string, group: string): string => {
    const g = groupRecords.get(group);
    if (g === undefined || g.state === 'absent')
      return `Its group snapshot ${group} is gone: a DeleteSnapshot of it removes it.`;
    if (g.state === 'damaged')
      return `The record of its group snapshot ${group} cannot be read: repair it (see that finding), then a DeleteVolumeGroupSnapshot of ${group} removes it.`;
    if (!g.value.snapshotIds.includes(id))
      return `Its group snapshot ${group} does not list it, so nothing of the driver's removes it: remove ${dir} once you know whose it is.`;
    if (g.value.state === 'ready')
      return `Its group snapshot ${group} is ready, so no retry of its create touches it: a DeleteVolumeGroupSnapshot of ${group} removes it, with the group.`;
    // The controller's look discards an unfinished group with its members (leftovers.ts), unless a
    // member's record cannot be read.
    const swept = !g.value.snapshotIds.some((m) => damagedSnapshots.has(m));
    return `Nothing was ever returned for it: a retry of its group snapshot's create (the CO retries) or a DeleteVolumeGroupSnapshot of ${group} discards it${swept ? ', and the controller does, with its group, once two of its looks (5 minutes apart) saw the group unchanged' : ''}.`;
  };
  const add = (f: Omit<Finding, 'scope' | 'severity'>): void => {
    out.push({ scope: 'pool', severity: 'problem', ...f });
  };

  const records = [
    ...inv.volumes.map((v) => ({ ...v, what: 'volume', verb: 'DeleteVolume', group: undefined })),
    ...inv.snapshots.map((s) => ({
      ...s,
      what: 'snapshot',
      verb: 'DeleteSnapshot',
      group: s.record.state === 'ok' ? s.record.value.groupSnapshotId : undefined,
    })),
  ];
  for (const r of records) {
    // A CreateVolume/CreateSnapshot (or delete) at work right now; a group snapshot's member stays
    // "creating" while its group (which holds its own lock) copies the other members.
    const busy = locked.has(r.id) || (r.group !== undefined && r.group !== '' && locked.has(r.group));
    if (r.record.state === 'damaged') {
      add({
        kind: 'damaged-record',
        subject: `${r.dir}/meta.json`,
        volumeId: r.id,
        detail: `the record of ${r.what} ${r.id} cannot be read (${r.record.reason})`,
        action: `Repair meta.json from a backup, or let the driver quarantine the directory: a retried create or a ${r.verb} of it moves it to quarantine/ (it never deletes it).`,
      });
    } else if (r.record.state === 'absent') {
      if (r.image) {
        add({
          kind: 'image-without-record',
          subject: `${r.dir}/disk.img`,
          volumeId: r.id,
          detail: `${r.what} image without a record (no meta.json), ${r.image.allocatedBytes} bytes allocated`,
          action: `It may hold data: keep it until you know whose it is. A ${r.verb} or a retried create moves it to quarantine/; to drop it, remove ${r.dir}.`,
        });
      } else if (!busy) {
        add({
          kind: 'unfinished-creation',
          subject: r.dir,
          volumeId: r.id,
          detail: `a directory of ${r.what} ${r.id} with neither a record nor an image: a creation interrupted before its record was written`,
          action: `A retry of the create (the CO retries) or a ${r.verb} removes it; or remove ${r.dir}.`,
        });
      }
    } else if (r.record.value.state === 'creating') {
      if (!busy) {
        add({
          kind: 'unfinished-creation',
          subject: r.dir,
          volumeId: r.id,
          detail: `${r.what} ${r.id} (${r.record.value.name}) was never finished (its record says "creating")${r.partial ? ', with a partial image' : ''}`,
          action: r.group
            ? memberAction(r.id, r.dir, r.group)
            : `Nothing was ever returned for it: a retry of the create (the CO retries) or a ${r.verb} discards it, and the controller does once two of its looks (5 minutes apart) saw it unchanged.`,
        });
      }
    } else if (!r.image) {
      add({
        kind: 'record-without-image',
        subject: `${r.dir}/disk.img`,
        volumeId: r.id,
        detail: `${r.what} ${r.id} (${r.record.value.name}) has a record but no image: its data is gone`,
        action: `Was disk.img removed or moved by hand? Put it back from a backup, or delete the ${r.what} through Kubernetes (${r.verb} removes the record).`,
      });
    }
  }

  for (const v of inv.volumes) {
    const recorded = v.record.state === 'ok' && v.record.value.state === 'ready' ? v.record.value : undefined;
    if (recorded && v.image && v.image.sizeBytes > recorded.capacityBytes && !locked.has(v.id)) {
      add({
        kind: 'image-larger-than-record',
        subject: `${v.dir}/disk.img`,
        volumeId: v.id,
        detail: `the image of volume ${v.id} holds ${v.image.sizeBytes} bytes, its record says ${recorded.capacityBytes}: an expansion was cut short between the two`,
        action: `A ControllerExpandVolume to at least ${v.image.sizeBytes} bytes records it: the CO retries an expansion that was cut short; otherwise resize its PVC to that size. Until then its snapshots and clones hold the larger size.`,
      });
    }
    if (v.fencesDamaged) {
      add({
        kind: 'damaged-fences',
        subject: `${v.dir}/fences.json`,
        volumeId: v.id,
        detail: `the attachment and lease record of volume ${v.id} cannot be read, so the volume counts as held by a writer`,
        action:
          'Repair fences.json (its attachments and leases by node) or, once sure no node uses the volume, write {"attachments":{},"leases":{},"revoked":{}}.',
      });
    }
    for (const l of v.leases) {
      const n = inv.nodes.get(l.node);
      if (n && !n.stale) continue;
      const revoked = l.revokedAt !== undefined;
      add({
        kind: revoked ? 'stale-revoked-lease' : 'stale-lease',
        subject: `${v.dir}/fences.json`,
        volumeId: v.id,
        node: l.node,
        detail: revoked
          ? `volume ${v.id} keeps a revoked lease of node ${l.node} (detached at ${l.revokedAt ?? '?'}${l.fencedAt ? `; released: ${l.fencedAt}` : ', not yet confirmed by that node'}); ${silence(n, l.node)}`
          : `volume ${v.id} is staged on node ${l.node} since ${l.since}; ${silence(n, l.node)}`,
        action: revoked
          ? `Until node ${l.node} confirms (its plugin fences the volume when it runs again) no other node may stage the volume; a released one stops nobody and goes when that node unstages. If node ${l.node} is powered off for good, release it: loopvol release-node --node ${l.node} --yes.`
          : GONE_NODE,
      });
    }
    for (const a of v.attachments) {
      const n = inv.nodes.get(a.node);
      if (n && !n.stale) continue;
      add({
        kind: 'stale-attachment',
        subject: `${v.dir}/fences.json`,
        volumeId: v.id,
        node: a.node,
        detail: `volume ${v.id} is published to node ${a.node} since ${a.since}; ${silence(n, a.node)}`,
        action: GONE_NODE,
      });
    }
  }

  for (const n of inv.nodes.values()) {
    for (const file of n.damaged) {
      add({
        kind: 'damaged-node-record',
        subject: file,
        node: n.node,
        detail: `a record of node ${n.node} cannot be read; until it is repaired that node ${file.endsWith('.fenced') ? 'stages no volume, and its plugin, if it starts meanwhile, confirms no fence, thaws nothing of this pool and freezes none for a copy (a snapshot or clone of one mounted for writing there fails)' : 'settles none of the volumes taken from it, which stay held'}`,
        action: file.endsWith('.fenced')
          ? 'Repair it (a JSON list of the filesystems the node froze) or, once the node has rebooted, remove it.'
          : `Repair it: a JSON list of the ids of the volumes whose fences.json holds a revoked lease of node ${n.node} (loopvol volumes --node ${n.node} marks them "revoked").`,
      });
    }
  }

  for (const g of inv.groups) {
    if (g.record.state === 'ok' && g.record.value.state !== 'ready' && !locked.has(g.id)) {
      add({
        kind: 'unfinished-creation',
        subject: `groups/${g.id}`,
        detail: `group snapshot ${g.id} (${g.record.value.name}) was never finished (its record says "creating"); its ${g.record.value.snapshotIds.length} member snapshots are neither listed nor restorable, and hold their space`,
        action: `Nothing was ever returned for it: a retry of CreateVolumeGroupSnapshot (the CO retries) makes it whole, or a DeleteVolumeGroupSnapshot of ${g.id} removes it with its members, and the controller does once two of its looks (5 minutes apart) saw it unchanged.`,
      });
    }
    if (g.record.state === 'damaged') {
      add({
        kind: 'damaged-record',
        subject: `groups/${g.id}/meta.json`,
        detail: `the record of group snapshot ${g.id} cannot be read (${g.record.reason})`,
        action:
          'Repair its meta.json; a DeleteVolumeGroupSnapshot of it moves it to quarantine/ (its member snapshots stay).',
      });
    }
  }

  for (const q of inv.quarantine) {
    add({
      kind: 'quarantined-record',
      subject: q.path,
      detail: `quarantined${q.at ? ` at ${q.at}` : ''}: ${q.why ?? 'no note (QUARANTINE.json missing)'}`,
      action: `Read ${q.path}/QUARANTINE.json. Restore it (move the directory back under its id and repair meta.json) or remove it; the driver never deletes it, and refuses to make its name again until then.`,
    });
  }

  for (const l of inv.locks) {
    const who = `held by ${l.holder}${l.purpose ? ` (${l.purpose})` : ''}`;
    if (l.gone !== undefined) {
      add({
        kind: 'abandoned-lock',
        subject: l.file,
        detail: `lock ${l.key} is ${who}, but ${l.gone}`,
        action: 'loopvol gc removes it (the driver also takes it over at once when a call needs it).',
        gc: { action: 'remove-lock', key: l.key },
      });
    } else if (l.ageSeconds > opts.lockStaleSeconds) {
      add({
        kind: 'stale-lock',
        subject: l.file,
        detail: `lock ${l.key} is ${who} and has not been renewed for ${seconds(l.ageSeconds)} (holders renew it every 15 s)`,
        action: `The driver takes it over when a call needs it and has seen it unchanged for 60 s. To remove it now, run loopvol gc on ${l.host ?? 'the host that took it'}, where its holder's death can be proven.`,
      });
    }
  }

  for (const t of inv.trash) {
    if (t.ageSeconds <= opts.trashAgeSeconds) continue;
    add({
      kind: 'old-trash',
      subject: t.path,
      detail: `a deleted ${/^snap-/.test(t.entry) ? 'snapshot' : /^vol-/.test(t.entry) ? 'volume' : 'entry'} has been in the trash for ${seconds(t.ageSeconds)} (its removal was interrupted or failed)`,
      action: isTrashEntry(t.entry)
        ? 'loopvol gc removes it. If it stays, something holds it: see the leaked loop devices below.'
        : 'The driver never puts this name in the trash, so neither it nor loopvol gc removes it: look at it and remove it by hand.',
      ...(isTrashEntry(t.entry) ? { gc: { action: 'remove-trash' as const, entry: t.entry } } : {}),
    });
  }
  return out;
}
