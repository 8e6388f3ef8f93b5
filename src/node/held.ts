/**
 * A loop device a stage uses while others on the host may detach it: a leftover it reuses (one a
 * neighbour node plugin, or an interrupted call of its own, left), held open while the stage uses it,
 * and any device once mounted, read again to prove the mount took the volume's image.
 */
import { busy } from '../errors.js';
import { detached, type Exec } from '../exec/runner.js';
import type { LoopDevice } from '../host/host.js';
import { neighbourLeased } from './neighbours.js';
import type { NodeDeps, OnHost } from './on-host.js';

export interface Held {
  release(): Promise<void>;
}

/**
 * A leftover device a stage reuses (`live` when a filesystem on it is in use: then nothing may be
 * attached beside it), held open while the stage uses it (Host.hold): a neighbour's detach meanwhile
 * then only marks it to go once let go of, and its number cannot go to another image. Nothing (a
 * device of its own is attached instead) when:
 *  - it is not live and another node plugin on this host holds a lease on the volume (read after this
 *    stage took its own, which keeps a neighbour that looks later off the device): that one may be
 *    detaching it (an unstage that judged it its own), or reusing it too;
 *  - it cannot be held (its detach is under way), or since the look it was detached or attached anew,
 *    or marked to go, and it is not live.
 * One that is live but cannot be held, or marked to go and kept by another holder, is refused
 * (`refuse`): a device beside it would be a second filesystem, or a second writer, of the image.
 */
export async function holdReused(
  d: NodeDeps,
  on: OnHost,
  loop: LoopDevice,
  live: (l: LoopDevice) => Promise<boolean>,
  refuse: () => Error,
): Promise<{ loop?: LoopDevice; pin?: Held }> {
  if (!(await live(loop)) && (await neighbourLeased(d, on))) return {};
  const pin = await d.host.hold(loop);
  if (!pin) {
    if (await live(loop)) throw refuse();
    return {};
  }
  try {
    const now = await d.host.reread(loop).catch(() => undefined);
    if (now && (!now.autoclear || (await live(now)))) return { loop: now, pin };
  } catch (err) {
    await pin.release();
    throw err;
  }
  await pin.release();
  const still = await d.host.reread(loop).then(
    () => true,
    () => false,
  );
  if (still) throw refuse();
  return {};
}

/**
 * A held raw block device, before the stage lets go of it: nothing holds a raw block staging, so one a
 * detach marked meanwhile would go at once (ABORTED; the kubelet retries, and that stage attaches a
 * device of its own).
 */
export async function notMarkedToGo(d: NodeDeps, loop: LoopDevice): Promise<void> {
  if ((await d.host.reread(loop)).autoclear)
    throw busy(`${loop.path} was detached meanwhile (by another process); try again.`);
}

/**
 * Mounted, a device can no longer be detached and attached anew: still the attachment the stage
 * judged, the filesystem at `staging` is the volume's. Otherwise its number went to another image
 * before the mount took it (a device this call attached, detached by a hand or a tool that holds no
 * lease): that is unmounted again, and the stage answers ABORTED.
 */
export async function mountedIsTheVolume(
  d: NodeDeps,
  x: Exec,
  loop: LoopDevice,
  staging: string,
): Promise<void> {
  try {
    await d.host.reread(loop);
  } catch (err) {
    await d.host
      .unmountAll(detached(x), staging, undefined, (m) => m.source === loop.path)
      .catch((e: unknown) => {
        x.log.error({ err: e, staging }, 'could not unmount another image mounted at a staging path');
      });
    throw err;
  }
}
