import { availableParallelism } from 'node:os';
import { configDefaults, defineConfig } from 'vitest/config';

/**
 * Integration files at once: LOOPVOL_TEST_WORKERS, else 3, and no more than one beyond the CPUs (the
 * files wait on the kernel most of the time, but their drivers' deadlines are real).
 */
const integrationWorkers = Math.max(
  1,
  Number.parseInt(process.env.LOOPVOL_TEST_WORKERS ?? '', 10) || Math.min(3, availableParallelism() + 1),
);

/** How many times slower than this machine the suites run (test/helpers/host.ts SLOW; test/kernels/ sets it). */
const slow = Math.max(1, Number(process.env.LOOPVOL_TEST_SLOW ?? 1) || 1);

export default defineConfig({
  test: {
    // test/container/ runs the built image in a container engine: test/container/run.sh runs it, with
    // its own config, after the image is built.
    exclude: [...configDefaults.exclude, 'test/container/**'],
    testTimeout: 60_000,
    hookTimeout: 60_000,
    reporters: ['default', './test/helpers/summary-reporter.ts'],
    projects: [
      {
        // Fakes and temporary files only: side by side, first.
        extends: true,
        test: { name: 'unit', include: ['test/unit/**/*.test.ts'], sequence: { groupOrder: 0 } },
      },
      {
        // Integration suites attach loop devices and mount filesystems for real. Files run side by side
        // (most of their time is spent waiting on the kernel, on mkfs and on the drivers' own timers):
        // each file keeps to its own temporary directories, pools and drivers, and finds and removes
        // only the devices and mounts under them (test/helpers/host.ts leaksUnder), so two files never
        // take each other's. LOOPVOL_TEST_WORKERS sets how many at once (1: one at a time). After the
        // unit files, never beside them.
        extends: true,
        test: {
          name: 'integration',
          include: ['test/integration/**/*.test.ts', 'test/e2e/**/*.test.ts'],
          setupFiles: ['test/helpers/failure-logs.ts'],
          maxWorkers: integrationWorkers,
          sequence: { groupOrder: 1 },
          // A file's drivers start slowly on a loaded machine (a CI failure implies about 8 s) and a test may
          // start four: a safety net against a hang, not a measure of speed.
          testTimeout: 180_000 * slow,
          hookTimeout: 180_000 * slow,
        },
      },
    ],
  },
});
