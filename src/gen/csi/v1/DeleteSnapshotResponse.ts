// Original file: proto/csi.proto


export interface DeleteSnapshotResponse {
}

export interface DeleteSnapshotResponse__Output {
}
