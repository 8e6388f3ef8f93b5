// Original file: proto/csi.proto


export interface NodeUnstageVolumeResponse {
}

export interface NodeUnstageVolumeResponse__Output {
}
