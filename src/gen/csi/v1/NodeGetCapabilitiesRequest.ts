// Original file: proto/csi.proto


export interface NodeGetCapabilitiesRequest {
}

export interface NodeGetCapabilitiesRequest__Output {
}
