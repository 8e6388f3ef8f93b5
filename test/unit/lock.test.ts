/** Cross-process pool locks: held, refused, taken over from a killed holder, released. */
import { spawn } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { bindExec, type Runner } from '../../src/exec/runner.js';
import { Capacity } from '../../src/pool/capacity.js';
import { growImage } from '../../src/pool/images.js';
import { type HeldLock, isHeld, LockManager } from '../../src/pool/lock.js';
import { NodeRegistry } from '../../src/pool/nodes.js';
import { Pool } from '../../src/pool/pool.js';
import { VolumeStore } from '../../src/pool/volumes.js';
import { REPO, tempDir } from '../helpers/driver.js';
import { volumeMeta } from '../helpers/node-world.js';

const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await fs.rm(d, { recursive: true, force: true });
});

const log = pino({ level: 'silent' });
const MiB = 2 ** 20;

/** A child process that takes `key` in `dir` and holds it until killed; resolves once it holds it. */
async function holder(dir: string, key: string) {
  const script = `
    import { pino } from 'pino';
    import { LockManager } from './dist/pool/lock.js';
    const got = await new LockManager(${JSON.stringify(dir)}, pino({ level: 'silent' })).tryAcquire(${JSON.stringify(key)}, 'test holder');
    process.stdout.write('release' in got ? 'held\\n' : 'busy\\n');
    setInterval(() => {}, 1000);
  `;
  const child = spawn(process.execPath, ['--input-type=module', '-e', script], {
    cwd: REPO,
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const first = await new Promise<string>((resolve) =>
    child.stdout.once('data', (d: Buffer) => {
      resolve(d.toString().trim());
    }),
  );
  return { child, first };
}

describe('LockManager', () => {
  it('refuses a lock held by a live process and takes over one whose holder was killed', async () => {
    const dir = await tempDir('lock');
    dirs.push(dir);
    const locks = new LockManager(dir, log);
    const h = await holder(dir, 'vol-x');
    expect(h.first).toBe('held');
    const busy = await locks.tryAcquire('vol-x', 'test');
    expect(isHeld(busy)).toBe(false);
    expect(isHeld(busy) ? '' : busy.holder).toContain(`process ${h.child.pid}`);
    h.child.kill('SIGKILL');
    await new Promise((r) => h.child.once('exit', r));
    const got = await locks.tryAcquire('vol-x', 'test');
    expect(isHeld(got)).toBe(true);
    if (isHeld(got)) await got.release();
    expect(await fs.readdir(dir)).toEqual([]);
  });

  it('is exclusive within a process and reusable after release', async () => {
    const dir = await tempDir('lock2');
    dirs.push(dir);
    const locks = new LockManager(dir, log);
    const a = await locks.tryAcquire('k', 'a');
    expect(isHeld(a)).toBe(true);
    expect(isHeld(await locks.tryAcquire('k', 'b'))).toBe(false);
    if (isHeld(a)) await a.release();
    const c = await locks.tryAcquire('k', 'c');
    expect(isHeld(c)).toBe(true);
    if (isHeld(c)) await c.release();
  });

  it('takes over a lock file naming this process that it no longer holds (its removal failed while the pool did not answer)', async () => {
    const dir = await tempDir('lock-own');
    dirs.push(dir);
    const locks = new LockManager(dir, log);
    const a = await locks.tryAcquire('k', 'a');
    if (!isHeld(a)) throw new Error('not held');
    const file = path.join(dir, 'k.lock');
    const left = await fs.readFile(file);
    await a.release();
    await fs.writeFile(file, left); // as if the release's removal had failed
    const again = await locks.tryAcquire('k', 'again');
    expect(isHeld(again)).toBe(true);
    if (isHeld(again)) await again.release();
    await expect(fs.stat(file)).rejects.toMatchObject({ code: 'ENOENT' });
  });

  it('a lock this process holds is refused to its other managers, and to its own calls made at once', async () => {
    const dir = await tempDir('lock-many');
    dirs.push(dir);
    const [one, two] = [new LockManager(dir, log), new LockManager(dir, log)];
    const got = await Promise.all(
      Array.from({ length: 8 }, (_, i) => (i % 2 ? one : two).tryAcquire('k', `${i}`)),
    );
    const held = got.filter(isHeld);
    expect(held).toHaveLength(1);
    expect(isHeld(await one.tryAcquire('k', 'later'))).toBe(false);
    expect(isHeld(await two.tryAcquire('k', 'later'))).toBe(false);
    await held[0]?.release();
    const after = await two.tryAcquire('k', 'after');
    expect(isHeld(after)).toBe(true);
    if (isHeld(after)) await after.release();
  });

  const foreignOwner = (token = 't') => ({
    host: 'elsewhere',
    bootId: 'other-boot',
    pidNs: 'x',
    pid: 1,
    start: '1',
    token,
    purpose: 'p',
    since: '',
  });
  const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

  it('never judges another host by its clock: an old or future mtime is not staleness', async () => {
    const dir = await tempDir('lock3');
    dirs.push(dir);
    const file = path.join(dir, 'k.lock');
    await fs.writeFile(file, JSON.stringify(foreignOwner()));
    // The holder's clock is two minutes behind ours: its fresh heartbeat looks old.
    const old = new Date(Date.now() - 120_000);
    await fs.utimes(file, old, old);
    const locks = new LockManager(dir, log, { leaseMs: 400 });
    expect(isHeld(await locks.tryAcquire('k', 'first look'))).toBe(false);
    // It keeps beating, with its skewed clock: never taken over.
    for (let i = 0; i < 6; i++) {
      await sleep(100);
      const t = new Date(Date.now() - 120_000 + i * 1000);
      await fs.utimes(file, t, t);
      expect(isHeld(await locks.tryAcquire('k', 'while it beats'))).toBe(false);
    }
    // It stops: once this process has seen no change for the lease, it is taken over.
    await sleep(450);
    const got = await locks.tryAcquire('k', 'stale');
    expect(isHeld(got)).toBe(true);
    if (isHeld(got)) await got.release();
  });

  it('takes over a silent lock whose mtime lies in the future, after the lease by its own clock', async () => {
    const dir = await tempDir('lock4');
    dirs.push(dir);
    const file = path.join(dir, 'k.lock');
    await fs.writeFile(file, JSON.stringify(foreignOwner()));
    const future = new Date(Date.now() + 3_600_000);
    await fs.utimes(file, future, future);
    // A lease long enough that the look "too soon" stays within it on a loaded machine.
    const locks = new LockManager(dir, log, { leaseMs: 2000 });
    expect(isHeld(await locks.tryAcquire('k', 'first look'))).toBe(false);
    await sleep(500);
    expect(isHeld(await locks.tryAcquire('k', 'too soon'))).toBe(false);
    await sleep(1700);
    const got = await locks.tryAcquire('k', 'stale');
    expect(isHeld(got)).toBe(true);
    if (isHeld(got)) await got.release();
  });

  /** Lock `k` held in a fresh directory, with a 400 ms lease renewed every 30 ms. */
  async function heldBriefly(tag: string): Promise<{ dir: string; got: HeldLock }> {
    const dir = await tempDir(tag);
    dirs.push(dir);
    const got = await new LockManager(dir, log, { leaseMs: 400, heartbeatMs: 30 }).tryAcquire('k', 'holder');
    if (!isHeld(got)) throw new Error('not held');
    return { dir, got };
  }

  it('a holder whose lock was taken over stops acting under it', async () => {
    const { dir, got } = await heldBriefly('lock5');
    expect(got.signal.aborted).toBe(false);
    got.assertHeld();
    // Another host broke it (say, after our process stalled) and wrote its own.
    await fs.writeFile(path.join(dir, 'k.lock'), JSON.stringify(foreignOwner('theirs')));
    for (let i = 0; i < 50 && !got.signal.aborted; i++) await sleep(20);
    expect(got.signal.aborted).toBe(true);
    expect(() => {
      got.assertHeld();
    }).toThrow(/lost its lock/);
    await got.release();
    // Their lock stays theirs.
    expect(JSON.parse(await fs.readFile(path.join(dir, 'k.lock'), 'utf8'))).toMatchObject({
      token: 'theirs',
    });
  });

  it('a holder whose renewals never answer (a hung pool) stops acting under it within half a lease', async () => {
    const { got } = await heldBriefly('lock6');
    // The pool's server went away under a hard mount: reads hang, they never fail.
    const hang = vi.spyOn(fs, 'open').mockImplementation(() => new Promise(() => undefined));
    try {
      for (let i = 0; i < 50 && !got.signal.aborted; i++) await sleep(20);
      expect(got.signal.aborted).toBe(true);
      // Its release returns too (the call under it answers), without reading the hung pool.
      expect(await Promise.race([got.release().then(() => 'released'), sleep(1000).then(() => 'hung')])).toBe(
        'released',
      );
    } finally {
      hang.mockRestore();
    }
  });

  it('a holder stalled past half a lease is told at its next check, before its renewal timer runs', async () => {
    const { got } = await heldBriefly('lock7');
    got.assertHeld();
    // A process stopped or starved for longer than half a lease: no timer ran meanwhile.
    const until = performance.now() + 250;
    while (performance.now() < until) {
      /* the event loop is blocked, as in a stopped process */
    }
    expect(() => {
      got.assertHeld();
    }).toThrow(/lost its lock/);
    await got.release();
  });

  it('growing an image never sets back the length another process gave it meanwhile', async () => {
    const dir = await tempDir('grow');
    dirs.push(dir);
    const file = path.join(dir, 'disk.img');
    await fs.writeFile(file, '');
    await fs.truncate(file, MiB);
    // While this process runs fallocate, another (which took the lock over) grew the image to 4 MiB
    // and its pod wrote at the end.
    const runner: Runner = {
      run: async () => {
        await fs.truncate(file, 4 * MiB);
        const h = await fs.open(file, 'r+');
        await h.write(Buffer.from('theirs'), 0, 6, 4 * MiB - 6);
        await h.close();
        return { exitCode: 0, stdout: '', stderr: '' };
      },
    };
    await growImage(bindExec(runner, { log, deadline: Infinity }), file, 2 * MiB, true);
    const h = await fs.open(file, 'r');
    const end = Buffer.alloc(6);
    await h.read(end, 0, 6, 4 * MiB - 6);
    await h.close();
    expect({ size: (await fs.stat(file)).size, end: end.toString() }).toEqual({
      size: 4 * MiB,
      end: 'theirs',
    });
  });

  it('refuses keys that are not safe file names', async () => {
    const locks = new LockManager('/tmp', log);
    await expect(locks.tryAcquire('../etc/passwd', 'x')).rejects.toThrow(/bad lock key/);
  });
});

describe('work under a lock that is lost', () => {
  /** A pool whose locks are renewed every 20 ms: a lock taken over is found lost at once. */
  async function quickPool(tag: string): Promise<{ pool: Pool; volumes: VolumeStore }> {
    const dir = await tempDir(tag);
    dirs.push(dir);
    const pool = await Pool.open(dir, 'test', log, { create: true, lock: { heartbeatMs: 20 } });
    return {
      pool,
      volumes: new VolumeStore(pool, new Capacity(pool.layout, 1), new NodeRegistry(pool.layout), log),
    };
  }

  it('leaves what it made to whoever took the lock over, instead of discarding it', async () => {
    const { pool, volumes } = await quickPool('lost-lock');
    const meta = volumeMeta('pv-lost', { capacityBytes: 2 ** 20, requiredBytes: 2 ** 20 });
    const { id } = meta;
    const created = volumes.create(meta, async (_image, lock) => {
      // Another process takes the lock over (this one was cut off from the pool for a lease), and
      // finishes the volume itself.
      await fs.writeFile(path.join(pool.layout.locksDir, `${id}.lock`), '{}');
      await new Promise<void>((resolve) => {
        lock.signal.addEventListener('abort', () => {
          resolve();
        });
      });
      await fs.writeFile(pool.layout.volumeImage(id), '');
      await fs.writeFile(pool.layout.volumeMeta(id), JSON.stringify({ ...meta, state: 'ready' }));
      throw new Error('the copy stopped: its lock was lost');
    });
    await expect(created).rejects.toThrow(/lock was lost/);
    expect(JSON.parse(await fs.readFile(pool.layout.volumeMeta(id), 'utf8'))).toMatchObject({
      state: 'ready',
    });
    await fs.stat(pool.layout.volumeImage(id));
  });

  /** A volume with an (empty) image on a pool whose locks renew fast; and `lockTakenOver` for it. */
  async function volumeOnQuickPool(tag: string) {
    const { pool, volumes } = await quickPool(tag);
    const meta = volumeMeta(`pv-${tag}`, { capacityBytes: 2 ** 20, requiredBytes: 2 ** 20 });
    await volumes.create(meta, async (image) => {
      await fs.writeFile(image, '');
      return { initialized: false };
    });
    const lockFile = path.join(pool.layout.locksDir, `${meta.id}.lock`);
    /**
     * Once `read` has read what it reads under the volume's lock, another process takes that lock over
     * (this one was cut off from the pool for a lease), and this one's renewal finds it gone.
     */
    const lockTakenOver = async <T>(read: () => Promise<T>): Promise<T> => {
      const got = await read();
      await fs.writeFile(lockFile, '{}');
      // Its renewal (every 20 ms) has found it gone, on a loaded machine too.
      await new Promise((r) => setTimeout(r, 1000));
      return got;
    };
    return { pool, volumes, id: meta.id, lockFile, lockTakenOver };
  }

  it('deletes no volume once the lock was lost while it looked at the leases (another node may stage it meanwhile)', async () => {
    const { pool, volumes, id, lockFile, lockTakenOver } = await volumeOnQuickPool('lost-delete');
    const leases = volumes.leases.bind(volumes);
    vi.spyOn(volumes, 'leases').mockImplementationOnce((vid) => lockTakenOver(() => leases(vid)));
    await expect(volumes.delete(id)).rejects.toThrow(/lost its lock/);
    await fs.stat(pool.layout.volumeImage(id));
    await fs.rm(lockFile);
    await volumes.delete(id);
    await expect(fs.stat(pool.layout.volumeDir(id))).rejects.toMatchObject({ code: 'ENOENT' });
  });

  it('neither discards an unfinished creation nor quarantines a damaged record once the lock was lost after reading it', async () => {
    const { pool, volumes, id, lockFile, lockTakenOver } = await volumeOnQuickPool('lost-leftover');
    const file = pool.layout.volumeMeta(id);
    const creating = JSON.stringify({ ...JSON.parse(await fs.readFile(file, 'utf8')), state: 'creating' });
    await fs.writeFile(file, creating);
    const meta = volumeMeta('pv-lost-leftover', { capacityBytes: 2 ** 20, requiredBytes: 2 ** 20 });
    const fill = async (image: string) => {
      await fs.writeFile(image, '');
      return { initialized: false };
    };
    const damaged = { state: 'damaged' as const, reason: 'volume.json is not valid JSON' };
    const inspect = volumes.inspect.bind(volumes);
    for (const read of [() => inspect(id), () => Promise.resolve(damaged)]) {
      for (const call of [() => volumes.create({ ...meta, id }, fill), () => volumes.delete(id)]) {
        // The new holder may be remaking this very volume: what this call read is no longer the truth.
        vi.spyOn(volumes, 'inspect').mockImplementationOnce(() => lockTakenOver(read));
        await expect(call()).rejects.toThrow(/lost its lock/);
        expect(await fs.readFile(file, 'utf8')).toBe(creating);
        await fs.stat(pool.layout.volumeImage(id));
        expect(await pool.quarantined()).toEqual([]);
        await fs.rm(lockFile);
      }
    }
    // With the lock held, the same reads clear the way: the damaged one into quarantine, for an operator.
    vi.spyOn(volumes, 'inspect').mockResolvedValueOnce(damaged);
    await expect(volumes.delete(id)).rejects.toThrow(/cannot be read/);
    expect(await pool.quarantined()).toHaveLength(1);
    await fs.mkdir(pool.layout.volumeDir(id));
    await fs.writeFile(file, creating);
    await volumes.delete(id);
    await expect(fs.stat(pool.layout.volumeDir(id))).rejects.toMatchObject({ code: 'ENOENT' });
  });

  /** node-a's lease of a filesystem staged at /staging. */
  const stagingLease = () => ({
    node: 'node-a',
    stagingPath: '/staging',
    accessType: 'mount' as const,
    mode: 'SINGLE_NODE_WRITER' as const,
    readonly: false,
    since: new Date().toISOString(),
  });

  it('writes no fence record from what it read before the lock was lost (another process may have changed it)', async () => {
    const { pool, volumes, id, lockFile, lockTakenOver } = await volumeOnQuickPool('lost-fence');
    const mustGet = volumes.mustGet.bind(volumes);
    vi.spyOn(volumes, 'mustGet').mockImplementationOnce((vid) => lockTakenOver(() => mustGet(vid)));
    const lease = stagingLease();
    await expect(volumes.takeLease(id, lease)).rejects.toThrow(/lost its lock/);
    await expect(fs.stat(pool.layout.volumeFences(id))).rejects.toMatchObject({ code: 'ENOENT' });
    // With the lock held, the same call writes it.
    await fs.rm(lockFile);
    await volumes.takeLease(id, lease);
    expect(await volumes.lease(id, 'node-a')).toMatchObject({ node: 'node-a', stagingPath: '/staging' });
  });

  it('renames no fence record once the lock was lost while its temp files were written (a pool that hung meanwhile)', async () => {
    const { pool, volumes, id, lockFile } = await volumeOnQuickPool('lost-rename');
    const open = fs.open.bind(fs);
    let taken = false;
    vi.spyOn(fs, 'open').mockImplementation(async (file, ...rest) => {
      if (!taken && path.basename(String(file)).startsWith('.fences.json.')) {
        // Another process takes the lock over while this one writes (the pool hung here for a lease).
        taken = true;
        await fs.writeFile(lockFile, '{}');
        await new Promise((r) => setTimeout(r, 1000));
      }
      return open(file, ...rest);
    });
    const lease = stagingLease();
    await expect(volumes.takeLease(id, lease)).rejects.toThrow(/lost its lock/);
    vi.restoreAllMocks();
    expect(taken).toBe(true);
    await expect(fs.stat(pool.layout.volumeFences(id))).rejects.toMatchObject({ code: 'ENOENT' });
    expect(await volumes.lease(id, 'node-a')).toBeUndefined();
    const dir = path.dirname(pool.layout.volumeFences(id));
    expect((await fs.readdir(dir)).filter((n) => n.startsWith('.'))).toEqual([]);
  });

  it('keeps the device a lease names, with its disk sequence number, until a stage names another', async () => {
    const { volumes, id } = await volumeOnQuickPool('lease-device');
    const lease = {
      node: 'node-a',
      stagingPath: '/staging',
      accessType: 'block' as const,
      mode: 'SINGLE_NODE_WRITER' as const,
      readonly: false,
      since: new Date().toISOString(),
      bootId: 'boot-1',
    };
    await volumes.takeLease(id, { ...lease, device: 'loop3', deviceSeq: '41' });
    expect(await volumes.lease(id, 'node-a')).toMatchObject({ device: 'loop3', deviceSeq: '41' });
    // Taken again before the next attach (a restage read-only, which rewrites the record): the device
    // named before stays, number and all, until the attach names its own.
    await volumes.takeLease(id, { ...lease, readonly: true });
    expect(await volumes.lease(id, 'node-a')).toMatchObject({
      readonly: true,
      device: 'loop3',
      deviceSeq: '41',
    });
    // The same name attached anew (another number) is another attachment: the record says so.
    await volumes.takeLease(id, { ...lease, device: 'loop3', deviceSeq: '57' });
    expect(await volumes.lease(id, 'node-a')).toMatchObject({ device: 'loop3', deviceSeq: '57' });
    // Another device where the kernel shows no number: no number is kept for it.
    await volumes.takeLease(id, { ...lease, device: 'loop4' });
    const last = await volumes.lease(id, 'node-a');
    expect(last).toMatchObject({ device: 'loop4' });
    expect(last?.deviceSeq).toBeUndefined();
    // After a reboot a name from the boot before means nothing: a lease taken before the attach keeps none.
    await volumes.takeLease(id, { ...lease, device: 'loop4', deviceSeq: '9' });
    await volumes.takeLease(id, { ...lease, bootId: 'boot-2' });
    const rebooted = await volumes.lease(id, 'node-a');
    expect(rebooted).toMatchObject({ bootId: 'boot-2' });
    expect(rebooted?.device).toBeUndefined();
    expect(rebooted?.deviceSeq).toBeUndefined();
  });
});
