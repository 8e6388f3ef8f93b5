// Original file: proto/csi.proto

import type { Long } from '@grpc/proto-loader';

/**
 * The GetMetadataAllocatedRequest message is used to solicit metadata
 * on the allocated blocks of a snapshot: i.e. this identifies the
 * data ranges that have valid data as they were the target of some
 * previous write operation on the volume.
 */
export interface GetMetadataAllocatedRequest {
  /**
   * This is the identifier of the snapshot.
   * This field is REQUIRED.
   */
  'snapshot_id'?: (string);
  /**
   * This indicates the zero based starting byte position in the volume
   * snapshot from which the result should be computed.
   * It is intended to be used to continue a previously interrupted
   * call.
   * The CO SHOULD specify this value to be the offset of the byte
   * position immediately after the last byte of the last data range
   * received, if continuing an interrupted operation, or zero if not.
   * The SP MUST ensure that the returned response stream does not
   * contain BlockMetadata tuples that end before the requested
   * starting_offset: i.e. if S is the requested starting_offset, and
   * B0 is block_metadata[0] of the first message in the response
   * stream, then (S < B0.byte_offset + B0.size_bytes) must be true.
   * This field is REQUIRED.
   */
  'starting_offset'?: (number | string | Long);
  /**
   * This is an optional parameter, and if non-zero it specifies the
   * maximum number of tuples to be returned in each
   * GetMetadataAllocatedResponse message returned by the RPC stream.
   * The plugin will determine an appropriate value if 0, and is
   * always free to send less than the requested value.
   * This field is OPTIONAL.
   */
  'max_results'?: (number);
  /**
   * Secrets required by plugin to complete the request.
   * This field is OPTIONAL. Refer to the `Secrets Requirements`
   * section on how to use this field.
   */
  'secrets'?: ({[key: string]: string});
}

/**
 * The GetMetadataAllocatedRequest message is used to solicit metadata
 * on the allocated blocks of a snapshot: i.e. this identifies the
 * data ranges that have valid data as they were the target of some
 * previous write operation on the volume.
 */
export interface GetMetadataAllocatedRequest__Output {
  /**
   * This is the identifier of the snapshot.
   * This field is REQUIRED.
   */
  'snapshot_id': (string);
  /**
   * This indicates the zero based starting byte position in the volume
   * snapshot from which the result should be computed.
   * It is intended to be used to continue a previously interrupted
   * call.
   * The CO SHOULD specify this value to be the offset of the byte
   * position immediately after the last byte of the last data range
   * received, if continuing an interrupted operation, or zero if not.
   * The SP MUST ensure that the returned response stream does not
   * contain BlockMetadata tuples that end before the requested
   * starting_offset: i.e. if S is the requested starting_offset, and
   * B0 is block_metadata[0] of the first message in the response
   * stream, then (S < B0.byte_offset + B0.size_bytes) must be true.
   * This field is REQUIRED.
   */
  'starting_offset': (string);
  /**
   * This is an optional parameter, and if non-zero it specifies the
   * maximum number of tuples to be returned in each
   * GetMetadataAllocatedResponse message returned by the RPC stream.
   * The plugin will determine an appropriate value if 0, and is
   * always free to send less than the requested value.
   * This field is OPTIONAL.
   */
  'max_results': (number);
  /**
   * Secrets required by plugin to complete the request.
   * This field is OPTIONAL. Refer to the `Secrets Requirements`
   * section on how to use this field.
   */
  'secrets': ({[key: string]: string});
}
