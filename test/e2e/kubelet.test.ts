/**
 * End to end, the way Kubernetes drives a CSI driver: a controller process and two node processes
 * sharing one pool, the kubelet's own paths and call order, data checked at every step, through
 * expansion, snapshot and restore, for ext4, xfs, btrfs and raw block. Then what csi-sanity does not
 * cover: the spec's error code for each RPC's bad input, every RPC called twice, and nothing left over.
 *
 * The suite starts its own driver processes, or, with LOOPVOL_E2E_ENDPOINTS, runs against plugins
 * that someone else started (test/container/run.sh: the built image, started the way the manifests
 * start it), on the same kubelet-style paths:
 *   LOOPVOL_E2E_ENDPOINTS=controller=unix:///…,node-1=unix:///…,node-2=unix:///…
 *   LOOPVOL_E2E_ROOT=DIR     DIR/<node>/var/lib/kubelet is each node's kubelet directory, and
 *                            DIR/var/lib/loopvol/pool the pool they share
 * Either way every mount is checked from this process (the host's mount namespace), and the data
 * from the image file itself.
 */
import { execFileSync } from 'node:child_process';
import { createHash, randomUUID } from 'node:crypto';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import { type DriverProcess, startDriverProcess, tempDir } from '../helpers/driver.js';
import { codeOf, csiClients, type CsiClients } from '../helpers/grpc.js';
import { cleanupUnder, isMounted, isRoot, leaksUnder, MiB, sha256, writeRandom } from '../helpers/host.js';

const DRIVER = 'loopvol.csi.io';
const NODES = ['node-1', 'node-2'];
let root = '';
let ctl: CsiClients;
const nodes: Record<string, CsiClients> = {};
const drivers: DriverProcess[] = [];

/** `controller=unix:///a.sock,node-1=unix:///b.sock` → a map, or undefined when unset. */
function externalEndpoints(text = process.env.LOOPVOL_E2E_ENDPOINTS): Map<string, string> | undefined {
  if (!text) return undefined;
  const map = new Map(
    text.split(',').map((pair) => {
      const at = pair.indexOf('=');
      return [pair.slice(0, at).trim(), pair.slice(at + 1).trim()] as [string, string];
    }),
  );
  for (const want of ['controller', ...NODES]) {
    if (!map.get(want)) throw new Error(`LOOPVOL_E2E_ENDPOINTS names no ${want}`);
  }
  if (!process.env.LOOPVOL_E2E_ROOT) throw new Error('LOOPVOL_E2E_ENDPOINTS needs LOOPVOL_E2E_ROOT');
  return map;
}
const external = externalEndpoints();

/** The kubelet's directory for one node. */
const kubelet = (nodeName: string): string => path.join(root, nodeName, 'var/lib/kubelet');
/** The pool every process shares. */
const poolDir = (): string => path.join(root, 'var/lib/loopvol/pool');

beforeAll(async () => {
  if (!isRoot()) return;
  if (external) {
    root = process.env.LOOPVOL_E2E_ROOT ?? '';
    ctl = csiClients(external.get('controller') ?? '');
    for (const n of NODES) nodes[n] = csiClients(external.get(n) ?? '');
    return;
  }
  root = await tempDir('e2e');
  const start = async (args: Parameters<typeof startDriverProcess>[0]) => {
    const d = await startDriverProcess(args);
    drivers.push(d);
    return d;
  };
  ctl = (
    await start({
      dir: root,
      poolDir: poolDir(),
      mode: 'controller',
      socket: path.join(root, 'controller.sock'),
      logLevel: 'info',
    })
  ).clients;
  for (const n of NODES) {
    nodes[n] = (
      await start({
        dir: root,
        poolDir: poolDir(),
        mode: 'node',
        nodeId: n,
        socket: path.join(root, `${n}.sock`),
        logLevel: 'info',
      })
    ).clients;
  }
});

afterAll(async () => {
  if (!root) return;
  if (external) {
    // The plugins belong to whoever started them; what this suite made must be gone all the same.
    ctl.close();
    for (const n of NODES) nodes[n]?.close();
    expect(await leaksUnder(root)).toEqual({ loops: [], mounts: [] });
    return;
  }
  for (const d of drivers) await d.stop();
  const leaks = await cleanupUnder(root);
  await fs.rm(root, { recursive: true, force: true });
  expect(leaks).toEqual({ loops: [], mounts: [] });
});

function node(name: string): CsiClients {
  const n = nodes[name];
  if (!n) throw new Error(`no node ${name}`);
  return n;
}

/** The paths the kubelet uses for a volume (mount: globalmount + pod mount; block: volumeDevices). */
function kubeletPaths(nodeName: string, volumeId: string, pv: string, podUid: string, block: boolean) {
  const k = kubelet(nodeName);
  if (block) {
    return {
      staging: path.join(k, 'plugins/kubernetes.io/csi/volumeDevices/staging', pv),
      target: path.join(k, 'plugins/kubernetes.io/csi/volumeDevices/publish', pv, podUid),
    };
  }
  const hash = createHash('sha256').update(volumeId).digest('hex');
  return {
    staging: path.join(k, 'plugins/kubernetes.io/csi', DRIVER, hash, 'globalmount'),
    target: path.join(k, 'pods', podUid, 'volumes/kubernetes.io~csi', pv, 'mount'),
  };
}

const capFor = (kind: string): VolumeCapability =>
  kind === 'block'
    ? { block: {}, access_mode: { mode: 'SINGLE_NODE_MULTI_WRITER' } }
    : {
        mount: { fs_type: kind, mount_flags: ['noatime'] },
        access_mode: { mode: 'SINGLE_NODE_MULTI_WRITER' },
      };

/** What the kubelet and attach/detach controller do to run a pod with the volume on `nodeName`. */
async function attachAndMount(nodeName: string, volumeId: string, pv: string, kind: string) {
  const block = kind === 'block';
  const cap = capFor(kind);
  const podUid = randomUUID();
  const p = kubeletPaths(nodeName, volumeId, pv, podUid, block);
  const pub = await ctl.controller.ControllerPublishVolume({
    volume_id: volumeId,
    node_id: nodeName,
    volume_capability: cap,
  });
  // The kubelet creates the staging directory and the target's parent, never the target itself.
  await fs.mkdir(p.staging, { recursive: true });
  await fs.mkdir(path.dirname(p.target), { recursive: true });
  await node(nodeName).node.NodeStageVolume({
    volume_id: volumeId,
    staging_target_path: p.staging,
    volume_capability: cap,
    publish_context: pub.publish_context,
  });
  // Seen from this process, i.e. on the host: a plugin in a container must propagate its mounts here.
  expect(await isMounted(p.staging), `staging mount on the host: ${p.staging}`).toBe(!block);
  await node(nodeName).node.NodePublishVolume({
    volume_id: volumeId,
    staging_target_path: p.staging,
    target_path: p.target,
    volume_capability: cap,
    publish_context: pub.publish_context,
  });
  expect(await isMounted(p.target), `published mount on the host: ${p.target}`).toBe(true);
  return {
    ...p,
    async unmountAndDetach() {
      await node(nodeName).node.NodeUnpublishVolume({ volume_id: volumeId, target_path: p.target });
      await node(nodeName).node.NodeUnstageVolume({ volume_id: volumeId, staging_target_path: p.staging });
      await fs.rm(p.staging, { recursive: true, force: true }); // the kubelet removes what it made
      await ctl.controller.ControllerUnpublishVolume({ volume_id: volumeId, node_id: nodeName });
    },
  };
}

/** Writes data through the published volume (a file, or the block device itself) and returns its checksum. */
async function writeData(target: string, block: boolean, seed: number): Promise<string> {
  if (!block) return writeRandom(path.join(target, 'data.bin'), 16, seed);
  const scratch = path.join(root, `block-${seed}.bin`);
  const sum = await writeRandom(scratch, 16, seed);
  const data = await fs.readFile(scratch);
  await fs.rm(scratch);
  const dev = await fs.open(target, 'r+');
  await dev.write(data, 0, data.length, 0);
  await dev.sync();
  await dev.close();
  return sum;
}

/**
 * The checksum of what the volume's image file itself holds, read on the host with no driver involved
 * (the volume is unstaged): the raw bytes of a block volume, `data.bin` of a filesystem through a
 * read-only loop mount of the image that this function makes and removes.
 */
async function dataInImage(volumeId: string, kind: string): Promise<string> {
  const image = path.join(poolDir(), 'volumes', volumeId, 'disk.img');
  if (kind === 'block') {
    const f = await fs.open(image, 'r');
    const buf = Buffer.alloc(16 * MiB);
    await f.read(buf, 0, buf.length, 0);
    await f.close();
    return createHash('sha256').update(buf).digest('hex');
  }
  const sh = (cmd: string, args: string[]) => execFileSync(cmd, args, { encoding: 'utf8' }).trim();
  const mnt = path.join(root, `inspect-${volumeId}`);
  await fs.mkdir(mnt);
  const dev = sh('losetup', ['--find', '--show', '--read-only', image]);
  try {
    const opts = { ext4: 'ro,noload', xfs: 'ro,norecovery,nouuid', btrfs: 'ro' }[kind] ?? 'ro';
    sh('mount', ['-t', kind, '-o', opts, dev, mnt]);
    try {
      return await sha256(path.join(mnt, 'data.bin'));
    } finally {
      sh('umount', [mnt]);
    }
  } finally {
    sh('losetup', ['-d', dev]);
    await fs.rmdir(mnt);
  }
}

async function readData(target: string, block: boolean): Promise<string> {
  if (!block) return sha256(path.join(target, 'data.bin'));
  const dev = await fs.open(target, 'r');
  const buf = Buffer.alloc(16 * MiB);
  await dev.read(buf, 0, buf.length, 0);
  await dev.close();
  return createHash('sha256').update(buf).digest('hex');
}

async function sizeOf(target: string, block: boolean): Promise<number> {
  if (!block) {
    const st = await fs.statfs(target);
    return st.blocks * st.bsize;
  }
  const dev = await fs.open(target, 'r');
  const st = await dev.stat();
  await dev.close();
  const name = (await fs.readFile('/proc/self/mountinfo', 'utf8'))
    .split('\n')
    .find((l) => l.split(' ')[4] === target)
    ?.split(' ')[3];
  return name ? Number(await fs.readFile(`/sys/block${name}/size`, 'utf8')) * 512 : st.size;
}

const canGrowExt4Online = async (): Promise<boolean> => {
  const hex = /CapEff:\s*([0-9a-f]+)/.exec(await fs.readFile('/proc/self/status', 'utf8'))?.[1] ?? '0';
  return (BigInt(`0x${hex}`) & (1n << 24n)) !== 0n;
};

describe.skipIf(!isRoot()).each(['ext4', 'xfs', 'btrfs', 'block'])(
  'a %s volume through its whole life',
  (kind) => {
    const block = kind === 'block';
    const pv = `pvc-${randomUUID()}`;
    let volumeId = '';
    let sum = '';

    it('is provisioned with the provisioner’s parameters', async () => {
      const res = await ctl.controller.CreateVolume({
        name: pv,
        capacity_range: { required_bytes: String(320 * MiB) },
        volume_capabilities: [capFor(kind)],
        parameters: {
          'csi.storage.k8s.io/pvc/name': 'data',
          'csi.storage.k8s.io/pvc/namespace': 'e2e',
          'csi.storage.k8s.io/pv/name': pv,
        },
        accessibility_requirements: {
          requisite: [{ segments: { 'loopvol.csi.io/pool': 'default' } }],
          preferred: [],
        },
      });
      volumeId = res.volume?.volume_id ?? '';
      expect(res.volume?.capacity_bytes).toBe(String(320 * MiB));
    });

    it('is attached, staged and published on node-1, written, and taken down', async () => {
      const m = await attachAndMount('node-1', volumeId, pv, kind);
      expect((await fs.stat(m.target))[block ? 'isBlockDevice' : 'isDirectory']()).toBe(true);
      sum = await writeData(m.target, block, 42);
      await m.unmountAndDetach();
      await expect(fs.stat(m.target)).rejects.toThrow(/ENOENT/);
      expect(await isMounted(m.staging)).toBe(false);
      expect(await dataInImage(volumeId, kind), 'what was written through the target is in the image').toBe(
        sum,
      );
    });

    it('comes back with its data on the same node and then on node-2', async () => {
      for (const n of ['node-1', 'node-2']) {
        const m = await attachAndMount(n, volumeId, pv, kind);
        expect(await readData(m.target, block)).toBe(sum);
        await m.unmountAndDetach();
      }
    });

    it('grows while in use on node-2', async () => {
      const m = await attachAndMount('node-2', volumeId, pv, kind);
      const before = await sizeOf(m.target, block);
      const grown = 640 * MiB;
      const ce = await ctl.controller.ControllerExpandVolume({
        volume_id: volumeId,
        capacity_range: { required_bytes: String(grown) },
        volume_capability: capFor(kind),
      });
      expect(ce.node_expansion_required).toBe(true);
      const expand = () =>
        node('node-2').node.NodeExpandVolume({
          volume_id: volumeId,
          volume_path: m.target,
          staging_target_path: m.staging,
          capacity_range: { required_bytes: String(grown) },
          volume_capability: capFor(kind),
        });
      if (kind === 'ext4' && !(await canGrowExt4Online())) {
        expect(await codeOf(expand())).toBe('FAILED_PRECONDITION');
        await m.unmountAndDetach();
        const again = await attachAndMount('node-2', volumeId, pv, kind);
        expect((await sizeOf(again.target, block)) - before).toBeGreaterThan(280 * MiB);
        expect(await readData(again.target, block)).toBe(sum);
        await again.unmountAndDetach();
        return;
      }
      await expand();
      expect((await sizeOf(m.target, block)) - before).toBeGreaterThan(280 * MiB);
      expect(await readData(m.target, block)).toBe(sum);
      await m.unmountAndDetach();
    });

    it('is snapshotted, restored on node-1 with the data, and everything is deleted', async () => {
      const snap = await ctl.controller.CreateSnapshot({
        name: `snapshot-${pv}`,
        source_volume_id: volumeId,
      });
      const snapshotId = snap.snapshot?.snapshot_id ?? '';
      expect(snap.snapshot?.ready_to_use).toBe(true);
      const restoredPv = `pvc-${randomUUID()}`;
      const restored = await ctl.controller.CreateVolume({
        name: restoredPv,
        volume_capabilities: [capFor(kind)],
        capacity_range: { required_bytes: String(640 * MiB) },
        volume_content_source: { snapshot: { snapshot_id: snapshotId } },
      });
      const restoredId = restored.volume?.volume_id ?? '';
      const m = await attachAndMount('node-1', restoredId, restoredPv, kind);
      expect(await readData(m.target, block)).toBe(sum);
      await m.unmountAndDetach();
      for (const id of [restoredId, volumeId]) await ctl.controller.DeleteVolume({ volume_id: id });
      await ctl.controller.DeleteSnapshot({ snapshot_id: snapshotId });
      expect(await leaksUnder(root)).toEqual({ loops: [], mounts: [] });
    });
  },
);

// ---------------------------------------------------------------------------------------------
// Bad input: the spec's code for each RPC (table-driven).

type Call = (c: { ctl: CsiClients; n1: CsiClients }) => Promise<unknown>;
const GOOD_CAP = capFor('ext4');
const MISSING_VOL = 'vol-0123456789abcdef0123456789abcdef';
const HOSTILE_IDS = [
  '../../../etc/passwd',
  '/etc/shadow',
  'vol-../../x',
  'a'.repeat(5000),
  'vol-\u0000',
  '💾',
];

describe.skipIf(!isRoot())('the spec’s error codes for bad input', () => {
  let existing = '';
  let stagingDir = '';
  beforeAll(async () => {
    existing =
      (
        await ctl.controller.CreateVolume({
          name: 'e2e-errors',
          volume_capabilities: [GOOD_CAP],
          capacity_range: { required_bytes: String(16 * MiB) },
        })
      ).volume?.volume_id ?? '';
    stagingDir = path.join(kubelet('node-1'), 'errors-staging');
    await fs.mkdir(stagingDir, { recursive: true });
  });

  const cases: [string, Call, string][] = [
    [
      'CreateVolume without a name',
      ({ ctl }) => ctl.controller.CreateVolume({ volume_capabilities: [GOOD_CAP] }),
      'INVALID_ARGUMENT',
    ],
    [
      'CreateVolume without capabilities',
      ({ ctl }) => ctl.controller.CreateVolume({ name: 'x' }),
      'INVALID_ARGUMENT',
    ],
    [
      'CreateVolume with limit < required',
      ({ ctl }) =>
        ctl.controller.CreateVolume({
          name: 'x',
          volume_capabilities: [GOOD_CAP],
          capacity_range: { required_bytes: '10', limit_bytes: '5' },
        }),
      'OUT_OF_RANGE',
    ],
    [
      'CreateVolume from a missing snapshot',
      ({ ctl }) =>
        ctl.controller.CreateVolume({
          name: 'x',
          volume_capabilities: [GOOD_CAP],
          volume_content_source: { snapshot: { snapshot_id: 'non-existing-snapshot-id' } },
        }),
      'NOT_FOUND',
    ],
    [
      'CreateVolume for another pool',
      ({ ctl }) =>
        ctl.controller.CreateVolume({
          name: 'x',
          volume_capabilities: [GOOD_CAP],
          accessibility_requirements: {
            requisite: [{ segments: { 'loopvol.csi.io/pool': 'mars' } }],
            preferred: [],
          },
        }),
      'RESOURCE_EXHAUSTED',
    ],
    [
      'CreateVolume with an existing name and another size',
      ({ ctl }) =>
        ctl.controller.CreateVolume({
          name: 'e2e-errors',
          volume_capabilities: [GOOD_CAP],
          capacity_range: { required_bytes: String(32 * MiB) },
        }),
      'ALREADY_EXISTS',
    ],
    ['DeleteVolume without an id', ({ ctl }) => ctl.controller.DeleteVolume({}), 'INVALID_ARGUMENT'],
    [
      'ControllerPublishVolume without a volume id',
      ({ ctl }) => ctl.controller.ControllerPublishVolume({ node_id: 'node-1', volume_capability: GOOD_CAP }),
      'INVALID_ARGUMENT',
    ],
    [
      'ControllerPublishVolume without a node id',
      ({ ctl }) =>
        ctl.controller.ControllerPublishVolume({ volume_id: MISSING_VOL, volume_capability: GOOD_CAP }),
      'INVALID_ARGUMENT',
    ],
    [
      'ControllerPublishVolume without a capability',
      ({ ctl }) => ctl.controller.ControllerPublishVolume({ volume_id: MISSING_VOL, node_id: 'node-1' }),
      'INVALID_ARGUMENT',
    ],
    [
      'ControllerPublishVolume of a missing volume',
      ({ ctl }) =>
        ctl.controller.ControllerPublishVolume({
          volume_id: MISSING_VOL,
          node_id: 'node-1',
          volume_capability: GOOD_CAP,
        }),
      'NOT_FOUND',
    ],
    [
      'ControllerUnpublishVolume without an id',
      ({ ctl }) => ctl.controller.ControllerUnpublishVolume({ node_id: 'node-1' }),
      'INVALID_ARGUMENT',
    ],
    [
      'ValidateVolumeCapabilities without an id',
      ({ ctl }) => ctl.controller.ValidateVolumeCapabilities({ volume_capabilities: [GOOD_CAP] }),
      'INVALID_ARGUMENT',
    ],
    [
      'ValidateVolumeCapabilities of a missing volume',
      ({ ctl }) =>
        ctl.controller.ValidateVolumeCapabilities({
          volume_id: MISSING_VOL,
          volume_capabilities: [GOOD_CAP],
        }),
      'NOT_FOUND',
    ],
    [
      'ListVolumes with a forged token',
      ({ ctl }) => ctl.controller.ListVolumes({ starting_token: 'forged' }),
      'ABORTED',
    ],
    [
      'GetCapacity with an unknown parameter',
      ({ ctl }) => ctl.controller.GetCapacity({ parameters: { turbo: 'yes' } }),
      'INVALID_ARGUMENT',
    ],
    [
      'ControllerGetVolume without an id',
      ({ ctl }) => ctl.controller.ControllerGetVolume({}),
      'INVALID_ARGUMENT',
    ],
    [
      'ControllerGetVolume of a missing volume',
      ({ ctl }) => ctl.controller.ControllerGetVolume({ volume_id: MISSING_VOL }),
      'NOT_FOUND',
    ],
    [
      'ControllerExpandVolume without a range',
      ({ ctl }) => ctl.controller.ControllerExpandVolume({ volume_id: MISSING_VOL }),
      'INVALID_ARGUMENT',
    ],
    [
      'ControllerExpandVolume of a missing volume',
      ({ ctl }) =>
        ctl.controller.ControllerExpandVolume({
          volume_id: MISSING_VOL,
          capacity_range: { required_bytes: '1' },
        }),
      'NOT_FOUND',
    ],
    [
      'ControllerModifyVolume with an unknown key',
      ({ ctl }) =>
        ctl.controller.ControllerModifyVolume({ volume_id: MISSING_VOL, mutable_parameters: { turbo: '1' } }),
      'INVALID_ARGUMENT',
    ],
    [
      'ControllerModifyVolume of a missing volume',
      ({ ctl }) =>
        ctl.controller.ControllerModifyVolume({
          volume_id: MISSING_VOL,
          mutable_parameters: { allocation: 'sparse' },
        }),
      'NOT_FOUND',
    ],
    [
      'CreateSnapshot without a name',
      ({ ctl }) => ctl.controller.CreateSnapshot({ source_volume_id: MISSING_VOL }),
      'INVALID_ARGUMENT',
    ],
    [
      'CreateSnapshot without a source',
      ({ ctl }) => ctl.controller.CreateSnapshot({ name: 's' }),
      'INVALID_ARGUMENT',
    ],
    [
      'CreateSnapshot of a missing volume',
      ({ ctl }) => ctl.controller.CreateSnapshot({ name: 's', source_volume_id: MISSING_VOL }),
      'NOT_FOUND',
    ],
    ['DeleteSnapshot without an id', ({ ctl }) => ctl.controller.DeleteSnapshot({}), 'INVALID_ARGUMENT'],
    [
      'ListSnapshots with a forged token',
      ({ ctl }) => ctl.controller.ListSnapshots({ starting_token: 'forged' }),
      'ABORTED',
    ],
    [
      'GetSnapshot of a missing snapshot',
      ({ ctl }) => ctl.controller.GetSnapshot({ snapshot_id: 'snap-0123456789abcdef0123456789abcdef' }),
      'NOT_FOUND',
    ],
    [
      'CreateVolumeGroupSnapshot without sources',
      ({ ctl }) => ctl.group.CreateVolumeGroupSnapshot({ name: 'g' }),
      'INVALID_ARGUMENT',
    ],
    [
      'CreateVolumeGroupSnapshot of a missing volume',
      ({ ctl }) => ctl.group.CreateVolumeGroupSnapshot({ name: 'g', source_volume_ids: [MISSING_VOL] }),
      'NOT_FOUND',
    ],
    [
      'GetVolumeGroupSnapshot of a missing group',
      ({ ctl }) => ctl.group.GetVolumeGroupSnapshot({ group_snapshot_id: 'group-0123' }),
      'NOT_FOUND',
    ],
    [
      'DeleteVolumeGroupSnapshot without an id',
      ({ ctl }) => ctl.group.DeleteVolumeGroupSnapshot({}),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeStageVolume without a staging path',
      ({ n1 }) => n1.node.NodeStageVolume({ volume_id: MISSING_VOL, volume_capability: GOOD_CAP }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeStageVolume with a relative staging path',
      ({ n1 }) =>
        n1.node.NodeStageVolume({
          volume_id: MISSING_VOL,
          staging_target_path: 'rel/path',
          volume_capability: GOOD_CAP,
        }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeStageVolume without a capability',
      ({ n1 }) => n1.node.NodeStageVolume({ volume_id: MISSING_VOL, staging_target_path: '/tmp/x' }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeStageVolume with an unsafe mount flag',
      ({ n1 }) =>
        n1.node.NodeStageVolume({
          volume_id: MISSING_VOL,
          staging_target_path: '/tmp/x',
          volume_capability: {
            mount: { fs_type: 'ext4', mount_flags: ['rbind'] },
            access_mode: { mode: 'SINGLE_NODE_WRITER' },
          },
        }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeStageVolume of a missing volume',
      ({ n1 }) =>
        n1.node.NodeStageVolume({
          volume_id: MISSING_VOL,
          staging_target_path: '/tmp/x',
          volume_capability: GOOD_CAP,
        }),
      'NOT_FOUND',
    ],
    [
      'NodeUnstageVolume without a path',
      ({ n1 }) => n1.node.NodeUnstageVolume({ volume_id: MISSING_VOL }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeUnstageVolume of a missing volume',
      ({ n1 }) => n1.node.NodeUnstageVolume({ volume_id: MISSING_VOL, staging_target_path: '/tmp/x' }),
      'NOT_FOUND',
    ],
    [
      'NodePublishVolume without a target',
      ({ n1 }) =>
        n1.node.NodePublishVolume({
          volume_id: MISSING_VOL,
          staging_target_path: '/tmp/x',
          volume_capability: GOOD_CAP,
        }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodePublishVolume without a staging path',
      ({ n1 }) =>
        n1.node.NodePublishVolume({
          volume_id: MISSING_VOL,
          target_path: '/tmp/y',
          volume_capability: GOOD_CAP,
        }),
      'FAILED_PRECONDITION',
    ],
    [
      'NodePublishVolume of a missing volume',
      ({ n1 }) =>
        n1.node.NodePublishVolume({
          volume_id: MISSING_VOL,
          staging_target_path: '/tmp/x',
          target_path: '/tmp/y',
          volume_capability: GOOD_CAP,
        }),
      'NOT_FOUND',
    ],
    [
      'NodeUnpublishVolume without a target',
      ({ n1 }) => n1.node.NodeUnpublishVolume({ volume_id: MISSING_VOL }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeUnpublishVolume of a missing volume',
      ({ n1 }) =>
        n1.node.NodeUnpublishVolume({ volume_id: MISSING_VOL, target_path: '/tmp/nothing-here-e2e' }),
      'NOT_FOUND',
    ],
    [
      'NodeGetVolumeStats without a path',
      ({ n1 }) => n1.node.NodeGetVolumeStats({ volume_id: MISSING_VOL }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeGetVolumeStats of a missing volume',
      ({ n1 }) => n1.node.NodeGetVolumeStats({ volume_id: MISSING_VOL, volume_path: '/tmp' }),
      'NOT_FOUND',
    ],
    [
      'NodeExpandVolume without a path',
      ({ n1 }) => n1.node.NodeExpandVolume({ volume_id: MISSING_VOL }),
      'INVALID_ARGUMENT',
    ],
    [
      'NodeExpandVolume of a missing volume',
      ({ n1 }) => n1.node.NodeExpandVolume({ volume_id: MISSING_VOL, volume_path: '/tmp' }),
      'NOT_FOUND',
    ],
  ];

  it.each(cases)('%s → %s', async (_what, call, code) => {
    expect(await codeOf(call({ ctl, n1: node('node-1') }))).toBe(code);
  });

  it('publishes nothing before staging, and refuses an existing volume on a node it is not published to', async () => {
    const target = path.join(kubelet('node-1'), 'errors-target');
    expect(
      await codeOf(
        node('node-1').node.NodePublishVolume({
          volume_id: existing,
          staging_target_path: stagingDir,
          target_path: target,
          volume_capability: GOOD_CAP,
        }),
      ),
    ).toBe('FAILED_PRECONDITION');
    await ctl.controller.ControllerPublishVolume({
      volume_id: existing,
      node_id: 'node-1',
      volume_capability: GOOD_CAP,
    });
    const refusals: [string, boolean, string][] = [
      ['node-2', false, 'FAILED_PRECONDITION'], // a single-node volume published elsewhere
      ['node-1', true, 'ALREADY_EXISTS'], // the same node with other arguments
      ['no-such-node', false, 'NOT_FOUND'],
    ];
    for (const [nodeId, readonly, code] of refusals) {
      const call = ctl.controller.ControllerPublishVolume({
        volume_id: existing,
        node_id: nodeId,
        volume_capability: GOOD_CAP,
        readonly,
      });
      expect(await codeOf(call), `${nodeId} readonly=${String(readonly)}`).toBe(code);
    }
    await ctl.controller.ControllerUnpublishVolume({ volume_id: existing, node_id: 'node-1' });
  });

  it.each(HOSTILE_IDS)('treats the hostile id %j as absent, touching no path', async (id) => {
    const before = await fs.readdir(poolDir());
    expect(await codeOf(ctl.controller.DeleteVolume({ volume_id: id }))).toBe('OK');
    expect(await codeOf(ctl.controller.ControllerGetVolume({ volume_id: id }))).toBe('NOT_FOUND');
    expect(await codeOf(ctl.controller.DeleteSnapshot({ snapshot_id: id }))).toBe('OK');
    expect(
      await codeOf(
        node('node-1').node.NodeStageVolume({
          volume_id: id,
          staging_target_path: stagingDir,
          volume_capability: GOOD_CAP,
        }),
      ),
    ).toBe('NOT_FOUND');
    expect(
      await codeOf(node('node-1').node.NodeUnstageVolume({ volume_id: id, staging_target_path: stagingDir })),
    ).toBe('NOT_FOUND');
    expect(await fs.readdir(poolDir())).toEqual(before);
    await expect(fs.stat('/etc/passwd')).resolves.toBeTruthy();
  });

  it('accepts any name, however odd, as a name', async () => {
    for (const name of ['名前/../../etc', 'a'.repeat(1000), ' leading space', 'x\ny']) {
      const v = await ctl.controller.CreateVolume({
        name,
        volume_capabilities: [capFor('block')],
        capacity_range: { required_bytes: String(MiB) },
      });
      expect(v.volume?.volume_id).toMatch(/^vol-[0-9a-f]{32}$/);
      await ctl.controller.DeleteVolume({ volume_id: v.volume?.volume_id ?? '' });
    }
  });
});

// ---------------------------------------------------------------------------------------------
// Every RPC twice: the second call must agree with the first.

describe.skipIf(!isRoot())('every RPC called twice', () => {
  it('gives the same answer the second time, for each step of a volume’s life', async () => {
    const cap = capFor('ext4');
    const twice = async <T>(what: string, call: () => Promise<T>): Promise<T> => {
      const a = await call();
      const b = await call();
      expect(JSON.stringify(b), what).toBe(JSON.stringify(a));
      return b;
    };
    const vol = await twice('CreateVolume', () =>
      ctl.controller.CreateVolume({
        name: 'twice',
        volume_capabilities: [cap],
        capacity_range: { required_bytes: String(32 * MiB) },
      }),
    );
    const id = vol.volume?.volume_id ?? '';
    await twice('ValidateVolumeCapabilities', () =>
      ctl.controller.ValidateVolumeCapabilities({ volume_id: id, volume_capabilities: [cap] }),
    );
    await twice('ControllerModifyVolume', () =>
      ctl.controller.ControllerModifyVolume({
        volume_id: id,
        mutable_parameters: { allocation: 'preallocate' },
      }),
    );
    await twice('ControllerPublishVolume', () =>
      ctl.controller.ControllerPublishVolume({
        volume_id: id,
        node_id: 'node-1',
        volume_capability: cap,
      }),
    );
    const p = kubeletPaths('node-1', id, 'twice', randomUUID(), false);
    await fs.mkdir(p.staging, { recursive: true });
    await fs.mkdir(path.dirname(p.target), { recursive: true });
    await twice('NodeStageVolume', () =>
      node('node-1').node.NodeStageVolume({
        volume_id: id,
        staging_target_path: p.staging,
        volume_capability: cap,
      }),
    );
    await twice('NodePublishVolume', () =>
      node('node-1').node.NodePublishVolume({
        volume_id: id,
        staging_target_path: p.staging,
        target_path: p.target,
        volume_capability: cap,
      }),
    );
    await twice('ControllerExpandVolume', () =>
      ctl.controller.ControllerExpandVolume({
        volume_id: id,
        capacity_range: { required_bytes: String(64 * MiB) },
      }),
    );
    await codeOf(node('node-1').node.NodeExpandVolume({ volume_id: id, volume_path: p.target }));
    const s = await twice('CreateSnapshot', () =>
      ctl.controller.CreateSnapshot({ name: 'twice-snap', source_volume_id: id }),
    );
    await twice('GetSnapshot', () =>
      ctl.controller.GetSnapshot({ snapshot_id: s.snapshot?.snapshot_id ?? '' }),
    );
    const g = await twice('CreateVolumeGroupSnapshot', () =>
      ctl.group.CreateVolumeGroupSnapshot({ name: 'twice-group', source_volume_ids: [id] }),
    );
    await twice('DeleteVolumeGroupSnapshot', () =>
      ctl.group.DeleteVolumeGroupSnapshot({
        group_snapshot_id: g.group_snapshot?.group_snapshot_id ?? '',
      }),
    );
    await twice('NodeUnpublishVolume', () =>
      node('node-1').node.NodeUnpublishVolume({ volume_id: id, target_path: p.target }),
    );
    await twice('NodeUnstageVolume', () =>
      node('node-1').node.NodeUnstageVolume({ volume_id: id, staging_target_path: p.staging }),
    );
    await twice('ControllerUnpublishVolume', () =>
      ctl.controller.ControllerUnpublishVolume({ volume_id: id, node_id: 'node-1' }),
    );
    await twice('DeleteSnapshot', () =>
      ctl.controller.DeleteSnapshot({ snapshot_id: s.snapshot?.snapshot_id ?? '' }),
    );
    await twice('DeleteVolume', () => ctl.controller.DeleteVolume({ volume_id: id }));
    for (const [what, call] of [
      ['GetPluginInfo', () => ctl.identity.GetPluginInfo({})],
      ['GetPluginCapabilities', () => ctl.identity.GetPluginCapabilities({})],
      ['Probe', () => ctl.identity.Probe({})],
      ['ControllerGetCapabilities', () => ctl.controller.ControllerGetCapabilities({})],
      ['GroupControllerGetCapabilities', () => ctl.group.GroupControllerGetCapabilities({})],
      ['NodeGetCapabilities', () => node('node-1').node.NodeGetCapabilities({})],
      ['NodeGetInfo', () => node('node-1').node.NodeGetInfo({})],
      ['ListVolumes', () => ctl.controller.ListVolumes({})],
      ['ListSnapshots', () => ctl.controller.ListSnapshots({})],
    ] as const) {
      await twice(what, call as () => Promise<unknown>);
    }
    expect(await leaksUnder(root)).toEqual({ loops: [], mounts: [] });
  });
});
