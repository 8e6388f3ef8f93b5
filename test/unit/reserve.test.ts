/**
 * The pool's space reserve (pool/reserve.ts) on a real directory: written, given back, written again;
 * never through a link planted at its name (a shared pool is writable by others), never into a pool
 * that is not there.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pino from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { RESERVE_BYTES, SpaceReserve } from '../../src/pool/reserve.js';

const log = pino({ level: 'silent' });
const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await fs.rm(d, { recursive: true, force: true });
});
async function pool(): Promise<string> {
  const d = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-reserve-'));
  dirs.push(d);
  return d;
}
const here = (): Promise<void> => Promise.resolve();
const allocated = async (f: string): Promise<number> => (await fs.stat(f)).blocks * 512;

describe('the space reserve', () => {
  it('is written, given back once, and written again', async () => {
    const root = await pool();
    const r = new SpaceReserve(root, log, here);
    await r.refill();
    const file = path.join(root, 'reserve');
    expect(await allocated(file)).toBeGreaterThanOrEqual(RESERVE_BYTES);
    expect((await fs.stat(file)).size).toBe(RESERVE_BYTES);
    expect(await r.giveBack()).toBe(true);
    expect(await allocated(file)).toBe(0);
    expect(await r.giveBack()).toBe(false);
    await r.refill();
    expect(await allocated(file)).toBeGreaterThanOrEqual(RESERVE_BYTES);
  });

  it('is given back whole to a call that needs it while it is being taken back, and taken back whole after', async () => {
    const root = await pool();
    const file = path.join(root, 'reserve');
    // The other call comes at some point of the take-back: at its start, after a few chunks, near its end.
    for (const ms of [0, 1, 2, 4, 8]) {
      const r = new SpaceReserve(root, log, here);
      await r.refill();
      expect(await r.giveBack()).toBe(true); // lent to a call that has ended…
      const taking = r.refill(); // …so it is being taken back, when another call needs it
      await new Promise((res) => setTimeout(res, ms));
      const during = r.lending(async () => {
        await r.giveBack();
        return allocated(file);
      });
      await taking;
      expect(await during).toBe(0);
      await r.refillIfShort();
      expect({
        ms,
        size: (await fs.stat(file)).size,
        whole: (await allocated(file)) >= RESERVE_BYTES,
      }).toEqual({ ms, size: RESERVE_BYTES, whole: true });
      await r.giveBack();
    }
  });

  it.each(['symlink', 'hard link'] as const)(
    'leaves a file a %s at its name leads to as it was',
    async (kind) => {
      const root = await pool();
      const precious = path.join(root, 'precious');
      await fs.writeFile(precious, 'data that must survive\n');
      const file = path.join(root, 'reserve');
      if (kind === 'symlink') await fs.symlink(precious, file);
      else await fs.link(precious, file);
      const r = new SpaceReserve(root, log, here);
      await r.refill();
      expect(await r.giveBack()).toBe(false);
      expect(await fs.readFile(precious, 'utf8')).toBe('data that must survive\n');
    },
  );

  it('is not written where the pool is not (a shared filesystem unmounted)', async () => {
    const root = await pool();
    const r = new SpaceReserve(root, log, () => Promise.reject(new Error('the pool is gone')));
    await r.refill();
    await expect(fs.stat(path.join(root, 'reserve'))).rejects.toThrow(/ENOENT/);
  });
});
