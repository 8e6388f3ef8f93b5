/**
 * The format of volumes/<id>/fences.json, and pure changes to it.
 */
import { isRecord, type RecordRead } from './fsutil.js';
import { type Attachment, isMultiNode, type Lease, parseAttachment, parseLease } from './types.js';

/**
 * volumes/<id>/fences.json: every node's attachment and lease in one file. One file that always has
 * the same name is read fresh at every open on a network filesystem (close-to-open), where a listing
 * of a directory of per-node files can be served from a client's cache for a minute.
 */
export interface FenceFile {
  attachments: Record<string, Attachment>;
  leases: Record<string, Lease>;
  /** Leases of nodes the volume was detached from while staged (see unpublish). */
  revoked: Record<string, Lease>;
  /**
   * Nodes the volume was detached from while not staged there, and when: a NodeStageVolume that was
   * under way at that moment must not take a lease afterwards (see takeLease). Gone at the next publish
   * to that node.
   */
  detached: Record<string, string>;
}

/**
 * The fence file as read once by code holding the volume's lock (nobody else changes it meanwhile):
 * passed on as `read` instead of reading it again.
 */
export type FenceRead = RecordRead<FenceFile>;

export const without = <T>(r: Record<string, T>, keys: ReadonlySet<string>): Record<string, T> =>
  Object.fromEntries(Object.entries(r).filter(([k]) => !keys.has(k)));

export function parseFenceFile(v: unknown): FenceFile | undefined {
  if (!isRecord(v) || !isRecord(v.attachments) || !isRecord(v.leases)) return undefined;
  if (v.revoked !== undefined && !isRecord(v.revoked)) return undefined;
  if (v.detached !== undefined && !isRecord(v.detached)) return undefined;
  const detached: Record<string, string> = {};
  for (const [node, at] of Object.entries(v.detached ?? {})) {
    if (typeof at !== 'string') return undefined;
    detached[node] = at;
  }
  const attachments: Record<string, Attachment> = {};
  const leases: Record<string, Lease> = {};
  const revoked: Record<string, Lease> = {};
  for (const [node, l] of Object.entries(v.revoked ?? {})) {
    const parsed = parseLease(l);
    if (!parsed || parsed.node !== node || parsed.revokedAt === undefined) return undefined;
    revoked[node] = parsed;
  }
  for (const [node, a] of Object.entries(v.attachments)) {
    const parsed = parseAttachment(a);
    if (!parsed || parsed.node !== node) return undefined;
    attachments[node] = parsed;
  }
  for (const [node, l] of Object.entries(v.leases)) {
    const parsed = parseLease(l);
    if (!parsed || parsed.node !== node) return undefined;
    leases[node] = parsed;
  }
  return { attachments, leases, revoked, detached };
}

export function describeAttachment(a: Pick<Attachment, 'readonly' | 'accessType' | 'mode'>): string {
  return `${a.accessType} access, ${a.mode}${a.readonly ? ', read-only' : ''}`;
}

/** Whether a publish or a stage may share its volume with other nodes: read-only, multi-node access mode. */
export const shareable = (a: Pick<Attachment | Lease, 'mode' | 'readonly'>): boolean =>
  isMultiNode(a.mode) && a.readonly;

/** Why `att` may not join `blocking`'s publish of volume `id` on another node. */
export function sharingRefused(id: string, blocking: Attachment, att: Attachment): string {
  const rule =
    isMultiNode(att.mode) && isMultiNode(blocking.mode)
      ? 'nodes share it only when each publish is read-only'
      : 'it is a single-node volume';
  return `Volume ${id} is published to node ${blocking.node} and ${rule}: not published to ${att.node}.`;
}

/** `revoked` with the leases of `nodes` marked released, saying `how` and when. */
export function letGo(
  revoked: Record<string, Lease>,
  nodes: readonly string[],
  how: string,
): Record<string, Lease> {
  const out = { ...revoked };
  for (const n of nodes) {
    const l = out[n];
    if (l && l.fencedAt === undefined) out[n] = { ...l, fencedAt: `${how} at ${new Date().toISOString()}` };
  }
  return out;
}

/** What an attachment record that cannot be read stands for: a writer's. */
export const unreadableAttachment = (node: string): Attachment => ({
  node,
  readonly: false,
  accessType: 'mount',
  mode: 'SINGLE_NODE_WRITER',
  since: 'unknown (unreadable record)',
});

/** What a lease record that cannot be read stands for: a writer's. */
export const unreadableLease = (node: string): Lease => ({
  ...unreadableAttachment(node),
  stagingPath: '',
});
