// Original file: proto/csi.proto

import type { Long } from '@grpc/proto-loader';

/**
 * BlockMetadata specifies a data range.
 */
export interface BlockMetadata {
  /**
   * This is the zero based byte position in the volume or snapshot,
   * measured from the start of the object.
   * This field is REQUIRED.
   */
  'byte_offset'?: (number | string | Long);
  /**
   * This is the size of the data range.
   * size_bytes MUST be greater than zero.
   * This field is REQUIRED.
   */
  'size_bytes'?: (number | string | Long);
}

/**
 * BlockMetadata specifies a data range.
 */
export interface BlockMetadata__Output {
  /**
   * This is the zero based byte position in the volume or snapshot,
   * measured from the start of the object.
   * This field is REQUIRED.
   */
  'byte_offset': (string);
  /**
   * This is the size of the data range.
   * size_bytes MUST be greater than zero.
   * This field is REQUIRED.
   */
  'size_bytes': (string);
}
