// Original file: proto/csi.proto


export interface ControllerModifyVolumeResponse {
}

export interface ControllerModifyVolumeResponse__Output {
}
