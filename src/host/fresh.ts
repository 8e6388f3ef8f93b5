import { CallStopped, type RunScope } from '../exec/runner.js';

/**
 * One reading of the host shared by the calls that ask for it at about the same time, without ever
 * handing a call a reading older than its question.
 *
 * A call that asks while a reading is under way does not join it: that reading may have begun before
 * the call's own last step (an attach, an unmount) and not show it. It waits for the next reading,
 * which begins when the current one ends and is shared by everyone who asked meanwhile. So at most one
 * reading runs and one waits, however many calls look at once: 64 concurrent stages read sysfs and the
 * mount table a few times instead of 64 times each.
 */
export function freshReading<A extends unknown[], T>(
  read: (...args: A) => Promise<T>,
): (...args: A) => Promise<T> {
  let running: Promise<unknown> | undefined;
  let next: Promise<T> | undefined;
  const start = (args: A): Promise<T> => {
    const p = read(...args);
    const settled = p.then(
      () => undefined,
      () => undefined,
    );
    running = settled;
    void settled.then(() => {
      if (running === settled) running = undefined;
    });
    return p;
  };
  return (...args: A): Promise<T> => {
    if (next) return next;
    if (!running) return start(args);
    const queued = running.then(() => {
      next = undefined;
      return start(args);
    });
    next = queued;
    return queued;
  };
}

/** The longest delay setTimeout holds (2^31 - 1 ms); a longer one fires at once. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Waits for a shared reading as long as the caller is there: a reading shared with others runs free of
 * any one caller's cancellation and deadline, and each caller stops waiting for it at its own
 * (CallStopped), as it would have stopped its own command.
 */
export function whileCalling<T>(scope: RunScope, shared: Promise<T>): Promise<T> {
  const { signal, deadline } = scope;
  // The reading is others' too: its failure is theirs to see, never an unhandled rejection of this wait.
  shared.catch(() => undefined);
  // A deadline past what a timer can hold (24.8 days) is as good as none.
  const ms = deadline === undefined ? Infinity : deadline - Date.now();
  if (!signal && !(ms < MAX_TIMER_MS)) return shared;
  return new Promise<T>((resolve, reject) => {
    let timer: NodeJS.Timeout | undefined;
    const stop = (why: 'cancelled' | 'deadline'): void => {
      done();
      reject(new CallStopped(why));
    };
    const onAbort = (): void => {
      stop('cancelled');
    };
    const done = (): void => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
    };
    if (signal?.aborted) {
      stop('cancelled');
      return;
    }
    signal?.addEventListener('abort', onAbort, { once: true });
    if (ms < MAX_TIMER_MS) {
      timer = setTimeout(
        () => {
          stop('deadline');
        },
        Math.max(0, ms),
      );
    }
    shared.then(
      (v) => {
        done();
        resolve(v);
      },
      (err: unknown) => {
        done();
        reject(err instanceof Error ? err : new Error(String(err)));
      },
    );
  });
}
