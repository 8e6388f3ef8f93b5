/**
 * What the lower layers (pool/, node/) observe for the metrics, without knowing who counts it: lock
 * waits, freezes, image copies. The driver installs a sink (src/metrics.ts) when it serves metrics;
 * until then, and in the operator commands, observations go nowhere. This file imports nothing, so
 * every layer may report through it.
 */

/** Why an image was copied: a snapshot, a clone of a volume, or a restore of a snapshot. */
export type CopyPurpose = 'snapshot' | 'clone' | 'restore';

export interface Telemetry {
  /** A pool lock was waited for `seconds`, and then taken (`acquired`) or given up on (ABORTED). */
  lockWaited(seconds: number, acquired: boolean): void;
  /** A filesystem was frozen: for the instant of a copy, or for good (a fence). */
  froze(reason: 'copy' | 'fence'): void;
  /** A filesystem frozen for a copy was thawed after `seconds`. */
  thawed(seconds: number): void;
  /** An image copy ended: `bytes` read and written (0 for a reflink), in `seconds`. */
  copied(purpose: CopyPurpose, method: string, bytes: number, seconds: number): void;
}

const nowhere: Telemetry = {
  lockWaited: () => undefined,
  froze: () => undefined,
  thawed: () => undefined,
  copied: () => undefined,
};

let sink: Telemetry = nowhere;

/** Installs the process's sink (undefined: observations go nowhere again). */
export function setTelemetry(t: Telemetry | undefined): void {
  sink = t ?? nowhere;
}

/** Where the layers report; it forwards to whatever sink is installed at the time. */
export const telemetry: Telemetry = {
  lockWaited: (seconds, acquired) => {
    sink.lockWaited(seconds, acquired);
  },
  froze: (reason) => {
    sink.froze(reason);
  },
  thawed: (seconds) => {
    sink.thawed(seconds);
  },
  copied: (purpose, method, bytes, seconds) => {
    sink.copied(purpose, method, bytes, seconds);
  },
};
