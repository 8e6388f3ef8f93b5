/**
 * The container run's phases (test/container/run.sh calls vitest once per phase, with a file filter):
 * start.test.ts, then test/e2e/kubelet.test.ts against the containers, sanity.test.ts,
 * restart.test.ts, and teardown.test.ts.
 */
import { defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['test/container/**/*.test.ts', 'test/e2e/kubelet.test.ts'],
    fileParallelism: false,
    testTimeout: 180_000,
    hookTimeout: 120_000,
    reporters: ['default', './test/helpers/summary-reporter.ts'],
  },
});
