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
