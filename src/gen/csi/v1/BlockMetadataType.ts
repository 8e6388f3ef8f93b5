// Original file: proto/csi.proto

export const BlockMetadataType = {
  UNKNOWN: 'UNKNOWN',
  /**
   * The FIXED_LENGTH value indicates that data ranges are
   * returned in fixed size blocks.
   */
  FIXED_LENGTH: 'FIXED_LENGTH',
  /**
   * The VARIABLE_LENGTH value indicates that data ranges
   * are returned in potentially variable sized extents.
   */
  VARIABLE_LENGTH: 'VARIABLE_LENGTH',
} as const;

export type BlockMetadataType =
  | 'UNKNOWN'
  | 0
  /**
   * The FIXED_LENGTH value indicates that data ranges are
   * returned in fixed size blocks.
   */
  | 'FIXED_LENGTH'
  | 1
  /**
   * The VARIABLE_LENGTH value indicates that data ranges
   * are returned in potentially variable sized extents.
   */
  | 'VARIABLE_LENGTH'
  | 2

export type BlockMetadataType__Output = typeof BlockMetadataType[keyof typeof BlockMetadataType]
