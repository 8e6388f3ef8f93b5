/**
 * The Kubernetes packaging, checked without a cluster: every manifest parses (a YAML parser, not
 * regexes); each variant is rendered the way `kubectl apply -k` would (resources, the images component,
 * namespace, patches) and held to the invariants whose breakage breaks installs.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { parseAllDocuments } from 'yaml';
import { beforeAll, describe, expect, it } from 'vitest';
import { NODE_TOOLS, CONTROLLER_TOOLS } from '../../src/health.js';
import { REPO, runMain } from '../helpers/driver.js';

type Obj = Record<string, unknown> & {
  kind: string;
  apiVersion: string;
  metadata: { name: string; namespace?: string };
};
interface Container {
  name: string;
  image: string;
  args?: string[];
  env?: { name: string }[];
  securityContext?: { privileged?: boolean };
  volumeMounts?: { name: string; mountPath: string; mountPropagation?: string }[];
}
interface PodSpec {
  serviceAccountName?: string;
  containers: Container[];
  volumes?: { name: string; hostPath?: { path: string }; emptyDir?: unknown }[];
}

const DEPLOY = path.join(REPO, 'deploy', 'kubernetes');
const DRIVER = 'loopvol.csi.io';
const CLUSTER_SCOPED = new Set([
  'Namespace',
  'CSIDriver',
  'ClusterRole',
  'ClusterRoleBinding',
  'StorageClass',
  'VolumeSnapshotClass',
  'VolumeAttributesClass',
]);
const KNOWN_KINDS = new Set([
  ...CLUSTER_SCOPED,
  'ServiceAccount',
  'Role',
  'RoleBinding',
  'Deployment',
  'DaemonSet',
  'PersistentVolumeClaim',
  'Pod',
  'VolumeSnapshot',
]);

async function loadDocs(file: string): Promise<Obj[]> {
  const text = await fs.readFile(file, 'utf8');
  const docs = parseAllDocuments(text);
  for (const d of docs)
    if (d.errors.length > 0) throw new Error(`${file}: ${d.errors[0]?.message ?? 'YAML error'}`);
  return docs.map((d) => d.toJS() as Obj | null).filter((d): d is Obj => d !== null);
}

interface Rendered {
  docs: Obj[];
  images: Map<string, { newName?: string; newTag?: string }>;
}

/** A small `kustomize build`: resources, components' images, namespace and JSON6902 patches. */
async function render(dir: string): Promise<Rendered> {
  const [k] = await loadDocs(path.join(dir, 'kustomization.yaml'));
  if (!k) throw new Error(`no kustomization in ${dir}`);
  const docs: Obj[] = [];
  const images = new Map<string, { newName?: string; newTag?: string }>();
  for (const r of (k.resources as string[] | undefined) ?? []) {
    const p = path.join(dir, r);
    if ((await fs.stat(p)).isDirectory()) {
      const sub = await render(p);
      docs.push(...sub.docs);
      for (const [n, i] of sub.images) images.set(n, i);
    } else {
      docs.push(...(await loadDocs(p)));
    }
  }
  for (const c of (k.components as string[] | undefined) ?? []) {
    const [comp] = await loadDocs(path.join(dir, c, 'kustomization.yaml'));
    expect(comp?.kind).toBe('Component');
    for (const i of (comp?.images as { name: string; newName?: string; newTag?: string }[] | undefined) ?? [])
      images.set(i.name, i);
  }
  for (const d of docs) {
    for (const c of podSpec(d)?.containers ?? []) {
      const img = images.get(c.image);
      if (img) c.image = `${img.newName ?? c.image}:${img.newTag ?? 'latest'}`;
    }
    if (typeof k.namespace === 'string' && !CLUSTER_SCOPED.has(d.kind)) d.metadata.namespace = k.namespace;
  }
  for (const p of (k.patches as { target: { kind: string; name: string }; patch: string }[] | undefined) ??
    []) {
    const ops = (parseAllDocuments(p.patch)[0]?.toJS() ?? []) as {
      op: string;
      path: string;
      value: unknown;
    }[];
    for (const d of docs.filter((x) => x.kind === p.target.kind && x.metadata.name === p.target.name)) {
      for (const op of ops) {
        expect(op.op).toBe('replace');
        const keys = op.path.split('/').slice(1);
        let at: Record<string, unknown> = d;
        for (const key of keys.slice(0, -1)) at = at[key] as Record<string, unknown>;
        const last = keys.at(-1) ?? '';
        expect(last in at, `${op.path} exists in ${d.kind}/${d.metadata.name}`).toBe(true);
        at[last] = op.value;
      }
    }
  }
  return { docs, images };
}

function podSpec(d: Obj): PodSpec | undefined {
  if (d.kind === 'Deployment' || d.kind === 'DaemonSet') {
    return (d.spec as { template: { spec: PodSpec } }).template.spec;
  }
  if (d.kind === 'Pod') return d.spec as PodSpec;
  return undefined;
}

const workloads = (r: Rendered) =>
  r.docs
    .filter((d) => d.kind === 'Deployment' || d.kind === 'DaemonSet')
    .map((d) => ({ d, spec: podSpec(d) as PodSpec }));

const argValue = (c: Container, flag: string): string | undefined =>
  c.args?.find((a) => a.startsWith(`${flag}=`))?.slice(flag.length + 1);

/** Where a path inside a container lives: the volume mounted over it and the path within that volume. */
function resolve(c: Container, p: string): { volume: string; rel: string } | undefined {
  const m = (c.volumeMounts ?? [])
    .filter((v) => p === v.mountPath || p.startsWith(`${v.mountPath.replace(/\/$/, '')}/`))
    .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
  return m ? { volume: m.name, rel: path.relative(m.mountPath, p) } : undefined;
}

type Rule = [group: string, resource: string, verbs: string[]];
const LEASES: Rule = [
  'coordination.k8s.io',
  'leases',
  ['get', 'watch', 'list', 'delete', 'update', 'create'],
];

/** What each sidecar needs, from its own deploy/kubernetes/rbac.yaml, given how it is started. */
function requiredRules(c: Container): Rule[] {
  const le = c.args?.includes('--leader-election') ? [LEASES] : [];
  const name = c.image.split('/').pop()?.split(':')[0] ?? '';
  switch (name) {
    case 'csi-provisioner': {
      const capacity: Rule[] = c.args?.includes('--enable-capacity')
        ? [
            [
              'storage.k8s.io',
              'csistoragecapacities',
              ['get', 'list', 'watch', 'create', 'update', 'patch', 'delete'],
            ],
            ['', 'pods', ['get']],
            ...(argValue(c, '--capacity-ownerref-level') === '2'
              ? [['apps', 'replicasets', ['get']] as Rule]
              : []),
          ]
        : [];
      return [
        ['', 'persistentvolumes', ['get', 'list', 'watch', 'create', 'patch', 'delete']],
        ['', 'persistentvolumeclaims', ['get', 'list', 'watch', 'update']],
        ['storage.k8s.io', 'storageclasses', ['get', 'list', 'watch']],
        ['', 'events', ['list', 'watch', 'create', 'update', 'patch']],
        ['snapshot.storage.k8s.io', 'volumesnapshots', ['get', 'list', 'watch', 'update']],
        ['snapshot.storage.k8s.io', 'volumesnapshotcontents', ['get', 'list']],
        ['storage.k8s.io', 'csinodes', ['get', 'list', 'watch']],
        ['', 'nodes', ['get', 'list', 'watch']],
        ['storage.k8s.io', 'volumeattachments', ['get', 'list', 'watch']],
        ['storage.k8s.io', 'volumeattributesclasses', ['get']],
        ...capacity,
        ...le,
      ];
    }
    case 'csi-attacher':
      return [
        ['', 'persistentvolumes', ['get', 'list', 'watch', 'patch']],
        ['storage.k8s.io', 'csinodes', ['get', 'list', 'watch']],
        ['storage.k8s.io', 'volumeattachments', ['get', 'list', 'watch', 'patch']],
        ['storage.k8s.io', 'volumeattachments/status', ['patch']],
        ...le,
      ];
    case 'csi-resizer':
      return [
        ['', 'persistentvolumes', ['get', 'list', 'watch', 'patch']],
        ['', 'persistentvolumeclaims', ['get', 'list', 'watch']],
        ['', 'persistentvolumeclaims/status', ['patch']],
        ['', 'pods', ['get', 'list', 'watch']],
        ['', 'events', ['list', 'watch', 'create', 'update', 'patch']],
        ['storage.k8s.io', 'volumeattributesclasses', ['get', 'list', 'watch']],
        ...le,
      ];
    case 'csi-snapshotter':
      return [
        ['', 'events', ['list', 'watch', 'create', 'update', 'patch']],
        ['snapshot.storage.k8s.io', 'volumesnapshotclasses', ['get', 'list', 'watch']],
        ['snapshot.storage.k8s.io', 'volumesnapshotcontents', ['get', 'list', 'watch', 'update', 'patch']],
        ['snapshot.storage.k8s.io', 'volumesnapshotcontents/status', ['update', 'patch']],
        ['groupsnapshot.storage.k8s.io', 'volumegroupsnapshotclasses', ['get', 'list', 'watch']],
        [
          'groupsnapshot.storage.k8s.io',
          'volumegroupsnapshotcontents',
          ['get', 'list', 'watch', 'update', 'patch'],
        ],
        ['groupsnapshot.storage.k8s.io', 'volumegroupsnapshotcontents/status', ['update', 'patch']],
        ...le,
      ];
    default:
      return []; // node-driver-registrar, livenessprobe and loopvol use no API
  }
}

/** group/resource/verb triples the ServiceAccount holds, through any binding in the rendered variant. */
function granted(r: Rendered, sa: string, namespace: string): Set<string> {
  const out = new Set<string>();
  for (const b of r.docs.filter((d) => d.kind === 'ClusterRoleBinding' || d.kind === 'RoleBinding')) {
    const subjects = (b.subjects as { kind: string; name: string; namespace?: string }[] | undefined) ?? [];
    if (!subjects.some((s) => s.kind === 'ServiceAccount' && s.name === sa && s.namespace === namespace))
      continue;
    const ref = b.roleRef as { kind: string; name: string };
    const role = r.docs.find((d) => d.kind === ref.kind && d.metadata.name === ref.name);
    expect(role, `${b.kind} ${b.metadata.name} refers to ${ref.kind} ${ref.name}`).toBeDefined();
    for (const rule of (role?.rules as
      { apiGroups: string[]; resources: string[]; verbs: string[] }[] | undefined) ?? []) {
      for (const g of rule.apiGroups)
        for (const res of rule.resources) for (const v of rule.verbs) out.add(`${g}/${res}/${v}`);
    }
  }
  return out;
}

const VARIANTS = ['shared', 'local'];
let help = '';
const rendered = new Map<string, Rendered>();

beforeAll(async () => {
  help = (await runMain(['--help'])).stdout;
  for (const v of VARIANTS) rendered.set(v, await render(path.join(DEPLOY, v)));
});

const variant = (v: string): Rendered => {
  const r = rendered.get(v);
  if (!r) throw new Error(`variant ${v} not rendered`);
  return r;
};

describe.each(VARIANTS)('the %s variant', (v) => {
  it('has only known kinds, names and namespaces', () => {
    const r = variant(v);
    for (const d of r.docs) {
      expect(KNOWN_KINDS.has(d.kind), d.kind).toBe(true);
      expect(d.metadata.name).toMatch(/^[a-z0-9][a-z0-9.-]*$/);
      if (!CLUSTER_SCOPED.has(d.kind))
        expect(d.metadata.namespace, `${d.kind}/${d.metadata.name}`).toBe('loopvol');
    }
    expect(r.docs.filter((d) => d.kind === 'CSIDriver').map((d) => d.metadata.name)).toEqual([DRIVER]);
  });

  it('pins every image to a release tag in one place', async () => {
    const r = variant(v);
    const pkg = JSON.parse(await fs.readFile(path.join(REPO, 'package.json'), 'utf8')) as { version: string };
    for (const { spec } of workloads(r)) {
      for (const c of spec.containers) {
        expect(c.image, c.name).toMatch(/:(v?\d+\.\d+\.\d+)$/);
        expect(c.image).not.toMatch(/:latest$/);
        if (c.name === 'loopvol') expect(c.image.endsWith(`:${pkg.version}`)).toBe(true);
      }
    }
    // The manifests carry image names only; tags live in components/images.
    for (const file of ['shared/controller.yaml', 'shared/node.yaml', 'local/node.yaml']) {
      expect(await fs.readFile(path.join(DEPLOY, file), 'utf8')).not.toMatch(/image: \S+:\S+/);
    }
  });

  it('points every sidecar at the socket the driver serves', () => {
    for (const { d, spec } of workloads(variant(v))) {
      const driver = spec.containers.find((c) => c.name === 'loopvol');
      if (!driver) throw new Error(`${d.metadata.name} has no loopvol container`);
      const endpoint = argValue(driver, '--endpoint') ?? '';
      expect(endpoint).toMatch(/^unix:\/\/\//);
      const socket = resolve(driver, endpoint.slice('unix://'.length));
      expect(socket).toBeDefined();
      for (const c of spec.containers.filter((x) => x !== driver)) {
        const address = argValue(c, '--csi-address');
        expect(address, `${c.name} has --csi-address`).toBeDefined();
        expect(resolve(c, address ?? ''), `${d.metadata.name}/${c.name}`).toEqual(socket);
      }
    }
  });

  it('registers the driver with the kubelet where the DaemonSet puts its socket', () => {
    const ds = workloads(variant(v)).find(({ d }) => d.kind === 'DaemonSet');
    if (!ds) throw new Error('no DaemonSet');
    const registrar = ds.spec.containers.find((c) => c.image.includes('csi-node-driver-registrar'));
    const driver = ds.spec.containers.find((c) => c.name === 'loopvol');
    if (!registrar || !driver) throw new Error('no registrar or driver');
    const registration = argValue(registrar, '--kubelet-registration-path') ?? '';
    const socket = resolve(driver, (argValue(driver, '--endpoint') ?? '').slice('unix://'.length));
    const hostPath = ds.spec.volumes?.find((vol) => vol.name === socket?.volume)?.hostPath?.path;
    expect(path.join(hostPath ?? '?', socket?.rel ?? '?')).toBe(registration);
    expect(registration).toBe(`/var/lib/kubelet/plugins/${DRIVER}/csi.sock`);
    const regDir = resolve(registrar, '/registration');
    expect(ds.spec.volumes?.find((vol) => vol.name === regDir?.volume)?.hostPath?.path).toBe(
      '/var/lib/kubelet/plugins_registry',
    );
  });

  it('uses one driver name everywhere', () => {
    for (const { spec } of workloads(variant(v))) {
      const driver = spec.containers.find((c) => c.name === 'loopvol');
      expect(argValue(driver as Container, '--driver-name') ?? DRIVER).toBe(DRIVER);
    }
  });

  it('makes only the node plugin privileged, with Bidirectional propagation on the kubelet directory', () => {
    for (const { d, spec } of workloads(variant(v))) {
      for (const c of spec.containers) {
        const privileged = c.securityContext?.privileged === true;
        expect(privileged, `${d.metadata.name}/${c.name}`).toBe(
          d.kind === 'DaemonSet' && c.name === 'loopvol',
        );
      }
      if (d.kind === 'DaemonSet') {
        const driver = spec.containers.find((c) => c.name === 'loopvol');
        const kubelet = driver?.volumeMounts?.find((m) => m.mountPath === '/var/lib/kubelet');
        expect(kubelet?.mountPropagation).toBe('Bidirectional');
        expect(spec.volumes?.find((vol) => vol.name === kubelet?.name)?.hostPath?.path).toBe(
          '/var/lib/kubelet',
        );
        for (const p of ['/dev', '/var/lib/loopvol/pool'])
          expect(resolve(driver as Container, p), p).toBeDefined();
        for (const c of spec.containers.filter((x) => x !== driver)) {
          expect(
            c.volumeMounts?.some((m) => m.mountPropagation === 'Bidirectional'),
            c.name,
          ).toBe(false);
        }
      }
    }
  });

  it('grants each ServiceAccount what its sidecars need, and nothing more', () => {
    const r = variant(v);
    for (const { d, spec } of workloads(r)) {
      const sa = spec.serviceAccountName ?? 'default';
      expect(r.docs.some((x) => x.kind === 'ServiceAccount' && x.metadata.name === sa)).toBe(true);
      const have = granted(r, sa, d.metadata.namespace ?? '');
      const need = new Set<string>();
      for (const c of spec.containers) {
        for (const [g, res, verbs] of requiredRules(c)) {
          for (const verb of verbs) {
            need.add(`${g}/${res}/${verb}`);
            expect(have.has(`${g}/${res}/${verb}`), `${d.metadata.name}/${c.name} needs ${verb} ${res}`).toBe(
              true,
            );
          }
        }
      }
      expect(
        [...have].filter((x) => !need.has(x)),
        `${sa} holds more than its sidecars need`,
      ).toEqual([]);
    }
    for (const role of r.docs.filter((x) => x.kind === 'ClusterRole' || x.kind === 'Role')) {
      const text = JSON.stringify(role.rules);
      expect(text).not.toContain('"*"');
      expect(text).not.toContain('secrets');
    }
  });

  it('passes loopvol only flags its --help documents', () => {
    for (const { spec } of workloads(variant(v))) {
      for (const a of spec.containers.find((c) => c.name === 'loopvol')?.args ?? []) {
        const flag = a.split('=')[0] ?? '';
        expect(help, flag).toContain(`  ${flag} `);
      }
    }
  });
});

describe('the variants', () => {
  it('differ where they should: attach in the shared pool, node-local pools named after their node', () => {
    const shared = variant('shared');
    const local = variant('local');
    const attach = (r: Rendered) =>
      (r.docs.find((d) => d.kind === 'CSIDriver')?.spec as { attachRequired: boolean }).attachRequired;
    expect(attach(shared)).toBe(true);
    expect(attach(local)).toBe(false);
    const controller = workloads(shared).find(({ d }) => d.kind === 'Deployment');
    const sidecars = controller?.spec.containers.map((c) => c.name).sort();
    expect(sidecars).toEqual([
      'csi-attacher',
      'csi-provisioner',
      'csi-resizer',
      'csi-snapshotter',
      'liveness-probe',
      'loopvol',
    ]);
    expect(controller?.spec.containers.find((c) => c.name === 'csi-provisioner')?.args).toEqual(
      expect.arrayContaining([
        '--feature-gates=Topology=true',
        '--extra-create-metadata',
        '--enable-capacity',
        '--leader-election',
      ]),
    );
    expect((controller?.d.spec as { replicas: number }).replicas).toBeGreaterThan(1);
    const node = workloads(local).find(({ d }) => d.kind === 'DaemonSet');
    expect(workloads(local).some(({ d }) => d.kind === 'Deployment')).toBe(false);
    const provisioner = node?.spec.containers.find((c) => c.name === 'csi-provisioner');
    expect(provisioner?.args).toContain('--node-deployment=true');
    const driver = node?.spec.containers.find((c) => c.name === 'loopvol');
    expect(argValue(driver as Container, '--pool-name')).toBe('$(NODE_ID)');
    expect(argValue(driver as Container, '--nodeid')).toBe('$(NODE_ID)');
  });
});

describe('the examples', () => {
  const docs: Obj[] = [];
  beforeAll(async () => {
    const dir = path.join(DEPLOY, 'examples');
    for (const f of (await fs.readdir(dir)).filter((x) => x.endsWith('.yaml')))
      docs.push(...(await loadDocs(path.join(dir, f))));
  });

  it('are known kinds for this driver', () => {
    expect(docs.length).toBeGreaterThan(10);
    for (const d of docs) {
      expect(KNOWN_KINDS.has(d.kind), d.kind).toBe(true);
      if (d.kind === 'StorageClass') expect(d.provisioner).toBe(DRIVER);
      if (d.kind === 'VolumeSnapshotClass') expect(d.driver).toBe(DRIVER);
      if (d.kind === 'VolumeAttributesClass') expect(d.driverName).toBe(DRIVER);
    }
    const classes = docs.filter((d) => d.kind === 'StorageClass');
    const params = classes.map((d) => (d.parameters ?? {}) as Record<string, string>);
    expect(params.some((p) => p['csi.storage.k8s.io/fstype'] === 'xfs')).toBe(true);
    expect(params.some((p) => p.allocation === 'preallocate')).toBe(true);
    for (const p of params) {
      for (const key of Object.keys(p)) expect(['csi.storage.k8s.io/fstype', 'allocation']).toContain(key);
    }
  });

  it('refer only to objects the examples define', () => {
    const names = (kind: string) => new Set(docs.filter((d) => d.kind === kind).map((d) => d.metadata.name));
    const classes = names('StorageClass');
    const claims = names('PersistentVolumeClaim');
    const snapshots = names('VolumeSnapshot');
    const snapshotClasses = names('VolumeSnapshotClass');
    for (const d of docs) {
      const spec = d.spec as Record<string, unknown> | undefined;
      if (d.kind === 'PersistentVolumeClaim') {
        expect(classes.has(spec?.storageClassName as string), d.metadata.name).toBe(true);
        const src = spec?.dataSource as { kind: string; name: string } | undefined;
        if (src?.kind === 'VolumeSnapshot') expect(snapshots.has(src.name)).toBe(true);
        if (src?.kind === 'PersistentVolumeClaim') expect(claims.has(src.name)).toBe(true);
      }
      if (d.kind === 'Pod') {
        for (const vol of (spec?.volumes as
          { persistentVolumeClaim?: { claimName: string } }[] | undefined) ?? []) {
          if (vol.persistentVolumeClaim) expect(claims.has(vol.persistentVolumeClaim.claimName)).toBe(true);
        }
      }
      if (d.kind === 'VolumeSnapshot') {
        expect(snapshotClasses.has(spec?.volumeSnapshotClassName as string)).toBe(true);
        expect(
          claims.has((spec?.source as { persistentVolumeClaimName: string }).persistentVolumeClaimName),
        ).toBe(true);
      }
    }
  });
});

describe('the Dockerfile', () => {
  it('builds in one stage and runs dist/main.js on a slim Node image with the tools the driver runs', async () => {
    const text = await fs.readFile(path.join(REPO, 'Dockerfile'), 'utf8');
    const froms = [...text.matchAll(/^FROM (\S+)/gm)].map((m) => m[1] ?? '');
    expect(froms).toHaveLength(2);
    for (const f of froms) expect(f).toMatch(/^node:\d+-[a-z]+-slim$/);
    expect(text).toMatch(/npm prune --omit=dev/);
    expect(text).toMatch(/ENTRYPOINT \["node", "\/opt\/loopvol\/dist\/main.js"\]/);
    const installed =
      /apt-get install[^\n]*--no-install-recommends ([^\n&\\]+)/.exec(text)?.[1]?.trim().split(/\s+/) ?? [];
    const packageOf: Record<string, string> = {
      losetup: 'util-linux',
      blkid: 'util-linux',
      blockdev: 'util-linux',
      fsfreeze: 'util-linux',
      fallocate: 'util-linux',
      mount: 'mount',
      umount: 'mount',
      'mkfs.ext4': 'e2fsprogs',
      e2fsck: 'e2fsprogs',
      resize2fs: 'e2fsprogs',
      'mkfs.xfs': 'xfsprogs',
      xfs_growfs: 'xfsprogs',
      'mkfs.btrfs': 'btrfs-progs',
      btrfs: 'btrfs-progs',
      cp: 'coreutils',
    };
    for (const tool of new Set<string>([...NODE_TOOLS, ...CONTROLLER_TOOLS])) {
      const pkg = packageOf[tool];
      expect(pkg, `the Dockerfile test knows where ${tool} comes from`).toBeDefined();
      if (pkg !== 'coreutils') expect(installed, tool).toContain(pkg);
    }
  });
});
