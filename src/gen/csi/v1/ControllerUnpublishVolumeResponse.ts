// Original file: proto/csi.proto


export interface ControllerUnpublishVolumeResponse {
}

export interface ControllerUnpublishVolumeResponse__Output {
}
