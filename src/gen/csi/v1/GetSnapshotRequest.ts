// Original file: proto/csi.proto


export interface GetSnapshotRequest {
  /**
   * The ID of the snapshot to fetch current snapshot information for.
   * This field is REQUIRED.
   */
  'snapshot_id'?: (string);
  /**
   * Secrets required by plugin to complete GetSnapshot request.
   * This field is OPTIONAL. Refer to the `Secrets Requirements`
   * section on how to use this field.
   */
  'secrets'?: ({[key: string]: string});
}

export interface GetSnapshotRequest__Output {
  /**
   * The ID of the snapshot to fetch current snapshot information for.
   * This field is REQUIRED.
   */
  'snapshot_id': (string);
  /**
   * Secrets required by plugin to complete GetSnapshot request.
   * This field is OPTIONAL. Refer to the `Secrets Requirements`
   * section on how to use this field.
   */
  'secrets': ({[key: string]: string});
}
