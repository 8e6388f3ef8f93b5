// Original file: proto/csi.proto


export interface GetPluginCapabilitiesRequest {
}

export interface GetPluginCapabilitiesRequest__Output {
}
