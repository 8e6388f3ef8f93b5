/**
 * What one test file makes — temporary directories, driver processes — and its teardown: stop the
 * drivers, remove exactly the mounts and loop devices under those directories, and report them as
 * leaks (except those the file declares its own, such as a scratch pool filesystem).
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import { type DriverArgs, type DriverProcess, printLog, startDriverProcess, tempDir } from './driver.js';
import { cleanupUnder } from './host.js';

export class TestEnv {
  private readonly dirs: string[] = [];
  private readonly drivers: DriverProcess[] = [];
  /** Mount points and loop device lines that belong to the file itself, not to what it tests. */
  private readonly own: string[] = [];

  async dir(tag: string): Promise<string> {
    const d = await tempDir(tag);
    this.dirs.push(d);
    return d;
  }

  async driver(args: DriverArgs): Promise<DriverProcess> {
    const d = await startDriverProcess(args);
    this.drivers.push(d);
    return d;
  }

  /** Another node plugin (--mode=node, its own socket) on the pool of the driver started in `dir`. */
  async nodePlugin(dir: string, nodeId: string): Promise<DriverProcess> {
    return this.driver({ dir, socket: path.join(dir, `${nodeId}.sock`), nodeId, mode: 'node' });
  }

  /** Declares a mount point or loop device (`/dev/loopN`) the file set up itself. */
  declareOwn(...things: string[]): void {
    this.own.push(...things);
  }

  /** Stops everything and returns what was left behind (mounts and loop devices nobody declared). */
  async teardown(): Promise<string[]> {
    for (const d of this.drivers) await d.stop('SIGKILL');
    const leaks: string[] = [];
    for (const d of this.dirs) {
      const found = await cleanupUnder(d);
      for (const x of [...found.mounts, ...found.loops]) {
        if (!this.own.some((o) => x === o || x.startsWith(`${o} `))) leaks.push(x);
      }
      await fs.rm(d, { recursive: true, force: true });
    }
    // A leak is the file's failure, found after its tests: what its drivers did last says why.
    if (leaks.length > 0) {
      for (const d of this.drivers)
        printLog(`driver ${d.endpoint}, the file left ${leaks.join(', ')}`, d.logs(), '', 100);
    }
    return leaks;
  }
}

type Mode = NonNullable<VolumeCapability['access_mode']>['mode'];

export const mountCap = (
  fs_type = '',
  mode: Mode = 'SINGLE_NODE_WRITER',
  mount_flags: string[] = [],
): VolumeCapability => ({
  mount: { fs_type, mount_flags },
  access_mode: { mode },
});

export const blockCap = (mode: Mode = 'SINGLE_NODE_WRITER'): VolumeCapability => ({
  block: {},
  access_mode: { mode },
});
