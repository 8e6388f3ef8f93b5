// Original file: proto/csi.proto

import type { Snapshot as _csi_v1_Snapshot, Snapshot__Output as _csi_v1_Snapshot__Output } from '../../csi/v1/Snapshot.js';

export interface GetSnapshotResponse {
  /**
   * This field is REQUIRED
   */
  'snapshot'?: (_csi_v1_Snapshot | null);
}

export interface GetSnapshotResponse__Output {
  /**
   * This field is REQUIRED
   */
  'snapshot': (_csi_v1_Snapshot__Output | null);
}
