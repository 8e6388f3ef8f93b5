// Original file: proto/csi.proto


export interface NodePublishVolumeResponse {
}

export interface NodePublishVolumeResponse__Output {
}
