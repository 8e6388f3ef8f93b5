/**
 * One look at everything (`loopvol check`, and what the server reports at start): the pool, and what
 * this host has of it. Reading only, with one exception the operator asks for (--probe-frozen).
 */
import type { Logger } from 'pino';
import type { Exec } from '../exec/runner.js';
import type { Host } from '../host/host.js';
import type { Pool } from '../pool/pool.js';
import { type Finding, isProblem } from './findings.js';
import { type HostCheck, hostFindings, type HostCheckOptions } from './host-check.js';
import { type Inventory, readInventory, readNodes, readVolumes, storesFor } from './inventory.js';
import { poolFindings, type PoolCheckOptions } from './pool-check.js';

export type CheckScope = 'all' | 'pool' | 'host';

export interface CheckOptions extends PoolCheckOptions, HostCheckOptions {
  scope: CheckScope;
  /** A node whose heartbeat is older than this (or missing) is stale. */
  staleSeconds: number;
}

export const DEFAULT_STALE_SECONDS = 60;

export interface CheckReport {
  findings: Finding[];
  notes: string[];
  inventory: Inventory;
  host: HostCheck | undefined;
}

export async function runCheck(
  pool: Pool,
  log: Logger,
  host: Host,
  x: Exec,
  opts: CheckOptions,
): Promise<CheckReport> {
  const inventory = await readInventory(pool, log, { staleSeconds: opts.staleSeconds });
  const findings: Finding[] = [];
  const notes: string[] = [];
  if (opts.scope !== 'host') findings.push(...poolFindings(inventory, opts));
  let hostCheck: HostCheck | undefined;
  if (opts.scope !== 'pool') {
    hostCheck = await hostFindings(pool, inventory, host, x, opts);
    findings.push(...hostCheck.findings);
    notes.push(...hostCheck.notes);
  }
  return { findings, notes, inventory, host: hostCheck };
}

/** This host looked at again, with the leases and nodes read afresh (gc does it under the locks). */
export async function recheckHost(
  pool: Pool,
  log: Logger,
  host: Host,
  x: Exec,
  opts: CheckOptions,
): Promise<HostCheck> {
  const volumes = await readVolumes(pool, storesFor(pool, log).volumes);
  const mentioned = volumes.flatMap((v) => [...v.leases, ...v.attachments].map((r) => r.node));
  const nodes = await readNodes(pool, { staleSeconds: opts.staleSeconds }, mentioned);
  return hostFindings(pool, { volumes, nodes }, host, x, opts);
}

export const problems = (findings: readonly Finding[]): Finding[] => findings.filter(isProblem);
