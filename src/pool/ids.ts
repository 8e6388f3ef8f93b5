/**
 * Identifiers that become path components. Every id that arrives in a request is checked against its
 * pattern before it is joined to a path, so no request can name a file outside the pool.
 *
 * Volume and snapshot ids are derived from the CO's name (a hash), which makes CreateVolume and
 * CreateSnapshot idempotent by construction: the same name always lands in the same directory,
 * whichever controller process handles the retry.
 */
import { createHash } from 'node:crypto';

export const VOLUME_ID_PATTERN = /^vol-[0-9a-f]{32}$/;
export const SNAPSHOT_ID_PATTERN = /^snap-[0-9a-f]{32}$/;
export const GROUP_SNAPSHOT_ID_PATTERN = /^group-[0-9a-f]{32}$/;
/** Kubernetes node names are DNS subdomains; this also admits '_' and capitals, and stays a safe file name. */
export const NODE_ID_PATTERN = /^[A-Za-z0-9][A-Za-z0-9._-]{0,239}$/;

function digest(kind: string, name: string): string {
  return createHash('sha256').update(kind).update('\0').update(name, 'utf8').digest('hex').slice(0, 32);
}

export const volumeIdForName = (name: string): string => `vol-${digest('volume', name)}`;
export const snapshotIdForName = (name: string): string => `snap-${digest('snapshot', name)}`;
export const groupSnapshotIdForName = (name: string): string => `group-${digest('group-snapshot', name)}`;
/**
 * A group snapshot's member has an id of its own kind of name, which no CreateSnapshot name reaches:
 * a caller's snapshot can never be taken for a member, nor deleted with a group.
 */
export const groupMemberIdFor = (groupId: string, volumeId: string): string =>
  `snap-${digest('group-member', `${groupId}\0${volumeId}`)}`;

export const isVolumeId = (id: string): boolean => VOLUME_ID_PATTERN.test(id);
export const isSnapshotId = (id: string): boolean => SNAPSHOT_ID_PATTERN.test(id);
export const isGroupSnapshotId = (id: string): boolean => GROUP_SNAPSHOT_ID_PATTERN.test(id);
/** '.' and '..' match the character class but are not node names. */
export const isNodeId = (id: string): boolean => NODE_ID_PATTERN.test(id) && id !== '.' && id !== '..';
