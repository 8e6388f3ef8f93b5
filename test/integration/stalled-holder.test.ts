/**
 * A controller that stalls (stopped, swapped out) past its lock's lease while it creates a volume,
 * and resumes after another controller took the volume over, must not touch the image that is now the
 * other's. Two controllers on one real pool, in this process: the first one's lock is made to look like
 * a controller's in another PID namespace (which only its lease can tell alive), and it never renews
 * it, as a stopped process would not; both wait at `create-volume:filled`, after the image is made and
 * before its length is set.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { controllerWorld, removeControllerWorlds, volumeIdOf } from '../helpers/controller-world.js';
import { MiB } from '../helpers/node-world.js';

const { PAUSE_MS } = vi.hoisted(() => {
  const ms = 4_000 * Math.max(1, Number(process.env.LOOPVOL_TEST_SLOW ?? 1) || 1);
  process.env.LOOPVOL_PAUSEPOINT = `create-volume:filled:${ms}`;
  return { PAUSE_MS: ms };
});
const LEASE_MS = PAUSE_MS / 4;

afterAll(removeControllerWorlds);

const codeOf = (p: Promise<unknown>): Promise<string> =>
  p.then(
    () => 'OK',
    (err: unknown) => (err instanceof Error && 'kind' in err ? String(err.kind) : String(err)),
  );

describe('a controller that stalled past its lock lease', () => {
  it('leaves the image of the controller that took the volume over as that one made it', async () => {
    // The stalled one renews never (its heartbeat is longer than the test); the other one watches its
    // lock for a lease, unchanged, and takes it over.
    const stalled = await controllerWorld({ lock: { leaseMs: LEASE_MS, heartbeatMs: 600_000 } });
    const other = await controllerWorld({
      dir: stalled.dir,
      lock: { leaseMs: LEASE_MS, heartbeatMs: LEASE_MS / 10 },
    });
    const first = codeOf(stalled.CreateVolume('pvc-stalled', { bytes: 256 * MiB }));

    const volumesDir = path.join(stalled.dir, 'volumes');
    const deadline = Date.now() + PAUSE_MS / 2;
    let id: string | undefined;
    while (!id && Date.now() < deadline) {
      id = (await fs.readdir(volumesDir).catch(() => [])).at(0);
      if (!id) await new Promise((r) => setTimeout(r, 20));
    }
    if (!id) throw new Error('the first CreateVolume made no volume directory');
    // As a controller in another PID namespace writes it: this process cannot see whether it lives.
    const lockFile = path.join(stalled.dir, 'locks', `${id}.lock`);
    const owner = JSON.parse(await fs.readFile(lockFile, 'utf8')) as Record<string, unknown>;
    await fs.writeFile(lockFile, JSON.stringify({ ...owner, pidNs: 'pid:[4026599999]' }));

    // The other controller's retries (the provisioner's), until it takes the lock over and finishes.
    let made;
    for (let attempt = 0; !made && attempt < 100; attempt++) {
      made = await other.CreateVolume('pvc-stalled', { bytes: 64 * MiB }).catch(() => undefined);
    }
    if (!made) throw new Error('the second controller never took the volume over');
    expect(volumeIdOf(made)).toBe(id);
    const image = await fs.stat(path.join(volumesDir, id, 'disk.img'));
    expect({ first: await first, record: made.volume?.capacity_bytes, image: image.size }).toEqual({
      first: 'busy', // ABORTED: it lost its lock
      record: String(64 * MiB),
      image: 64 * MiB,
    });
    // Nothing the stalled one did afterwards changed it.
    expect((await fs.stat(path.join(volumesDir, id, 'disk.img'))).size).toBe(64 * MiB);
  });
});
