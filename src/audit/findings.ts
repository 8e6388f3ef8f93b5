/**
 * What `loopvol check` reports (and the server logs at start): each thing that is not as it should be,
 * what it is, and what to do. A finding that `loopvol gc` may remove carries the step that removes it;
 * everything else needs an operator, because removing it could lose data or break a fence.
 */

/** What kind of thing is wrong. The names are the `kind` label of loopvol_check_findings. */
export type FindingKind =
  // The pool
  | 'image-without-record'
  | 'record-without-image'
  | 'damaged-record'
  | 'damaged-fences'
  | 'damaged-node-record'
  | 'unfinished-creation'
  | 'image-larger-than-record'
  | 'quarantined-record'
  | 'stale-lease'
  | 'stale-revoked-lease'
  | 'stale-attachment'
  | 'abandoned-lock'
  | 'stale-lock'
  | 'old-trash'
  // This host
  | 'leaked-loop-device'
  | 'leaked-mount'
  | 'mount-outside-kubelet'
  | 'frozen-filesystem'
  | 'fenced-filesystem'
  | 'frozen-for-copy';

/**
 * A problem makes `check` exit 1; a notice is reported but is as it should be (a filesystem fenced on
 * purpose, a freeze for a snapshot that is being copied right now).
 */
export type Severity = 'problem' | 'notice';

/** What `loopvol gc` does about a finding it may remove. */
export type GcStep =
  | { action: 'detach'; device: string; volumeId: string | undefined }
  | { action: 'unmount'; mountPoint: string; device: string; volumeId: string | undefined }
  | { action: 'remove-lock'; key: string }
  | { action: 'remove-trash'; entry: string };

export interface Finding {
  kind: FindingKind;
  severity: Severity;
  scope: 'pool' | 'host';
  /** What it is about: a path, a device, a lock key. */
  subject: string;
  volumeId?: string;
  node?: string;
  /** What is wrong, one sentence. */
  detail: string;
  /** What to do, one or two sentences. */
  action: string;
  /** Present when `gc` removes it. */
  gc?: GcStep;
  /** Why `gc` leaves it, when it is the kind gc removes but this one is not safe to remove. */
  gcSkipped?: string;
}

export const isProblem = (f: Finding): boolean => f.severity === 'problem';

/** Counts by kind (the metric and the summary line). */
export function countByKind(findings: readonly Finding[]): Map<FindingKind, number> {
  const out = new Map<FindingKind, number>();
  for (const f of findings) out.set(f.kind, (out.get(f.kind) ?? 0) + 1);
  return out;
}

/** One line per finding, for logs. */
export function summarize(f: Finding): string {
  return `${f.kind} ${f.subject}: ${f.detail}`;
}
