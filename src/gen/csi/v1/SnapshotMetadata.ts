// Original file: proto/csi.proto

import type * as grpc from '@grpc/grpc-js'
import type { MethodDefinition } from '@grpc/proto-loader'
import type { GetMetadataAllocatedRequest as _csi_v1_GetMetadataAllocatedRequest, GetMetadataAllocatedRequest__Output as _csi_v1_GetMetadataAllocatedRequest__Output } from '../../csi/v1/GetMetadataAllocatedRequest.js';
import type { GetMetadataAllocatedResponse as _csi_v1_GetMetadataAllocatedResponse, GetMetadataAllocatedResponse__Output as _csi_v1_GetMetadataAllocatedResponse__Output } from '../../csi/v1/GetMetadataAllocatedResponse.js';
import type { GetMetadataDeltaRequest as _csi_v1_GetMetadataDeltaRequest, GetMetadataDeltaRequest__Output as _csi_v1_GetMetadataDeltaRequest__Output } from '../../csi/v1/GetMetadataDeltaRequest.js';
import type { GetMetadataDeltaResponse as _csi_v1_GetMetadataDeltaResponse, GetMetadataDeltaResponse__Output as _csi_v1_GetMetadataDeltaResponse__Output } from '../../csi/v1/GetMetadataDeltaResponse.js';

export interface SnapshotMetadataClient extends grpc.Client {
  GetMetadataAllocated(argument: _csi_v1_GetMetadataAllocatedRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_csi_v1_GetMetadataAllocatedResponse__Output>;
  GetMetadataAllocated(argument: _csi_v1_GetMetadataAllocatedRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_csi_v1_GetMetadataAllocatedResponse__Output>;
  getMetadataAllocated(argument: _csi_v1_GetMetadataAllocatedRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_csi_v1_GetMetadataAllocatedResponse__Output>;
  getMetadataAllocated(argument: _csi_v1_GetMetadataAllocatedRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_csi_v1_GetMetadataAllocatedResponse__Output>;
  
  GetMetadataDelta(argument: _csi_v1_GetMetadataDeltaRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_csi_v1_GetMetadataDeltaResponse__Output>;
  GetMetadataDelta(argument: _csi_v1_GetMetadataDeltaRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_csi_v1_GetMetadataDeltaResponse__Output>;
  getMetadataDelta(argument: _csi_v1_GetMetadataDeltaRequest, metadata: grpc.Metadata, options?: grpc.CallOptions): grpc.ClientReadableStream<_csi_v1_GetMetadataDeltaResponse__Output>;
  getMetadataDelta(argument: _csi_v1_GetMetadataDeltaRequest, options?: grpc.CallOptions): grpc.ClientReadableStream<_csi_v1_GetMetadataDeltaResponse__Output>;
  
}

export interface SnapshotMetadataHandlers extends grpc.UntypedServiceImplementation {
  GetMetadataAllocated: grpc.handleServerStreamingCall<_csi_v1_GetMetadataAllocatedRequest__Output, _csi_v1_GetMetadataAllocatedResponse>;
  
  GetMetadataDelta: grpc.handleServerStreamingCall<_csi_v1_GetMetadataDeltaRequest__Output, _csi_v1_GetMetadataDeltaResponse>;
  
}

export interface SnapshotMetadataDefinition extends grpc.ServiceDefinition {
  GetMetadataAllocated: MethodDefinition<_csi_v1_GetMetadataAllocatedRequest, _csi_v1_GetMetadataAllocatedResponse, _csi_v1_GetMetadataAllocatedRequest__Output, _csi_v1_GetMetadataAllocatedResponse__Output>
  GetMetadataDelta: MethodDefinition<_csi_v1_GetMetadataDeltaRequest, _csi_v1_GetMetadataDeltaResponse, _csi_v1_GetMetadataDeltaRequest__Output, _csi_v1_GetMetadataDeltaResponse__Output>
}
