/**
 * The mapping from the shipped manifests to a container engine's flags (test/container/plan.ts), which
 * the container run (test/container/run.sh) uses to start the image exactly as the DaemonSet would.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { describe, expect, it } from 'vitest';
import { capabilitiesOf, dockerRunArgs, expandVars, flagValue, planFromManifest } from '../container/plan.js';
import { REPO } from '../helpers/driver.js';

const manifest = (variant: string, file: string) =>
  fs.readFile(path.join(REPO, 'deploy', 'kubernetes', variant, file), 'utf8');

const root = '/tmp/loopvol-container-x/host';
const rewrite = (node: string) => (p: string) =>
  p.startsWith('/var/lib/kubelet') ? `${root}/${node}${p}` : p === '/dev' ? p : `${root}${p}`;

describe('the node DaemonSet as a container', () => {
  it('keeps the kubelet directory and the pool at one path inside and outside, with their propagation', async () => {
    const plan = planFromManifest(await manifest('shared', 'node.yaml'), {
      fieldRefs: { 'spec.nodeName': 'node-1' },
      hostPath: rewrite('node-1'),
    });
    expect(plan.workload).toBe('DaemonSet/loopvol-node');
    expect(plan.privileged).toBe(true);
    expect(plan.env.NODE_ID).toBe('node-1');
    const byVolume = Object.fromEntries(plan.mounts.map((m) => [m.volume, m]));
    expect(byVolume['kubelet-dir']).toMatchObject({
      source: `${root}/node-1/var/lib/kubelet`,
      target: `${root}/node-1/var/lib/kubelet`,
      propagation: 'rshared',
    });
    expect(byVolume.pool).toMatchObject({
      source: `${root}/var/lib/loopvol/pool`,
      target: `${root}/var/lib/loopvol/pool`,
      propagation: 'rslave',
    });
    expect(byVolume['plugin-dir']).toMatchObject({
      source: `${root}/node-1/var/lib/kubelet/plugins/loopvol.csi.io`,
      target: '/csi',
      propagation: 'rprivate',
    });
    expect(byVolume.dev).toMatchObject({ source: '/dev', target: '/dev' });
    expect(plan.args).toContain('--nodeid=node-1');
    expect(flagValue(plan.args, 'pool-dir')).toBe(`${root}/var/lib/loopvol/pool`);
    expect(flagValue(plan.args, 'endpoint')).toBe('unix:///csi/csi.sock');
  });

  it('emulates privileged with the host’s capabilities, unconfined profiles and the loop device rules', async () => {
    const plan = planFromManifest(await manifest('shared', 'node.yaml'), {
      fieldRefs: { 'spec.nodeName': 'n' },
    });
    const args = dockerRunArgs(plan, {
      image: 'loopvol:t',
      name: 'n',
      privilege: { mode: 'emulated', capabilities: ['SYS_ADMIN', 'MKNOD'] },
    });
    expect(args).not.toContain('--privileged');
    expect(args.join(' ')).toContain('--cap-add SYS_ADMIN --cap-add MKNOD');
    expect(args.join(' ')).toContain('--device-cgroup-rule b 7:* rmw --device-cgroup-rule c 10:237 rmw');
    expect(args).toContain('seccomp=unconfined');
    expect(args).toContain(
      'type=bind,source=/var/lib/kubelet,target=/var/lib/kubelet,bind-propagation=rshared',
    );
    expect(args.slice(-plan.args.length - 1)).toEqual(['loopvol:t', ...plan.args]);
  });

  it('maps the controller’s emptyDir and read-only root', async () => {
    const plan = planFromManifest(await manifest('shared', 'controller.yaml'), {
      fieldRefs: {},
      emptyDir: (name) => `/tmp/e/${name}`,
    });
    expect(plan.readOnlyRootFilesystem).toBe(true);
    expect(plan.mounts.find((m) => m.volume === 'socket-dir')).toMatchObject({
      kind: 'emptyDir',
      source: '/tmp/e/socket-dir',
      target: '/csi',
    });
    expect(dockerRunArgs(plan, { image: 'i', name: 'c', privilege: { mode: 'full' } })).toContain(
      '--read-only',
    );
  });
});

describe('the pieces', () => {
  it('expands $(VAR) as the kubelet does', () => {
    expect(expandVars('--nodeid=$(NODE_ID)', { NODE_ID: 'w1' })).toBe('--nodeid=w1');
    expect(expandVars('$$(NODE_ID) $(MISSING)', { NODE_ID: 'w1' })).toBe('$(NODE_ID) $(MISSING)');
  });

  it('reads capabilities from a CapBnd mask', () => {
    const c = capabilitiesOf('000001fffeffffff');
    expect(c.lacks).toEqual(['SYS_RESOURCE']);
    expect(c.has).toContain('SYS_ADMIN');
    expect(c.has).toHaveLength(40);
    expect(c.unknownBits).toEqual([]);
  });
});
