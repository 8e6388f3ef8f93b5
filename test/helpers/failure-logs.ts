/**
 * When a test fails, prints what every driver of its file logged while it ran (the last lines of each,
 * and its stderr), so that a failure in CI or in a guest says what the driver did, not only what the
 * test saw.
 */
import { beforeEach } from 'vitest';
import { started } from './driver.js';

const LAST = 200;

beforeEach(({ onTestFailed }) => {
  const from = new Map(started.map((d) => [d, d.logs().length]));
  onTestFailed(({ task }) => {
    for (const d of started) {
      const lines = d.logs().slice(from.get(d) ?? 0);
      const err = d.stderr().trim();
      if (lines.length === 0 && err === '') continue;
      const shown = lines.slice(-LAST);
      const cut = lines.length - shown.length;
      process.stderr.write(
        `\n--- driver ${d.endpoint} during "${task.name}"${cut > 0 ? ` (its last ${LAST} of ${lines.length} lines)` : ''} ---\n` +
          `${shown.join('\n')}\n${err ? `--- its stderr ---\n${err}\n` : ''}`,
      );
    }
  });
});
