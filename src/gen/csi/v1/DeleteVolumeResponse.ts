// Original file: proto/csi.proto


export interface DeleteVolumeResponse {
}

export interface DeleteVolumeResponse__Output {
}
