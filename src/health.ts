/** Whether this process can do its job: the pool is usable and the host tools it runs are installed. */
import { type Mode, servesController, servesNode } from './config.js';
import { findTool, isExecutable } from './exec/which.js';
import { orAfter } from './limit.js';
import type { Pool } from './pool/pool.js';

/**
 * Tools the controller runs: preallocation, sparse copies (under setpriv, so that they die with the
 * process), and a look at what a source image holds.
 */
export const CONTROLLER_TOOLS = ['fallocate', 'cp', 'setpriv', 'blkid', 'rm'] as const;
/** Tools the node plugin runs (mkfs under setpriv, so that it dies with the process). */
export const NODE_TOOLS = [
  'losetup',
  'setpriv',
  'mount',
  'umount',
  'blkid',
  'blockdev',
  'mkfs.ext4',
  'mkfs.xfs',
  'mkfs.btrfs',
  'e2fsck',
  'resize2fs',
  'xfs_growfs',
  'btrfs',
  'fsfreeze',
  'rm',
] as const;

export function toolsFor(mode: Mode): string[] {
  const tools = new Set<string>();
  if (servesController({ mode })) for (const t of CONTROLLER_TOOLS) tools.add(t);
  if (servesNode({ mode })) for (const t of NODE_TOOLS) tools.add(t);
  return [...tools];
}

/**
 * Where each tool was found last: looked at there again on every check (one access call), searched
 * for along the whole path only when it is gone from there, so a tool removed or replaced under a
 * running driver is noticed by the next check.
 */
const foundAt = new Map<string, string>();

async function missingTools(tools: readonly string[]): Promise<string[]> {
  const where = await Promise.all(
    tools.map(async (tool) => {
      const known = foundAt.get(tool);
      if (known !== undefined && (await isExecutable(known))) return known;
      const now = await findTool(tool);
      if (now === undefined) foundAt.delete(tool);
      else foundAt.set(tool, now);
      return now;
    }),
  );
  return tools.filter((_, i) => where[i] === undefined);
}

/** How long Probe may reuse an answer: a pool or a tool that goes away is reported within this time. */
export const PROBE_REUSE_MS = 1_000;
/** How long a readiness check may take before the answer is "not ready": a hung pool must not hang Probe. */
export const READINESS_TIMEOUT_MS = 2_000;

/** The pool this process serves, or why it has none yet. */
export type PoolState = Pool | { missing: string };

async function check(state: PoolState, tools: readonly string[]): Promise<string | undefined> {
  const [poolProblem, missing] = await Promise.all([
    'missing' in state ? Promise.resolve(state.missing) : state.checkUsable(),
    missingTools(tools),
  ]);
  const problems: string[] = [];
  if (poolProblem) problems.push(poolProblem);
  if (missing.length > 0) problems.push(`missing tools: ${missing.join(', ')}`);
  return problems.length > 0 ? `The driver is not ready: ${problems.join('; ')}.` : undefined;
}

/**
 * Whether this process can serve, shared among callers: one check runs at a time and callers that ask
 * meanwhile share its answer (a check stuck on a hung pool filesystem is not started again and again,
 * each holding one of libuv's few threads), and a caller waits at most `timeoutMs` for it.
 */
export class Readiness {
  private running: Promise<string | undefined> | undefined;
  private last: { at: number; problem: string | undefined } | undefined;

  private readonly tools: readonly string[];

  /** `tools`: the tools to look for, when not those of `mode` (tests). */
  constructor(
    private readonly pool: () => PoolState,
    mode: Mode,
    tools?: readonly string[],
  ) {
    this.tools = tools ?? toolsFor(mode);
  }

  /**
   * A sentence saying why this process is not ready, or undefined when it is. `maxAgeMs`: an answer
   * that old may be reused (Probe, polled by several sidecars, reuses one for PROBE_REUSE_MS; /healthz
   * never does).
   */
  async problem(timeoutMs = READINESS_TIMEOUT_MS, maxAgeMs = 0): Promise<string | undefined> {
    if (this.last && performance.now() - this.last.at <= maxAgeMs) return this.last.problem;
    const state = this.pool();
    this.running ??= check(state, this.tools).then(
      (problem) => {
        this.running = undefined;
        this.last = { at: performance.now(), problem };
        return problem;
      },
      (err: unknown) => {
        this.running = undefined;
        return `The driver is not ready: checking it failed (${err instanceof Error ? err.message : String(err)}).`;
      },
    );
    return orAfter(
      this.running,
      timeoutMs,
      () =>
        `The driver is not ready: the pool ${'root' in state ? state.root : ''} does not answer within ${(timeoutMs / 1000).toFixed(1)} s (is its filesystem hung, or its server gone?).`,
    );
  }

  /** Whether a fresh look at the pool and tools ends within `ms` (false: it, or one before, is blocked). */
  async answers(ms: number): Promise<boolean> {
    void this.problem(ms).catch(() => undefined);
    const running = this.running;
    if (!running) return true;
    return orAfter(
      running.then(() => true),
      ms,
      () => false,
    );
  }
}

/** A one-off readiness check (tests, tools). */
export function readinessProblem(pool: Pool, mode: Mode): Promise<string | undefined> {
  return new Readiness(() => pool, mode).problem();
}
