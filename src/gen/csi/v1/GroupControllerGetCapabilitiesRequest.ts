// Original file: proto/csi.proto


export interface GroupControllerGetCapabilitiesRequest {
}

export interface GroupControllerGetCapabilitiesRequest__Output {
}
