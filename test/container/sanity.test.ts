/**
 * Phase 3 of the container run: the upstream conformance tool, csi-sanity, in mount and block modes,
 * through sanity/run.sh (the same runner and flags as outside), with every csi-sanity found
 * ($CSI_SANITY, or csi-sanity on PATH, or /opt/csi-sanity/<version>/csi-sanity), twice:
 *  - as deployed: node-1's DaemonSet container for the Node service, the controller's container for
 *    the Controller service. csi-sanity reads the plugin's capabilities from the node endpoint, which
 *    in --mode=node offers no Controller and GroupController service, so it skips the specs that need
 *    them on that endpoint (it says so per spec);
 *  - like for like with the run outside (one process in --mode=all): one container of the image with
 *    the DaemonSet's mounts, privileges and args but --mode=all, on a node of its own ("sanity").
 */
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { REPO } from '../helpers/driver.js';
import { Cluster, docker, report } from './cluster.js';

const top = process.env.LOOPVOL_CONTAINER_TOP ?? '';

function binaries(): string[] {
  if (process.env.CSI_SANITY) return [process.env.CSI_SANITY];
  const onPath = spawnSync('sh', ['-c', 'command -v csi-sanity'], { encoding: 'utf8' }).stdout.trim();
  if (onPath) return [onPath];
  const dir = '/opt/csi-sanity';
  if (!fs.existsSync(dir)) return [];
  return fs
    .readdirSync(dir)
    .sort()
    .map((v) => path.join(dir, v, 'csi-sanity'))
    .filter((f) => fs.existsSync(f));
}

const found = top ? binaries() : [];

function sanity(
  bin: string,
  label: string,
  env: Record<string, string>,
): { status: number | null; results: string[] } {
  const version = path.basename(path.dirname(bin));
  const r = spawnSync(path.join(REPO, 'sanity', 'run.sh'), ['mount', 'block'], {
    encoding: 'utf8',
    env: {
      ...process.env,
      CSI_SANITY: bin,
      SANITY_OUT: path.join(process.env.LOOPVOL_CONTAINER_OUT ?? top, `sanity-${version}-${label}`),
      ...env,
    },
    timeout: 600_000,
  });
  process.stdout.write(r.stdout + r.stderr);
  // Each mode's last run (run.sh runs a mode once more when csi-sanity's own connect race failed it).
  const byMode = new Map<string, string>();
  for (const m of r.stdout.matchAll(
    /^=== csi-sanity, (\w+) volumes[\s\S]*?(\d+) Passed \| (\d+) Failed \| (\d+) Pending \| (\d+) Skipped/gm,
  ))
    byMode.set(m[1] ?? '', `${m[1]}: ${m[2]} passed, ${m[3]} failed, ${m[4]} pending, ${m[5]} skipped`);
  const results = [...byMode.values()];
  return { status: r.status, results };
}

describe.skipIf(!top || found.length === 0)('csi-sanity against the image in containers', () => {
  let cluster: Cluster;
  beforeAll(async () => {
    cluster = await Cluster.load(top);
  });

  it.each(found)(
    '%s, as deployed: the DaemonSet’s node plugin and the controller’s Deployment',
    async (bin) => {
      const r = sanity(bin, 'deployed', {
        SANITY_ENDPOINT: cluster.member('node-1').socket,
        SANITY_CONTROLLER_ENDPOINT: cluster.member('controller').socket,
        SANITY_DIR: cluster.kubeletDir('node-1'),
        SANITY_POOL: cluster.pool,
      });
      await report(
        `csi-sanity ${path.basename(path.dirname(bin))} inside, as deployed (node + controller containers)`,
        r.results.join('; '),
      );
      expect(r.status).toBe(0);
      expect(r.results).toHaveLength(2);
    },
  );

  describe('like for like with the run outside', () => {
    beforeAll(async () => {
      const r = await cluster.startNode('sanity', 'all');
      await report('sanity (--mode=all): engine run → Probe ready (ms)', Math.round(r.readyMs));
    });
    afterAll(async () => {
      const m = await cluster.retire('sanity');
      await docker(['stop', m.name]);
      await docker(['rm', m.name]);
    });

    it.each(found)('%s, one container in --mode=all', async (bin) => {
      const socket = cluster.member('sanity').socket;
      const r = sanity(bin, 'all', {
        SANITY_ENDPOINT: socket,
        SANITY_DIR: cluster.kubeletDir('sanity'),
        SANITY_POOL: cluster.pool,
      });
      await report(
        `csi-sanity ${path.basename(path.dirname(bin))} inside, one container in --mode=all`,
        r.results.join('; '),
      );
      expect(r.status).toBe(0);
      expect(r.results).toHaveLength(2);
    });
  });
});
