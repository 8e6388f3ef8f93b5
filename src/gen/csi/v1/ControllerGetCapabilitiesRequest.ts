// Original file: proto/csi.proto


export interface ControllerGetCapabilitiesRequest {
}

export interface ControllerGetCapabilitiesRequest__Output {
}
