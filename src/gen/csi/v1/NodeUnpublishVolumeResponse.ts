// Original file: proto/csi.proto


export interface NodeUnpublishVolumeResponse {
}

export interface NodeUnpublishVolumeResponse__Output {
}
