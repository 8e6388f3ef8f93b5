// Original file: proto/csi.proto


export interface DeleteVolumeGroupSnapshotResponse {
}

export interface DeleteVolumeGroupSnapshotResponse__Output {
}
