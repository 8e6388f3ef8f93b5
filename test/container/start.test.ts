/**
 * Phase 1 of the container run: the built image started the way the manifests start it — the
 * controller as its Deployment does, and a node plugin on node-1 and node-2 as the DaemonSet does —
 * with numbers for the report (engine start to Probe ready, idle memory). Writes the environment the
 * end-to-end suite runs with (LOOPVOL_E2E_ENDPOINTS, LOOPVOL_E2E_ROOT) to $LOOPVOL_CONTAINER_OUT/e2e.env.
 */
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { describe, expect, it } from 'vitest';
import { REPO } from '../helpers/driver.js';
import { Cluster, docker, report } from './cluster.js';

const top = process.env.LOOPVOL_CONTAINER_TOP ?? '';
const image = process.env.LOOPVOL_IMAGE ?? '';
const runId = process.env.LOOPVOL_CONTAINER_RUN ?? '';

const loopDevices = async (): Promise<string[]> =>
  (await fs.readdir('/dev')).filter((n) => /^loop\d+$/.test(n)).sort();

describe.skipIf(!top || !image)('the image, started as the manifests start it', () => {
  let cluster: Cluster;

  it('grants what the host has where privileged is asked for, and says what it cannot', async () => {
    cluster = await Cluster.create(top, image, runId);
    const lacks = /CapBnd:\s*([0-9a-f]+)/.exec(await fs.readFile('/proc/self/status', 'utf8'))?.[1] ?? '';
    const plan = await cluster.nodePlan('node-1');
    expect(plan.privileged).toBe(true);
    // Said plainly in the output: the engine's own privileged mode is not what runs here.
    await report(
      'privileged: true is emulated',
      `this host's capability bounding set is ${lacks} (${cluster.capabilities.length} capabilities); ` +
        `the engine's --privileged asks for all of them and fails, so the container gets --cap-add for each ` +
        `capability the host has, seccomp, AppArmor and /proc masking unconfined, and device cgroup rules ` +
        `'b 7:* rmw' (loop devices) and 'c 10:237 rmw' (loop-control); /sys stays read-only as in any ` +
        `unprivileged container`,
    );
  });

  it('starts the controller as the Deployment does (read-only root, socket in an emptyDir)', async () => {
    const r = await cluster.startController();
    await report('controller: engine run → Probe ready (ms)', Math.round(r.readyMs));
    expect(r.member.plan.readOnlyRootFilesystem).toBe(true);
  });

  it('starts a node plugin on node-1 and node-2 as the DaemonSet does', async () => {
    for (const node of ['node-1', 'node-2']) {
      const r = await cluster.startNode(node);
      await report(`${node}: engine run returned (ms)`, Math.round(r.runMs));
      await report(`${node}: engine run → Probe ready (ms)`, Math.round(r.readyMs));
      // The kubelet finds the plugin where the registrar tells it: in the plugin directory.
      expect(r.member.socket).toBe(path.join(cluster.kubeletDir(node), 'plugins/loopvol.csi.io/csi.sock'));
      const info = await (async () => {
        const c = cluster.clients(node);
        try {
          return await c.node.NodeGetInfo({});
        } finally {
          c.close();
        }
      })();
      expect(info.node_id).toBe(node);
    }
  });

  it('shows the container every loop device the host has, also one made after it started', async () => {
    const name = cluster.member('node-1').name;
    const inside = async () =>
      (await docker(['exec', name, 'ls', '/dev']))
        .split('\n')
        .filter((n) => /^loop\d+$/.test(n))
        .sort();
    const before = await loopDevices();
    expect(await inside()).toEqual(before);
    // Attach tiny images on the host until the kernel makes a device that did not exist before.
    const scratch = path.join(cluster.top, 'loop-probe');
    await fs.mkdir(scratch);
    const attached: string[] = [];
    let fresh = '';
    try {
      // Every free device node is reused first (a host that once had many attached keeps them all).
      for (let i = 0; i < before.length + 8 && !fresh; i++) {
        const img = path.join(scratch, `${i}.img`);
        await fs.writeFile(img, Buffer.alloc(0));
        await fs.truncate(img, 1 << 20);
        const dev = execFileSync('losetup', ['--find', '--show', img], { encoding: 'utf8' }).trim();
        attached.push(dev);
        if (!before.includes(path.basename(dev))) fresh = dev;
      }
      expect(fresh, 'the kernel made a new loop device').not.toBe('');
      // The container sees it and may use it (the device cgroup rule covers every loop minor).
      const size = await docker(['exec', name, 'blockdev', '--getsize64', fresh]);
      expect(size).toBe(String(1 << 20));
      await report('loop device made after the container started, used inside it', fresh);
    } finally {
      for (const d of attached) execFileSync('losetup', ['-d', d]);
      await fs.rm(scratch, { recursive: true, force: true });
      // The device node the kernel made for this check goes too (LOOP_CTL_REMOVE; util-linux has no
      // command for it), so repeated runs do not pile up idle loop devices.
      if (fresh) {
        const n = fresh.replace('/dev/loop', '');
        const r = spawnSync(
          'python3',
          [
            '-c',
            'import fcntl,os,sys; fcntl.ioctl(os.open("/dev/loop-control", os.O_RDWR), 0x4C81, int(sys.argv[1]))',
            n,
          ],
          { encoding: 'utf8' },
        );
        await report(
          `the loop device node ${fresh} made for this check`,
          r.status === 0
            ? 'removed'
            : `left (no python3 to remove it: ${r.stderr.trim() || String(r.error)})`,
        );
      }
    }
  });

  it('idles at a measured size, and tells the end-to-end suite where everything is', async () => {
    await new Promise((r) => setTimeout(r, 5000));
    const environs: string[][] = [];
    for (const m of cluster.members) {
      await report(`${m.role}: driver RSS idle (MiB)`, +((await cluster.rss(m.name)) / 2 ** 20).toFixed(1));
      const pid = await cluster.hostPid(m.name);
      environs.push((await fs.readFile(`/proc/${pid}/environ`, 'utf8')).split('\0'));
    }
    // What the image's Node.js holds for grpc-js alone: the driver's idle RSS is read against this.
    await report(
      "floor: bare grpc-js server on the image's Node.js, RSS idle (MiB)",
      +((await cluster.bareServerRss(5000)) / 2 ** 20).toFixed(1),
    );
    // The image's environment reaches every driver: one malloc arena (the Dockerfile's ENV).
    for (const env of environs) expect(env).toContain('MALLOC_ARENA_MAX=1');
    const endpoints = cluster.members.map((m) => `${m.role}=unix://${m.socket}`).join(',');
    const out = process.env.LOOPVOL_CONTAINER_OUT ?? top;
    await fs.mkdir(out, { recursive: true });
    await fs.writeFile(
      path.join(out, 'e2e.env'),
      `LOOPVOL_E2E_ROOT=${cluster.root}\nLOOPVOL_E2E_ENDPOINTS=${endpoints}\n`,
    );
  });

  it("collects a burst's garbage and gives its pages back on the image's Node.js", async () => {
    // src/idle-gc.ts: what the driver does once a burst of calls is over, run in the controller's
    // container by the image's own Node.js (Node 26 keeps freed pages unless told to give them back).
    const probe = await fs.readFile(path.join(REPO, 'test/helpers/collect-probe.mjs'), 'utf8');
    const name = cluster.member('controller').name;
    const r = JSON.parse(
      await docker([
        'exec',
        name,
        'node',
        '--max-semi-space-size=1',
        '--input-type=module',
        '-e',
        probe,
        '/opt/loopvol/dist/idle-gc.js',
      ]),
    ) as { garbage: number; after: number; rssBefore: number; rssAfter: number };
    const mib = (b: number): string => (b / 2 ** 20).toFixed(1);
    await report(
      "a full collection on the image's Node.js: heap in use, RSS (MiB)",
      `${mib(r.garbage)} → ${mib(r.after)}, ${mib(r.rssBefore)} → ${mib(r.rssAfter)}`,
    );
    expect(r.after).toBeLessThan(r.garbage - 32 * 2 ** 20);
    expect(r.rssAfter).toBeLessThan(r.rssBefore - 16 * 2 ** 20);
  });
});
