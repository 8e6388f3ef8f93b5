/**
 * Pure request checks shared by the services: they throw INVALID_ARGUMENT (or OUT_OF_RANGE for sizes)
 * before any side effect, with a message that says what to fix.
 */
import path from 'node:path';
import type { CapacityRange__Output } from '../gen/csi/v1/CapacityRange.js';
import type { TopologyRequirement__Output } from '../gen/csi/v1/TopologyRequirement.js';
import type { VolumeCapability__Output } from '../gen/csi/v1/VolumeCapability.js';
import { aborted, type CsiError, invalidArgument, outOfRange } from '../errors.js';
import { normalPath } from '../host/paths.js';
import { type Capability, FS_TYPES, type FsType, isAccessMode, isFsType } from '../pool/types.js';

export const TOPOLOGY_KEY = 'loopvol.csi.io/pool';
export const MiB = 2 ** 20;

/**
 * Smallest volume of each filesystem: what its mkfs accepts (xfsprogs 6: 300 MiB), and for btrfs what
 * it needs to grow: mkfs.btrfs accepts about 109 MiB, but the kernel refuses to resize a btrfs to less
 * than 256 MiB (EINVAL), so a smaller one could never be expanded.
 */
export const MIN_BYTES: Record<FsType | 'block', number> = {
  ext4: MiB,
  xfs: 300 * MiB,
  btrfs: 256 * MiB,
  block: MiB,
};

export function requireField(value: string, field: string): string {
  if (value === '') throw invalidArgument(`${field} is required.`);
  return value;
}

/** An absolute path; anything else is refused before it can reach a mount command. */
export function requirePath(value: string, field: string): string {
  requireField(value, field);
  if (!path.isAbsolute(value))
    throw invalidArgument(`${field} must be an absolute path, not ${JSON.stringify(value)}.`);
  if (value.includes('\0')) throw invalidArgument(`${field} contains a NUL byte.`);
  if (value.length > 4095 || value.split('/').some((part) => Buffer.byteLength(part) > 255)) {
    throw invalidArgument(`${field} is longer than a Linux path may be.`);
  }
  return normalPath(value);
}

/** An int64 field that arrives as a decimal string. */
export function parseInt64(value: string | number | null | undefined, field: string): number {
  if (value === null || value === undefined || value === '') return 0;
  let big: bigint;
  try {
    big = BigInt(value);
  } catch {
    throw invalidArgument(`${field} is not a number.`);
  }
  if (big < 0n) throw invalidArgument(`${field} must not be negative.`);
  if (big > BigInt(Number.MAX_SAFE_INTEGER))
    throw outOfRange(`${field} is larger than this driver supports (8 PiB).`);
  return Number(big);
}

export interface Range {
  requiredBytes: number;
  limitBytes: number;
}

export function parseRange(range: CapacityRange__Output | null): Range {
  if (!range) return { requiredBytes: 0, limitBytes: 0 };
  const requiredBytes = parseInt64(range.required_bytes, 'capacity_range.required_bytes');
  const limitBytes = parseInt64(range.limit_bytes, 'capacity_range.limit_bytes');
  if (limitBytes > 0 && requiredBytes > limitBytes) {
    throw outOfRange(
      `capacity_range.required_bytes (${requiredBytes}) is larger than limit_bytes (${limitBytes}).`,
    );
  }
  return { requiredBytes, limitBytes };
}

export const roundUpMiB = (n: number): number => Math.ceil(n / MiB) * MiB;
export const floorMiB = (n: number): number => Math.floor(n / MiB) * MiB;

/** Options a mount may never carry: they would mount something else, elsewhere, or bypass the fence. */
const FORBIDDEN_OPTIONS = new Set([
  'bind',
  'rbind',
  'move',
  'remount',
  'loop',
  'offset',
  'sizelimit',
  'encryption',
  'helper',
  'uhelper',
  'user',
  'users',
  'owner',
  'group',
  'shared',
  'rshared',
  'slave',
  'rslave',
  'private',
  'rprivate',
  'unbindable',
  'runbindable',
  'journal_path',
  'journal_dev',
  'logdev',
  'rtdev',
  'device',
  'source',
]);

/** Splits one mount_flags entry into options, honouring quotes (context="a,b"). */
function splitOptions(flag: string): string[] {
  const out: string[] = [];
  let cur = '';
  let quoted = false;
  for (const ch of flag) {
    if (ch === '"') quoted = !quoted;
    if (ch === ',' && !quoted) {
      out.push(cur);
      cur = '';
    } else {
      cur += ch;
    }
  }
  if (quoted) throw invalidArgument(`mount flag ${JSON.stringify(flag)} has an unbalanced quote.`);
  out.push(cur);
  return out;
}

/** Validates mount_flags and returns them as single options. */
export function parseMountFlags(flags: readonly string[]): string[] {
  const out: string[] = [];
  for (const flag of flags) {
    for (const opt of splitOptions(flag)) {
      const trimmed = opt.trim();
      if (trimmed === '') continue;
      const name = (trimmed.split('=')[0] ?? '').toLowerCase();
      if (!/^[a-z0-9_][a-z0-9_.-]*$/.test(name) || /[\s\\\0]/.test(trimmed)) {
        throw invalidArgument(`mount flag ${JSON.stringify(trimmed)} is not a valid mount option.`);
      }
      if (FORBIDDEN_OPTIONS.has(name) || name.startsWith('x-')) {
        throw invalidArgument(
          `mount flag ${JSON.stringify(trimmed)} is not allowed: it would change what or how the volume is mounted.`,
        );
      }
      out.push(trimmed);
    }
  }
  return out;
}

/** A VolumeCapability → our Capability; unsupported access modes and filesystems are INVALID_ARGUMENT. */
export function parseCapability(cap: VolumeCapability__Output | null, field: string): Capability {
  if (!cap) throw invalidArgument(`${field} is required.`);
  const mode = cap.access_mode?.mode;
  if (mode === undefined || mode === 'UNKNOWN') throw invalidArgument(`${field}.access_mode is required.`);
  if (!isAccessMode(mode)) {
    throw invalidArgument(
      `${field}.access_mode ${mode} is not supported: a loop-mounted filesystem cannot have writers on several nodes.`,
    );
  }
  if (cap.access_type === 'block' || (cap.access_type === undefined && cap.block)) {
    return { accessType: 'block', mode, fsType: '', mountFlags: [] };
  }
  if (cap.access_type === 'mount' || cap.mount) {
    const fsType = cap.mount?.fs_type ?? '';
    if (fsType !== '' && !isFsType(fsType)) {
      throw invalidArgument(
        `${field}.mount.fs_type ${fsType} is not supported; use one of ${FS_TYPES.join(', ')}.`,
      );
    }
    return { accessType: 'mount', mode, fsType, mountFlags: parseMountFlags(cap.mount?.mount_flags ?? []) };
  }
  throw invalidArgument(`${field} needs an access type, mount or block.`);
}

export function parseCapabilities(caps: readonly VolumeCapability__Output[], field: string): Capability[] {
  if (caps.length === 0) throw invalidArgument(`${field} is required.`);
  return caps.map((c, i) => parseCapability(c, `${field}[${i}]`));
}

/** True when `topology` (requisite, else preferred) admits this pool; no requirement admits it. */
export function topologyAdmits(req: TopologyRequirement__Output | null, poolName: string): boolean {
  if (!req) return true;
  const list = req.requisite.length > 0 ? req.requisite : req.preferred;
  if (list.length === 0) return true;
  return list.some((t) => t.segments[TOPOLOGY_KEY] === poolName);
}

export function describeCapability(c: Capability): string {
  const fs = c.accessType === 'mount' && c.fsType ? ` ${c.fsType}` : '';
  return `${c.accessType}${fs} ${c.mode}`;
}

/** A starting_token this driver never issued: ABORTED, as the spec asks, so the caller starts over. */
export function invalidToken(token: string): CsiError {
  return aborted(
    `starting_token ${JSON.stringify(token.slice(0, 80))} is not valid; start the listing again without it.`,
  );
}
