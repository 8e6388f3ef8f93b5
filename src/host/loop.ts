/**
 * Loop devices, read from /sys/block (the kernel's truth, so a restarted plugin finds what its
 * predecessor attached) and changed with losetup, which creates a new device through
 * /dev/loop-control when none is free.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { errnoCode } from '../errors.js';
import { CommandError } from '../exec/runner.js';
import type { CallContext } from '../server/call.js';

export interface LoopDevice {
  name: string;
  path: string;
  majorMinor: string;
  backingFile: string;
  readOnly: boolean;
  directIo: boolean;
  sizeBytes: number;
}

const SYS_BLOCK = '/sys/block';
const DELETED_SUFFIX = ' (deleted)';

async function readSys(file: string): Promise<string | undefined> {
  try {
    return (await fs.readFile(file, 'utf8')).trim();
  } catch (err) {
    const code = errnoCode(err);
    if (code === 'ENOENT' || code === 'ENXIO' || code === 'ENODEV') return undefined;
    throw err;
  }
}

export async function readLoop(name: string): Promise<LoopDevice | undefined> {
  const base = path.join(SYS_BLOCK, name);
  const backingFile = await readSys(path.join(base, 'loop', 'backing_file'));
  if (backingFile === undefined) return undefined; // not attached
  const [ro, dio, size, dev] = await Promise.all([
    readSys(path.join(base, 'ro')),
    readSys(path.join(base, 'loop', 'dio')),
    readSys(path.join(base, 'size')),
    readSys(path.join(base, 'dev')),
  ]);
  return {
    name,
    path: `/dev/${name}`,
    majorMinor: dev ?? '',
    backingFile,
    readOnly: ro === '1',
    directIo: dio === '1',
    sizeBytes: Number(size ?? '0') * 512,
  };
}

/** Every attached loop device. */
export async function listLoops(): Promise<LoopDevice[]> {
  const names = (await fs.readdir(SYS_BLOCK)).filter((n) => /^loop\d+$/.test(n));
  const loops = await Promise.all(names.map((n) => readLoop(n)));
  return loops.filter((l): l is LoopDevice => l !== undefined);
}

/** The loop devices backed by `image` itself (not by a deleted file that once had its name). */
export async function loopsFor(image: string): Promise<LoopDevice[]> {
  return (await listLoops()).filter((l) => l.backingFile === image);
}

export const isDeletedBacking = (l: LoopDevice): boolean => l.backingFile.endsWith(DELETED_SUFFIX);

export interface AttachOptions {
  readOnly: boolean;
  directIo: boolean;
}

/** Attaches `image` to a free (or newly created) loop device. */
export async function attachLoop(ctx: CallContext, image: string, opts: AttachOptions): Promise<LoopDevice> {
  // No --nooverlap: it would hand back an existing read-write device when a read-only one is asked for.
  // Reuse is decided by the caller from /sys/block.
  const args = ['--find', '--show'];
  if (opts.readOnly) args.push('--read-only');
  if (opts.directIo) args.push('--direct-io=on');
  args.push(image);
  let lastErr: unknown;
  for (let attempt = 0; attempt < 4; attempt++) {
    try {
      const { stdout } = await ctx.run('losetup', args, { timeoutMs: 30_000 });
      const dev = stdout.trim();
      const loop = await readLoop(path.basename(dev));
      if (!loop) throw new Error(`losetup reported ${dev} but it is not attached`);
      return loop;
    } catch (err) {
      lastErr = err;
      // Two attaches racing for the same free device: one gets EBUSY; try again.
      if (!(err instanceof CommandError && /busy/i.test(err.stderr))) throw err;
    }
  }
  throw lastErr;
}

/** Detaches a loop device and waits until the kernel has let go of it. */
export async function detachLoop(ctx: CallContext, loop: LoopDevice): Promise<void> {
  try {
    await ctx.run('losetup', ['--detach', loop.path], { timeoutMs: 30_000 });
  } catch (err) {
    if (!(await readLoop(loop.name))) return; // already gone
    throw err;
  }
  // LOOP_CLR_FD is asynchronous while the device is open somewhere; give it a moment.
  for (let i = 0; i < 50; i++) {
    const still = await readLoop(loop.name);
    if (!still || still.backingFile !== loop.backingFile) return;
    await new Promise((r) => setTimeout(r, 20));
  }
}

/** Makes the loop device see the image's current size (after the image grew). */
export async function refreshLoopSize(ctx: CallContext, loop: LoopDevice): Promise<LoopDevice> {
  await ctx.run('losetup', ['--set-capacity', loop.path], { timeoutMs: 30_000 });
  return (await readLoop(loop.name)) ?? loop;
}
