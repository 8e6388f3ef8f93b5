/** Whether this process can do its job: the pool is usable and the host tools it runs are installed. */
import { type Mode, servesController, servesNode } from './config.js';
import { missingTools } from './exec/which.js';
import type { Pool } from './pool/pool.js';

/** Tools the controller runs: preallocation, sparse copies (and fsfreeze, when it shares a host with mounts). */
export const CONTROLLER_TOOLS = ['fallocate', 'cp', 'fsfreeze'] as const;
/** Tools the node plugin runs. */
export const NODE_TOOLS = [
  'losetup',
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
] as const;

export function toolsFor(mode: Mode): string[] {
  const tools = new Set<string>();
  if (servesController({ mode })) for (const t of CONTROLLER_TOOLS) tools.add(t);
  if (servesNode({ mode })) for (const t of NODE_TOOLS) tools.add(t);
  return [...tools];
}

/** Tools found once stay found (a package is not uninstalled under a running driver); missing ones are looked for again. */
const found = new Set<string>();

/** A sentence saying why this process is not ready, or undefined when it is. */
export async function readinessProblem(pool: Pool, mode: Mode): Promise<string | undefined> {
  const unchecked = toolsFor(mode).filter((t) => !found.has(t));
  const [poolProblem, missing] = await Promise.all([pool.checkUsable(), missingTools(unchecked)]);
  for (const t of unchecked) if (!missing.includes(t)) found.add(t);
  const problems: string[] = [];
  if (poolProblem) problems.push(poolProblem);
  if (missing.length > 0) problems.push(`missing tools: ${missing.join(', ')}`);
  return problems.length > 0 ? `The driver is not ready: ${problems.join('; ')}.` : undefined;
}
