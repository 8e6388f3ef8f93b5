import { configDefaults, defineConfig } from 'vitest/config';

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
        // Integration suites attach loop devices and mount filesystems: files one at a time so their
        // devices and mounts never interleave, and give real mkfs/mount steps room. After the unit
        // files, never beside them: their timings are real.
        extends: true,
        test: {
          name: 'integration',
          include: ['test/integration/**/*.test.ts', 'test/e2e/**/*.test.ts'],
          fileParallelism: false,
          sequence: { groupOrder: 1 },
        },
      },
    ],
  },
});
