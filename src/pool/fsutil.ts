/**
 * File primitives for state that must survive a crash: a file is either its old content or its new
 * content, never a torn mix, and a rename is made durable by syncing its directory.
 */
import { randomBytes } from 'node:crypto';
import { constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { errnoCode } from '../errors.js';

const tmpName = (file: string): string =>
  path.join(path.dirname(file), `.${path.basename(file)}.tmp-${randomBytes(6).toString('hex')}`);

export async function fsyncDir(dir: string): Promise<void> {
  const handle = await fs.open(dir, constants.O_RDONLY | constants.O_DIRECTORY);
  try {
    await handle.sync();
  } finally {
    await handle.close();
  }
}

async function writeTemp(file: string, data: string, sync: boolean): Promise<string> {
  const tmp = tmpName(file);
  const handle = await fs.open(tmp, 'wx', 0o644);
  try {
    await handle.writeFile(data);
    if (sync) await handle.sync();
  } catch (err) {
    await handle.close().catch(() => undefined);
    await fs.rm(tmp, { force: true });
    throw err;
  }
  await handle.close();
  return tmp;
}

/**
 * Replaces `file` with `data` atomically (temp file, rename) and, unless `durable` is false, durably
 * (fsync of the file before the rename and of the directory after it). A non-durable write is for
 * states a crash may lose without harm.
 */
export async function writeFileAtomic(file: string, data: string, durable = true): Promise<void> {
  const tmp = await writeTemp(file, data, durable);
  try {
    await fs.rename(tmp, file);
  } catch (err) {
    await fs.rm(tmp, { force: true });
    throw err;
  }
  if (durable) await fsyncDir(path.dirname(file));
}

/**
 * Creates `file` with `data` only if it does not exist yet, atomically: the content is complete
 * before the name appears (link(2) fails with EEXIST instead of replacing). Returns false when the
 * file already existed. `durable` syncs the data and the directory.
 */
export async function createExclusive(file: string, data: string, durable = true): Promise<boolean> {
  const tmp = await writeTemp(file, data, durable);
  try {
    await fs.link(tmp, file);
  } catch (err) {
    if (errnoCode(err) === 'EEXIST') return false;
    throw err;
  } finally {
    await fs.rm(tmp, { force: true });
  }
  if (durable) await fsyncDir(path.dirname(file));
  return true;
}

/** Reads and parses a JSON file; undefined when it does not exist. */
export async function readJson(file: string): Promise<unknown> {
  let text: string;
  try {
    text = await fs.readFile(file, 'utf8');
  } catch (err) {
    if (errnoCode(err) === 'ENOENT' || errnoCode(err) === 'ENOTDIR') return undefined;
    throw err;
  }
  return JSON.parse(text) as unknown;
}

/**
 * Reads a JSON record and checks it with `parse`. Absent: undefined. Present but unreadable or not of
 * its shape: undefined too, with an error in the log — a damaged record never becomes a volume.
 */
export async function readRecord<T>(
  file: string,
  parse: (v: unknown) => T | undefined,
  log: { error(obj: object, msg: string): void },
): Promise<T | undefined> {
  let raw: unknown;
  try {
    raw = await readJson(file);
  } catch (err) {
    log.error({ file, err }, 'a pool record is not valid JSON; treating it as absent');
    return undefined;
  }
  if (raw === undefined) return undefined;
  const value = parse(raw);
  if (value === undefined)
    log.error({ file }, 'a pool record does not have the expected shape; treating it as absent');
  return value;
}

/** Lists a directory; an absent directory is empty. */
export async function listDir(dir: string): Promise<string[]> {
  try {
    return await fs.readdir(dir);
  } catch (err) {
    if (errnoCode(err) === 'ENOENT' || errnoCode(err) === 'ENOTDIR') return [];
    throw err;
  }
}

export async function exists(p: string): Promise<boolean> {
  try {
    await fs.lstat(p);
    return true;
  } catch (err) {
    if (errnoCode(err) === 'ENOENT' || errnoCode(err) === 'ENOTDIR') return false;
    throw err;
  }
}

/** Removes a file; true if it was there. */
export async function removeFile(p: string): Promise<boolean> {
  try {
    await fs.unlink(p);
    return true;
  } catch (err) {
    if (errnoCode(err) === 'ENOENT') return false;
    throw err;
  }
}

export const isRecord = (v: unknown): v is Record<string, unknown> =>
  typeof v === 'object' && v !== null && !Array.isArray(v);

export const isStringRecord = (v: unknown): v is Record<string, string> =>
  isRecord(v) && Object.values(v).every((x) => typeof x === 'string');
