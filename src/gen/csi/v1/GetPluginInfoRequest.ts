// Original file: proto/csi.proto


export interface GetPluginInfoRequest {
}

export interface GetPluginInfoRequest__Output {
}
