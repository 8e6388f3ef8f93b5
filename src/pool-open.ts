/**
 * Opening the driver's pool, at the start and for as long as it is not there. With --create-pool=false
 * a process may start before its pool exists (a shared filesystem not yet mounted); a pool on a network
 * filesystem whose server hangs may not answer at all. Either way the driver listens at once (Probe says
 * why it is not ready, /livez answers, every other call is FAILED_PRECONDITION), and serves the pool as
 * soon as it opens, without a restart.
 */
import type { Logger } from 'pino';
import { orAfter } from './limit.js';
import { type OpenOptions, Pool, PoolMissing } from './pool/pool.js';

/** How often a missing pool is looked for. */
const POOL_POLL_MS = 2_000;
/** How long the start waits for the pool to open before it listens without it. */
const POOL_ANSWER_MS = 2_000;

export interface PoolOpening {
  /** The pool, when it opened within POOL_ANSWER_MS; else `opened` is called once it opens. */
  readonly pool: Pool | undefined;
  /** Stops looking (at once: nothing opened afterwards is served), and waits for a look under way. */
  stop(): Promise<void>;
  /** Whether an open of the pool has not ended (blocked on a pool that hangs, perhaps). */
  pending(): boolean;
}

export interface OpeningHooks {
  /** The pool opened after the start: serve it (the driver is not ready until this ends). */
  opened(pool: Pool, how: string): Promise<void>;
  /** Why there is no pool to serve (yet). */
  missing(why: string): void;
}

const reason = (err: PoolMissing): string => err.message.replace(/\.$/, '');

export async function openPool(
  dir: string,
  name: string,
  log: Logger,
  options: OpenOptions,
  hooks: OpeningHooks,
): Promise<PoolOpening> {
  let stopped = false;
  let looking: Promise<void> | undefined;
  let opens = 0; // opens under way
  const open = async (): Promise<Pool> => {
    opens++;
    try {
      return await Pool.open(dir, name, log, options);
    } finally {
      opens--;
    }
  };
  const pending = (): boolean => opens > 0;
  const halted = (): boolean => stopped;
  // Probe says why, not "not open after 2 s".
  const cannotOpen = (err: unknown): void => {
    hooks.missing(
      `The pool at ${dir} cannot be opened (${err instanceof Error ? err.message : String(err)})`,
    );
    log.warn({ err }, 'the pool is there but cannot be opened yet');
  };
  const look = (): void => {
    const timer = setTimeout(() => {
      looking = (async () => {
        if (halted()) return;
        try {
          const pool = await open();
          if (!halted()) await hooks.opened(pool, 'the pool appeared; serving it');
        } catch (err) {
          if (!(err instanceof PoolMissing)) cannotOpen(err);
          look();
        }
      })();
    }, POOL_POLL_MS);
    timer.unref();
  };
  const stop = async (): Promise<void> => {
    stopped = true;
    await looking;
  };

  const opening = open();
  const first = await orAfter<{ pool: Pool } | { err: unknown } | undefined>(
    opening.then(
      (pool) => ({ pool }),
      (err: unknown) => ({ err }),
    ),
    POOL_ANSWER_MS,
    () => undefined,
  );
  if (first && 'pool' in first) return { pool: first.pool, stop, pending };
  if (first) {
    if (!(first.err instanceof PoolMissing)) throw first.err;
    hooks.missing(reason(first.err));
    log.warn({ pool: dir }, first.err.message);
    look();
    return { pool: undefined, stop, pending };
  }
  const why = `The pool at ${dir} is not open after ${POOL_ANSWER_MS / 1000} s (a network filesystem that hangs, or a slow one); it is served once it is`;
  hooks.missing(why);
  log.warn({ pool: dir }, `${why}.`);
  opening
    .then(async (pool) => {
      if (!halted()) await hooks.opened(pool, 'the pool is open; serving it');
    })
    .catch((err: unknown) => {
      if (err instanceof PoolMissing) hooks.missing(reason(err));
      else cannotOpen(err);
      look();
    });
  return { pool: undefined, stop, pending };
}
