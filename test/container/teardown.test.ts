/**
 * Last phase of the container run (run.sh also calls it when an earlier phase failed): remove every
 * container of the run, and every mount and loop device under its directory — reporting as leaks
 * those that the driver should have removed itself.
 */
import { describe, expect, it } from 'vitest';
import { Cluster, report } from './cluster.js';

const top = process.env.LOOPVOL_CONTAINER_TOP ?? '';

describe.skipIf(!top)('the container run, taken down', () => {
  it('leaves no container, mount or loop device behind', async () => {
    const cluster = await Cluster.load(top).catch(() => undefined);
    if (!cluster) return; // the start phase never got as far as a cluster: run.sh cleans up the rest
    const r = await cluster.teardown();
    await report('containers removed', r.containers.join(' '));
    await report('left by the driver and removed here (leaks)', r.leaks);
    expect(r.left).toEqual({ loops: [], mounts: [] });
    expect(r.leaks).toEqual({ loops: [], mounts: [] });
  });
});
