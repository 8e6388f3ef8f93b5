/**
 * StorageClass parameters and mutable parameters (VolumeAttributesClass), as they really arrive.
 */
import { invalidArgument } from '../errors.js';
import {
  ALLOCATIONS,
  type Allocation,
  FS_TYPES,
  type FsType,
  isAllocation,
  isFsType,
} from '../pool/types.js';

export const PARAM_FSTYPE = 'csi.storage.k8s.io/fstype';
export const PARAM_ALLOCATION = 'allocation';
/** Keys the external-provisioner adds (--extra-create-metadata): kept as the volume's labels. */
export const K8S_PREFIX = 'csi.storage.k8s.io/';

const KNOWN = [
  PARAM_FSTYPE,
  PARAM_ALLOCATION,
  `${K8S_PREFIX}pvc/name`,
  `${K8S_PREFIX}pvc/namespace`,
  `${K8S_PREFIX}pv/name`,
];
const MUTABLE = [PARAM_ALLOCATION];

export interface VolumeParameters {
  fsType: FsType | undefined;
  allocation: Allocation | undefined;
  labels: Record<string, string>;
}

function parseAllocation(value: string, field: string): Allocation {
  if (!isAllocation(value)) {
    throw invalidArgument(`${field} ${JSON.stringify(value)} is not valid; use ${ALLOCATIONS.join(' or ')}.`);
  }
  return value;
}

export function parseVolumeParameters(params: Record<string, string>): VolumeParameters {
  let fsType: FsType | undefined;
  let allocation: Allocation | undefined;
  const labels: Record<string, string> = {};
  for (const [key, value] of Object.entries(params)) {
    if (key === PARAM_FSTYPE) {
      if (value === '') continue;
      if (!isFsType(value)) {
        throw invalidArgument(
          `Parameter ${PARAM_FSTYPE}=${value} is not supported; use one of ${FS_TYPES.join(', ')}.`,
        );
      }
      fsType = value;
    } else if (key === PARAM_ALLOCATION) {
      allocation = parseAllocation(value, `Parameter ${PARAM_ALLOCATION}`);
    } else if (key.startsWith(K8S_PREFIX)) {
      labels[key.slice(K8S_PREFIX.length)] = value;
    } else {
      throw invalidArgument(
        `Parameter ${JSON.stringify(key)} is not known; the known parameters are ${KNOWN.join(', ')}.`,
      );
    }
  }
  return { fsType, allocation, labels };
}

export function parseMutableParameters(params: Record<string, string>): {
  allocation: Allocation | undefined;
} {
  let allocation: Allocation | undefined;
  for (const [key, value] of Object.entries(params)) {
    if (key === PARAM_ALLOCATION)
      allocation = parseAllocation(value, `Mutable parameter ${PARAM_ALLOCATION}`);
    else {
      throw invalidArgument(
        `Mutable parameter ${JSON.stringify(key)} is not supported; the mutable parameters are ${MUTABLE.join(', ')}.`,
      );
    }
  }
  return { allocation };
}
