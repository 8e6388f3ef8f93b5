/**
 * The calls that free space (delete, unpublish, unstage) get the pool's space reserve back when they
 * fail for lack of it (pool/reserve.ts), and run once more.
 */
import { status as Code } from '@grpc/grpc-js';
import type { SpaceReserve } from '../pool/reserve.js';
import type { Method, Methods } from '../server/call.js';
import { toStatus } from '../server/status.js';

/** What answers RESOURCE_EXHAUSTED: the pool's filesystem (or a tool writing to it) out of space. */
const outOfSpace = (err: unknown): boolean => toStatus(err).code === Code.RESOURCE_EXHAUSTED;

/**
 * `m`, run once more after giving the reserve back (if it was still there) when it failed for lack of
 * space; after a success, the reserve is written again if this process found it short and the pool
 * has room.
 */
export function freeingSpace<Req, Res>(m: Method<Req, Res>, reserve: SpaceReserve): Method<Req, Res> {
  return {
    quiet: m.quiet,
    prepare(request) {
      const p = m.prepare(request);
      return {
        locks: p.locks,
        run: async (ctx) => {
          const res = await withRoom(reserve, () => p.run(ctx));
          // Given back (by this process): whole again once there is room.
          void reserve.refillIfShort();
          return res;
        },
      };
    },
  };
}

/**
 * `step`, run once more after giving the reserve back when it failed for lack of space: a call that
 * frees space, or a start-up write (a node's registration, its fence records) without which no call
 * could run to free any.
 */
export async function withRoom<T>(reserve: SpaceReserve, step: () => Promise<T>): Promise<T> {
  try {
    return await step();
  } catch (err) {
    if (!outOfSpace(err)) throw err;
    // Given back now, or just before by a call failing beside this one: either way, once more, and
    // not taken back while this runs.
    return reserve.lending(async () => {
      await reserve.giveBack().catch(() => false);
      return step();
    });
  }
}

/** `table` with its methods named in `names` wrapped by freeingSpace. */
export function freeingSpaceIn<H>(
  table: Methods<H>,
  names: readonly (keyof Methods<H>)[],
  reserve: SpaceReserve,
): Methods<H> {
  const out: Record<PropertyKey, unknown> = { ...table };
  for (const name of names) {
    const m = out[name] as Method<unknown, unknown> | undefined;
    if (m) out[name] = freeingSpace(m, reserve);
  }
  return out as Methods<H>;
}
