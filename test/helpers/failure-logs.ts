/**
 * When a test fails, prints what every driver of its file logged while it ran (the last lines of each,
 * and its stderr), so that a failure in CI or in a guest says what the driver did, not only what the
 * test saw.
 */
import { beforeEach } from 'vitest';
import { printLog, started } from './driver.js';

beforeEach(({ onTestFailed }) => {
  const from = new Map(started.map((d) => [d, d.logs().length]));
  onTestFailed(({ task }) => {
    for (const d of started) {
      const lines = d.logs().slice(from.get(d) ?? 0);
      if (lines.length > 0 || d.stderr().trim() !== '')
        printLog(`driver ${d.endpoint} during "${task.name}"`, lines, d.stderr());
    }
  });
});
