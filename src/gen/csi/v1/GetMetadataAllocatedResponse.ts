// Original file: proto/csi.proto

import type { BlockMetadataType as _csi_v1_BlockMetadataType, BlockMetadataType__Output as _csi_v1_BlockMetadataType__Output } from '../../csi/v1/BlockMetadataType.js';
import type { BlockMetadata as _csi_v1_BlockMetadata, BlockMetadata__Output as _csi_v1_BlockMetadata__Output } from '../../csi/v1/BlockMetadata.js';
import type { Long } from '@grpc/proto-loader';

/**
 * GetMetadataAllocatedResponse messages are returned in a gRPC stream.
 * Cumulatively, they provide information on the allocated data
 * ranges in the snapshot.
 */
export interface GetMetadataAllocatedResponse {
  /**
   * This specifies the style used in the BlockMetadata sequence.
   * This value must be the same in all such messages returned by
   * the stream.
   * If block_metadata_type is FIXED_LENGTH, then the size_bytes field
   * of each message in the block_metadata list MUST be constant.
   * This field is REQUIRED.
   */
  'block_metadata_type'?: (_csi_v1_BlockMetadataType);
  /**
   * This returns the capacity of the underlying volume in bytes.
   * This value must be the same in all such messages returned by
   * the stream.
   * This field is REQUIRED.
   */
  'volume_capacity_bytes'?: (number | string | Long);
  /**
   * This is a list of data range tuples.
   * If the value of max_results in the GetMetadataAllocatedRequest
   * message is greater than zero, then the number of entries in this
   * list MUST be less than or equal to that value.
   * The SP MUST respect the value of starting_offset in the request.
   * The byte_offset fields of adjacent BlockMetadata messages
   * MUST be strictly increasing and messages MUST NOT overlap:
   * i.e. for any two BlockMetadata messages, A and B, if A is returned
   * before B, then (A.byte_offset + A.size_bytes <= B.byte_offset)
   * MUST be true.
   * This MUST also be true if A and B are from block_metadata lists in
   * different GetMetadataAllocatedResponse messages in the gRPC stream.
   * This field is OPTIONAL.
   */
  'block_metadata'?: (_csi_v1_BlockMetadata)[];
}

/**
 * GetMetadataAllocatedResponse messages are returned in a gRPC stream.
 * Cumulatively, they provide information on the allocated data
 * ranges in the snapshot.
 */
export interface GetMetadataAllocatedResponse__Output {
  /**
   * This specifies the style used in the BlockMetadata sequence.
   * This value must be the same in all such messages returned by
   * the stream.
   * If block_metadata_type is FIXED_LENGTH, then the size_bytes field
   * of each message in the block_metadata list MUST be constant.
   * This field is REQUIRED.
   */
  'block_metadata_type': (_csi_v1_BlockMetadataType__Output);
  /**
   * This returns the capacity of the underlying volume in bytes.
   * This value must be the same in all such messages returned by
   * the stream.
   * This field is REQUIRED.
   */
  'volume_capacity_bytes': (string);
  /**
   * This is a list of data range tuples.
   * If the value of max_results in the GetMetadataAllocatedRequest
   * message is greater than zero, then the number of entries in this
   * list MUST be less than or equal to that value.
   * The SP MUST respect the value of starting_offset in the request.
   * The byte_offset fields of adjacent BlockMetadata messages
   * MUST be strictly increasing and messages MUST NOT overlap:
   * i.e. for any two BlockMetadata messages, A and B, if A is returned
   * before B, then (A.byte_offset + A.size_bytes <= B.byte_offset)
   * MUST be true.
   * This MUST also be true if A and B are from block_metadata lists in
   * different GetMetadataAllocatedResponse messages in the gRPC stream.
   * This field is OPTIONAL.
   */
  'block_metadata': (_csi_v1_BlockMetadata__Output)[];
}
