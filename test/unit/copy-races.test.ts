/**
 * The controller's copies (CreateSnapshot, CreateVolume from a volume, CreateVolumeGroupSnapshot) racing
 * what else happens to their sources while they wait for the sources' pool locks, or while they copy:
 * what they find under the locks is what counts. In-process, on a real pool (cp and blkid on files).
 */
import { afterAll, describe, expect, it } from 'vitest';
import {
  type ControllerWorld,
  controllerWorld,
  fromVolume,
  removeControllerWorlds,
  volumeIdOf,
} from '../helpers/controller-world.js';
import { codeOf } from '../helpers/node-world.js';

afterAll(removeControllerWorlds);

/**
 * Starts `call` while holding volume `id`'s pool lock (as a node's stage or another controller's delete
 * would), runs `meanwhile` once the call waits for that lock, then lets go; returns how the call ended.
 */
async function whileItWaits(
  w: ControllerWorld,
  id: string,
  call: () => Promise<unknown>,
  meanwhile: () => Promise<unknown>,
): Promise<string> {
  let code: Promise<string> | undefined;
  await w.pool.withLock(id, 'a node or another controller', async () => {
    code = codeOf(call());
    await new Promise((r) => setTimeout(r, 300));
    await meanwhile();
  });
  if (!code) throw new Error('the call did not start');
  return code;
}

describe('a source volume deleted while a copy of it waits for its lock', () => {
  const deletedMeanwhile = async (copy: (w: ControllerWorld, id: string) => Promise<unknown>) => {
    const w = await controllerWorld();
    const id = volumeIdOf(await w.CreateVolume('src'));
    // What DeleteVolume does under the lock (volumes.delete: the volume's directory goes).
    return whileItWaits(
      w,
      id,
      () => copy(w, id),
      () => w.pool.discard(w.pool.layout.volumeDir(id)),
    );
  };

  it('CreateSnapshot answers NOT_FOUND (spec: source volume does not exist)', async () => {
    expect(await deletedMeanwhile((w, id) => w.CreateSnapshot('snap', id))).toBe('NOT_FOUND');
  });
  it('CreateVolume from it answers NOT_FOUND (spec: volume source does not exist)', async () => {
    expect(await deletedMeanwhile((w, id) => w.CreateVolume('clone', { source: fromVolume(id) }))).toBe(
      'NOT_FOUND',
    );
  });
  it('CreateVolumeGroupSnapshot answers NOT_FOUND', async () => {
    expect(await deletedMeanwhile((w, id) => w.CreateVolumeGroupSnapshot('group', [id]))).toBe('NOT_FOUND');
  });
});
