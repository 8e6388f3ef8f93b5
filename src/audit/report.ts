/**
 * What the server says at start (and every few minutes after) about what `loopvol check` would find:
 * the controller for the pool, the node plugin for this host. It logs the list and hands it to the
 * metrics; it never removes anything (that is the operator's `loopvol gc`).
 */
import type { Logger } from 'pino';
import { bindExec, type Runner } from '../exec/runner.js';
import type { Host } from '../host/host.js';
import { repeat, type Repeating } from '../limit.js';
import type { Pool } from '../pool/pool.js';
import { DEFAULT_STALE_SECONDS, runCheck } from './check.js';
import { type Finding, isProblem, summarize } from './findings.js';
import { DEFAULT_LOCK_STALE_SECONDS, DEFAULT_TRASH_AGE_SECONDS } from './pool-check.js';

/** How often the check runs again after the start. */
export const REPORT_EVERY_MS = 10 * 60_000;

export interface ReportOptions {
  pool: Pool;
  log: Logger;
  runner: Runner;
  host: Host;
  /** What this process looks at: the pool (a controller), this host (a node plugin), or both. */
  scopes: readonly ('pool' | 'host')[];
  kubeletDir: string;
  nodeFenceSeconds: number;
  publish: (scope: 'pool' | 'host', findings: readonly Finding[]) => void;
  everyMs?: number;
}

/** The reports; `first` settles after the first look (tests wait for it). */
export type Reporter = Repeating;

const WHERE = { pool: 'the pool', host: 'this host' } as const;

export function startReports(o: ReportOptions): Reporter {
  const x = bindExec(o.runner, { log: o.log, deadline: Number.POSITIVE_INFINITY });
  const last = new Map<string, string>();

  const look = async (atStart: boolean): Promise<void> => {
    const scope = o.scopes.length === 2 ? 'all' : (o.scopes[0] ?? 'all');
    const report = await runCheck(o.pool, o.log, o.host, x, {
      scope,
      kubeletDir: o.kubeletDir,
      probeFrozen: false,
      staleSeconds: Math.max(DEFAULT_STALE_SECONDS, o.nodeFenceSeconds),
      trashAgeSeconds: DEFAULT_TRASH_AGE_SECONDS,
      lockStaleSeconds: DEFAULT_LOCK_STALE_SECONDS,
    });
    for (const s of o.scopes) {
      const found = report.findings.filter((f) => f.scope === s);
      o.publish(s, found);
      const lines = found.map(summarize);
      const key = lines.join('\n');
      if (!atStart && last.get(s) === key) continue; // said already
      last.set(s, key);
      const problems = found.filter(isProblem);
      const notices = found.length - problems.length;
      const fields = { check: s, problems: problems.length, notices, findings: lines };
      const what = `${problems.length} problem(s)${notices ? ` and ${notices} notice(s)` : ''} in ${WHERE[s]}`;
      if (problems.length > 0) {
        o.log.warn(fields, `loopvol check: ${what}; nothing was removed (run loopvol check for what to do)`);
      } else {
        o.log.info(fields, `loopvol check: ${notices ? what : `${WHERE[s]} is clean`}`);
      }
    }
  };
  const safely = (atStart: boolean): Promise<void> =>
    look(atStart).catch((err: unknown) => {
      o.log.warn({ err }, 'loopvol check could not look at the pool or the host; trying again later');
    });
  return repeat(o.everyMs ?? REPORT_EVERY_MS, safely);
}
