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
/** Whether `name` is one tmpName gives (a record's temporary file). */
export const isTempName = (name: string): boolean => /^\..+\.tmp-[0-9a-f]{12}$/.test(name);

/*
 * Every await of a file operation is a trip through libuv's thread pool and back, about 0.1-0.15 ms of
 * waking threads on a small virtual machine whatever the operation: independent ones run side by side.
 * A file's handle is closed before anything goes on: on NFS, renaming over or removing a file this client
 * still has open hides it from other clients for a moment (a "silly rename"), and some FUSE filesystems
 * store what was written only at close. A directory's handle, synced, is closed without waiting.
 */

/**
 * Awaits `ps` side by side, every one to its end; then throws the first failure in their order (what
 * awaiting them one after the other would have thrown), or gives their values.
 */
export async function sideBySide<T extends readonly unknown[]>(
  ...ps: { [K in keyof T]: Promise<T[K]> }
): Promise<T> {
  const settled = await Promise.allSettled(ps);
  for (const s of settled) if (s.status === 'rejected') throw s.reason;
  return settled.map((s) => (s as PromiseFulfilledResult<unknown>).value) as unknown as T;
}

export async function fsyncDir(dir: string): Promise<void> {
  const handle = await fs.open(dir, constants.O_RDONLY | constants.O_DIRECTORY);
  try {
    await handle.sync();
  } finally {
    handle.close().catch(() => undefined);
  }
}

async function writeTemp(file: string, data: string, sync: boolean): Promise<string> {
  const tmp = tmpName(file);
  const handle = await fs.open(tmp, 'wx', 0o644);
  let closing = false;
  try {
    await handle.writeFile(data);
    if (sync) await handle.sync();
    closing = true;
    await handle.close(); // NFS reports a write it could not store here
  } catch (err) {
    if (!closing) await handle.close().catch(() => undefined);
    await fs.rm(tmp, { force: true });
    throw err;
  }
  return tmp;
}

/** How much of a file the first read takes (every record is far smaller). */
const READ_AHEAD = 16 * 1024;

/**
 * A pool file's text, as fs.readFile reads it (its size, then that many bytes), in three waits instead
 * of four: the size and the first bytes are asked for side by side.
 */
export async function readText(file: string): Promise<string> {
  const h = await fs.open(file, 'r');
  try {
    const first = Buffer.allocUnsafe(READ_AHEAD);
    const [st, { bytesRead }] = await Promise.all([h.stat(), h.read(first, 0, READ_AHEAD, 0)]);
    if (bytesRead === st.size) return first.toString('utf8', 0, bytesRead);
    // Larger than the first read (or its size said otherwise): the rest, to its end.
    const chunks = [first.subarray(0, bytesRead)];
    for (let at = bytesRead; ;) {
      const next = Buffer.allocUnsafe(READ_AHEAD);
      const n = (await h.read(next, 0, READ_AHEAD, at)).bytesRead;
      if (n === 0) return Buffer.concat(chunks).toString('utf8');
      chunks.push(next.subarray(0, n));
      at += n;
    }
  } finally {
    await h.close();
  }
}

/**
 * Replaces `file` with `data` atomically (temp file, rename) and, unless `durable` is false, durably
 * (fsync of the file before the rename and of the directory after it). A non-durable write is for
 * states a crash may lose without harm.
 */
export function writeFileAtomic(file: string, data: string, durable = true): Promise<void> {
  return writeFilesAtomic([{ file, data }], durable);
}

/** A file to write, and what it holds. */
export interface NewFile {
  file: string;
  data: string;
}

/**
 * Replaces several files atomically, and unless `durable` is false durably, making them appear in the
 * order given: the temp files are written (and synced) side by side, the slow part, then renamed one
 * after the other, then their directories synced one after the other. A crash leaves each file old or
 * new, and (durably written) a later file new only if every earlier one is. What `beforeRename`
 * throws stops the write before the next rename (a lock checked again after the slow part).
 */
export async function writeFilesAtomic(
  files: readonly NewFile[],
  durable = true,
  beforeRename: () => void = () => undefined,
): Promise<void> {
  const written = await Promise.allSettled(files.map((f) => writeTemp(f.file, f.data, durable)));
  const temps = written.flatMap((w) => (w.status === 'fulfilled' ? [w.value] : []));
  const failed = written.find((w): w is PromiseRejectedResult => w.status === 'rejected');
  let renamed = 0;
  try {
    if (failed) throw failed.reason;
    for (const [i, f] of files.entries()) {
      beforeRename(); // a throw here leaves this file and every later one as they were
      await fs.rename(temps[i] as string, f.file);
      renamed = i + 1;
    }
  } catch (err) {
    await Promise.all(temps.slice(renamed).map((t) => fs.rm(t, { force: true })));
    throw err;
  }
  if (!durable) return;
  // In order too: a filesystem that logs each directory's sync on its own (btrfs) keeps a later rename
  // only once the earlier ones are kept.
  for (const dir of new Set(files.map((f) => path.dirname(f.file)))) await fsyncDir(dir);
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
    await removeFile(tmp); // one unlink (fs.rm would stat it twice first)
  }
  if (durable) await fsyncDir(path.dirname(file));
  return true;
}

/** Reads and parses a JSON file; undefined when it does not exist. */
export async function readJson(file: string): Promise<unknown> {
  let text: string;
  try {
    text = await readText(file);
  } catch (err) {
    if (errnoCode(err) === 'ENOENT' || errnoCode(err) === 'ENOTDIR') return undefined;
    throw err;
  }
  return JSON.parse(text) as unknown;
}

/** A record read from the pool: absent, present and sound, or present but unreadable. */
export type RecordRead<T> =
  { state: 'absent' } | { state: 'ok'; value: T } | { state: 'damaged'; reason: string };

/**
 * Pauses before reading a record again that did not parse. Every record is written whole (temp file,
 * rename), so one that reads torn is a network filesystem client's cache: it read the new file with
 * the old one's size, until its attribute cache expires (FUSE: 1 s by default). Only a record that
 * stays unreadable across these is damaged.
 */
const REREAD_PAUSES_MS = [25, 100, 400, 1_000];

/**
 * Reads a JSON record and checks it with `parse`. A record that exists but is not valid JSON or not of
 * its shape, read after read, is "damaged": never the same as absent, because absent lets a retry
 * start over (and discard what is there), and a damaged record may stand for data.
 */
export async function readRecord<T>(
  file: string,
  parse: (v: unknown) => T | undefined,
): Promise<RecordRead<T>> {
  for (let attempt = 0; ; attempt++) {
    let text: string;
    try {
      text = await readText(file);
    } catch (err) {
      if (errnoCode(err) === 'ENOENT' || errnoCode(err) === 'ENOTDIR') return { state: 'absent' };
      throw err;
    }
    let reason: string;
    try {
      const value = parse(JSON.parse(text) as unknown);
      if (value !== undefined) return { state: 'ok', value };
      reason = `${path.basename(file)} does not have the expected fields`;
    } catch {
      reason = `${path.basename(file)} is not valid JSON`;
    }
    const pause = REREAD_PAUSES_MS[attempt];
    if (pause === undefined) return { state: 'damaged', reason };
    await new Promise((r) => setTimeout(r, pause));
  }
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
