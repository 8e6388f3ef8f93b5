import { configDefaults, defineConfig } from 'vitest/config';

export default defineConfig({
  test: {
    include: ['test/**/*.test.ts'],
    // test/container/ runs the built image in a container engine: test/container/run.sh runs it, with
    // its own config, after the image is built.
    exclude: [...configDefaults.exclude, 'test/container/**'],
    // Integration suites attach loop devices and mount filesystems: run files one at a time so their
    // devices and mounts never interleave, and give real mkfs/mount steps room.
    fileParallelism: false,
    testTimeout: 60_000,
    hookTimeout: 60_000,
    reporters: ['default', './test/helpers/summary-reporter.ts'],
  },
});
