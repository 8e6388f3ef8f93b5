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

/** True when `file` exists and may be executed. */
export async function isExecutable(file: string): Promise<boolean> {
  try {
    await access(file, constants.X_OK);
    return true;
  } catch {
    return false;
  }
}

/** Where `tool` is on the search path (the first executable of that name), or undefined. Spawns nothing. */
export async function findTool(tool: string): Promise<string | undefined> {
  for (const dir of searchPath()) {
    const file = path.join(dir, tool);
    if (await isExecutable(file)) return file;
  }
  return undefined;
}
