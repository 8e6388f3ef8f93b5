import { constants } from 'node:fs';
import { access } from 'node:fs/promises';
import path from 'node:path';

/** The directories searched for tools: $PATH plus the sbin directories a minimal PATH may lack. */
export function searchPath(): string[] {
  const dirs = (process.env.PATH ?? '').split(path.delimiter).filter(Boolean);
  for (const extra of ['/usr/local/sbin', '/usr/sbin', '/sbin', '/usr/bin', '/bin']) {
    if (!dirs.includes(extra)) dirs.push(extra);
  }
  return dirs;
}

/** True when `tool` is an executable file somewhere on the search path. Spawns nothing. */
export async function isOnPath(tool: string): Promise<boolean> {
  for (const dir of searchPath()) {
    try {
      await access(path.join(dir, tool), constants.X_OK);
      return true;
    } catch {
      // try the next directory
    }
  }
  return false;
}

/** The tools of `tools` that cannot be found. */
export async function missingTools(tools: readonly string[]): Promise<string[]> {
  const found = await Promise.all(tools.map((t) => isOnPath(t)));
  return tools.filter((_, i) => !found[i]);
}
