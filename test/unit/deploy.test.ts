/**
 * The Kubernetes packaging, checked without a cluster: every manifest parses (a YAML parser, not
 * regexes); each variant is rendered the way `kubectl apply -k` would (resources, the images component,
 * namespace, patches), compared with what the real `kubectl kustomize` renders where kubectl is
 * installed, and held to the invariants whose breakage breaks installs: RBAC as each sidecar's own
 * repository has it at the pinned tag, no deprecated sidecar flags, health and shutdown settings, mount
 * propagation, and a shared pool that is never created by accident.
 */
import { execFile } from 'node:child_process';
import { accessSync, constants } from 'node:fs';
import fs from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';
import { parseAllDocuments } from 'yaml';
import { beforeAll, describe, expect, it } from 'vitest';
import { NODE_TOOLS, CONTROLLER_TOOLS } from '../../src/health.js';
import { CLEANUP_MS } from '../../src/exec/runner.js';
import { REPO, runMain } from '../helpers/driver.js';

type Obj = Record<string, unknown> & {
  kind: string;
  apiVersion: string;
  metadata: { name: string; namespace?: string };
};
interface Probe {
  httpGet?: { path: string; port: string | number };
}
interface Container {
  name: string;
  image: string;
  args?: string[];
  env?: { name: string }[];
  ports?: { name?: string; containerPort: number }[];
  livenessProbe?: Probe;
  readinessProbe?: Probe;
  securityContext?: { privileged?: boolean };
  volumeMounts?: { name: string; mountPath: string; mountPropagation?: string }[];
}
interface PodSpec {
  serviceAccountName?: string;
  terminationGracePeriodSeconds?: number;
  containers: Container[];
  volumes?: { name: string; hostPath?: { path: string; type?: string }; emptyDir?: unknown }[];
}

const DEPLOY = path.join(REPO, 'deploy', 'kubernetes');
const DRIVER = 'loopvol.csi.io';
const POOL = '/var/lib/loopvol/pool';

/** Sidecar flags their pinned releases call deprecated, and why they must not be used. */
const DEPRECATED: Record<string, string> = {
  '--health-port':
    'livenessprobe@v2.19.0 cmd/livenessprobe/main.go: "(deprecated)", and cannot be set with --http-endpoint',
  '--metrics-address':
    'deprecated in favour of --http-endpoint (the READMEs of provisioner, attacher, resizer, livenessprobe)',
};
/** Feature gates that are GA (locked on) at the pinned tags: setting them only waits for their removal. */
const GA_GATES: Record<string, string> = {
  Topology: 'external-provisioner@v6.3.0 pkg/features/features.go: GA, on by default',
  VolumeAttributesClass: 'external-provisioner@v6.3.0 pkg/features/features.go: GA, on by default',
};
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
  'Service',
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
  // Components in order, each on what came before: its resources, its patches, its images.
  for (const c of (k.components as string[] | undefined) ?? []) {
    const [comp] = await loadDocs(path.join(dir, c, 'kustomization.yaml'));
    expect(comp?.kind).toBe('Component');
    for (const r of (comp?.resources as string[] | undefined) ?? [])
      docs.push(...(await loadDocs(path.join(dir, c, r))));
    applyPatches(docs, comp?.patches);
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
  applyPatches(docs, k.patches);
  return { docs, images };
}

/** JSON6902 patches: `replace` of a field that exists, `add` of an array's new last element ("/-"). */
function applyPatches(docs: Obj[], patches: unknown): void {
  for (const p of (patches as { target: { kind: string; name: string }; patch: string }[] | undefined) ??
    []) {
    const ops = (parseAllDocuments(p.patch)[0]?.toJS() ?? []) as {
      op: string;
      path: string;
      value: unknown;
    }[];
    for (const d of docs.filter((x) => x.kind === p.target.kind && x.metadata.name === p.target.name)) {
      for (const op of ops) {
        expect(['replace', 'add']).toContain(op.op);
        const keys = op.path.split('/').slice(1);
        let at: Record<string, unknown> = d;
        for (const key of keys.slice(0, -1)) at = at[key] as Record<string, unknown>;
        const last = keys.at(-1) ?? '';
        if (op.op === 'add') {
          expect(Array.isArray(at) && last === '-', `${op.path}: add appends to an array`).toBe(true);
          (at as unknown as unknown[]).push(op.value);
          continue;
        }
        expect(last in at, `${op.path} exists in ${d.kind}/${d.metadata.name}`).toBe(true);
        at[last] = op.value;
      }
    }
  }
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

/**
 * What each sidecar needs from the API, as its own repository has it at the tag pinned in
 * components/images (read there, not guessed): `rules` are that RBAC file's ClusterRole without the
 * rules it leaves commented out as optional (secrets, referencegrants), plus `extra` where the
 * sidecar's code needs more than its file grants. Bumping a tag means reading these again.
 */
interface Sidecar {
  /** The repository and release tag the rules below were read at. */
  repo: string;
  tag: string;
  /** The file (and ClusterRole) they come from; undefined for sidecars that use no API. */
  source?: string;
  /** The ClusterRole of common/rbac.yaml that carries them. */
  role?: string;
  rules: Rule[];
  extra?: { rule: Rule; why: string }[];
}
const SIDECARS: Record<string, Sidecar> = {
  'csi-provisioner': {
    repo: 'kubernetes-csi/external-provisioner',
    tag: 'v6.3.0',
    source: 'deploy/kubernetes/rbac.yaml, ClusterRole external-provisioner-runner',
    role: 'loopvol-external-provisioner',
    rules: [
      ['', 'persistentvolumes', ['get', 'list', 'watch', 'create', 'patch', 'delete']],
      ['', 'persistentvolumeclaims', ['get', 'list', 'watch', 'update']],
      ['storage.k8s.io', 'storageclasses', ['get', 'list', 'watch']],
      ['', 'events', ['list', 'watch', 'create', 'update', 'patch']],
      ['snapshot.storage.k8s.io', 'volumesnapshots', ['get', 'list', 'watch', 'update']],
      ['snapshot.storage.k8s.io', 'volumesnapshotcontents', ['get', 'list']],
      ['storage.k8s.io', 'csinodes', ['get', 'list', 'watch']],
      ['', 'nodes', ['get', 'list', 'watch']],
      ['storage.k8s.io', 'volumeattachments', ['get', 'list', 'watch']],
    ],
    extra: [
      {
        rule: ['storage.k8s.io', 'volumeattributesclasses', ['get']],
        why: "pkg/controller/controller.go reads the PVC's VolumeAttributesClass in CreateVolume",
      },
    ],
  },
  'csi-attacher': {
    repo: 'kubernetes-csi/external-attacher',
    tag: 'v4.12.0',
    source: 'deploy/kubernetes/rbac.yaml, ClusterRole external-attacher-runner',
    role: 'loopvol-external-attacher',
    rules: [
      ['', 'persistentvolumes', ['get', 'list', 'watch', 'patch']],
      ['storage.k8s.io', 'csinodes', ['get', 'list', 'watch']],
      ['storage.k8s.io', 'volumeattachments', ['get', 'list', 'watch', 'patch']],
      ['storage.k8s.io', 'volumeattachments/status', ['patch']],
    ],
  },
  'csi-resizer': {
    repo: 'kubernetes-csi/external-resizer',
    tag: 'v2.2.1',
    source: 'deploy/kubernetes/rbac.yaml, ClusterRole external-resizer-runner',
    role: 'loopvol-external-resizer',
    rules: [
      ['', 'persistentvolumes', ['get', 'list', 'watch', 'patch']],
      ['', 'persistentvolumeclaims', ['get', 'list', 'watch']],
      ['', 'pods', ['get', 'list', 'watch']],
      ['', 'persistentvolumeclaims/status', ['patch']],
      ['', 'events', ['list', 'watch', 'create', 'update', 'patch']],
      ['storage.k8s.io', 'volumeattributesclasses', ['get', 'list', 'watch']],
    ],
  },
  'csi-snapshotter': {
    repo: 'kubernetes-csi/external-snapshotter',
    tag: 'v8.6.0',
    source:
      'deploy/kubernetes/csi-snapshotter/rbac-csi-snapshotter.yaml, ClusterRole external-snapshotter-runner',
    role: 'loopvol-external-snapshotter',
    rules: [
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
    ],
  },
  // README "Required permissions": the registrar does not use the Kubernetes API.
  'csi-node-driver-registrar': { repo: 'kubernetes-csi/node-driver-registrar', tag: 'v2.17.0', rules: [] },
  // It talks only to the CSI socket (cmd/livenessprobe/main.go makes no Kubernetes client).
  livenessprobe: { repo: 'kubernetes-csi/livenessprobe', tag: 'v2.19.0', rules: [] },
  'csi-snapshot-metadata': {
    repo: 'kubernetes-csi/external-snapshot-metadata',
    tag: 'v1.1.0',
    source: 'deploy/snapshot-metadata-cluster-role.yaml, ClusterRole external-snapshot-metadata-runner',
    role: 'loopvol-external-snapshot-metadata',
    rules: [
      [
        'cbt.storage.k8s.io',
        'snapshotmetadataservices',
        ['get', 'list', 'watch', 'create', 'update', 'patch', 'delete'],
      ],
      ['authentication.k8s.io', 'tokenreviews', ['create', 'get']],
      ['authorization.k8s.io', 'subjectaccessreviews', ['create', 'get']],
      ['snapshot.storage.k8s.io', 'volumesnapshots', ['get', 'list']],
      ['snapshot.storage.k8s.io', 'volumesnapshotcontents', ['get', 'list']],
    ],
  },
};

/**
 * The namespaced rules a sidecar needs for how it is started, from the same files' Roles: leader
 * election leases (every sidecar's ...-cfg / -leaderelection Role), and the provisioner's
 * CSIStorageCapacity objects with the gets that find their owner (external-provisioner-cfg).
 */
const LEASES: Rule = [
  'coordination.k8s.io',
  'leases',
  ['get', 'watch', 'list', 'delete', 'update', 'create'],
];
function startupRules(name: string, c: Container): Rule[] {
  const out: Rule[] = c.args?.includes('--leader-election') ? [LEASES] : [];
  if (name === 'csi-provisioner' && c.args?.includes('--enable-capacity')) {
    out.push([
      'storage.k8s.io',
      'csistoragecapacities',
      ['get', 'list', 'watch', 'create', 'update', 'patch', 'delete'],
    ]);
    const level = Number(argValue(c, '--capacity-ownerref-level') ?? '1');
    if (level >= 0) out.push(['', 'pods', ['get']]); // the walk up from the pod starts with the pod
    if (level >= 2) out.push(['apps', 'replicasets', ['get']]); // a Deployment owns it through a ReplicaSet
  }
  return out;
}

/** A container's sidecar name ("csi-provisioner", ...), from its image, or undefined for loopvol. */
const sidecarOf = (c: Container): string | undefined => {
  const name = c.image.split('/').pop()?.split(':')[0] ?? '';
  return name in SIDECARS ? name : undefined;
};

/** What a container needs from the API, given how it is started. */
function requiredRules(c: Container): Rule[] {
  const name = sidecarOf(c);
  if (name === undefined) return []; // loopvol uses no API
  const s = SIDECARS[name] as Sidecar;
  return [...s.rules, ...(s.extra ?? []).map((e) => e.rule), ...startupRules(name, c)];
}

const triples = (rules: Rule[]): string[] =>
  rules.flatMap(([g, res, verbs]) => verbs.map((v) => `${g}/${res}/${v}`)).sort();

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

const VARIANTS = ['shared', 'local', 'snapshot-metadata'];
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

  it('makes loopvol privileged on nodes only, and every container that shares its socket privileged with it', () => {
    // The reference deployment (kubernetes-csi/csi-driver-host-path) makes every sidecar next to its
    // privileged driver privileged too: on SELinux nodes an unprivileged container may be denied the
    // socket a privileged one created. Where loopvol is not privileged (the controller), nothing is.
    for (const { d, spec } of workloads(variant(v))) {
      const driver = spec.containers.find((c) => c.name === 'loopvol');
      if (!driver) throw new Error(`${d.metadata.name} has no loopvol container`);
      const driverPrivileged = driver.securityContext?.privileged === true;
      expect(driverPrivileged, `${d.metadata.name}/loopvol`).toBe(d.kind === 'DaemonSet');
      const socket = resolve(driver, (argValue(driver, '--endpoint') ?? '').slice('unix://'.length));
      for (const c of spec.containers.filter((x) => x !== driver)) {
        const sharesSocket = resolve(c, argValue(c, '--csi-address') ?? '')?.volume === socket?.volume;
        expect(sharesSocket, `${d.metadata.name}/${c.name} talks to the driver`).toBe(true);
        expect(c.securityContext?.privileged === true, `${d.metadata.name}/${c.name}`).toBe(driverPrivileged);
      }
    }
  });

  it('gives Bidirectional propagation to loopvol alone, on the kubelet directory', () => {
    for (const { d, spec } of workloads(variant(v))) {
      for (const c of spec.containers.filter((x) => x.name !== 'loopvol')) {
        expect(
          c.volumeMounts?.some((m) => m.mountPropagation === 'Bidirectional'),
          `${d.metadata.name}/${c.name}`,
        ).toBe(false);
      }
      if (d.kind !== 'DaemonSet') continue;
      const driver = spec.containers.find((c) => c.name === 'loopvol');
      const kubelet = driver?.volumeMounts?.find((m) => m.mountPath === '/var/lib/kubelet');
      expect(kubelet?.mountPropagation).toBe('Bidirectional');
      expect(spec.volumes?.find((vol) => vol.name === kubelet?.name)?.hostPath?.path).toBe(
        '/var/lib/kubelet',
      );
      for (const p of ['/dev', '/var/lib/loopvol/pool'])
        expect(resolve(driver as Container, p), p).toBeDefined();
    }
  });

  it('mounts the pool with HostToContainer propagation wherever it is mounted', () => {
    // A shared filesystem mounted on the host after the pod started must show up in the container.
    let mounts = 0;
    for (const { d, spec } of workloads(variant(v))) {
      const pools = (spec.volumes ?? []).filter((vol) => vol.hostPath?.path === POOL).map((vol) => vol.name);
      expect(pools, d.metadata.name).toHaveLength(1);
      for (const c of spec.containers) {
        for (const m of (c.volumeMounts ?? []).filter((x) => pools.includes(x.name))) {
          mounts++;
          expect(m.mountPath, `${d.metadata.name}/${c.name}`).toBe(POOL);
          expect(m.mountPropagation, `${d.metadata.name}/${c.name}`).toBe('HostToContainer');
        }
      }
    }
    expect(mounts).toBe(workloads(variant(v)).length);
  });

  it('gives every pod running loopvol longer to stop than loopvol drains its calls and undoes the cancelled ones', () => {
    const byDefault = /--shutdown-timeout \S+ .*\(default (\d+)\)/.exec(help)?.[1];
    expect(byDefault, '--help documents the --shutdown-timeout default').toBeDefined();
    for (const { d, spec } of workloads(variant(v))) {
      const driver = spec.containers.find((c) => c.name === 'loopvol') as Container;
      const shutdown = Number(argValue(driver, '--shutdown-timeout') ?? byDefault);
      // Kubernetes' default grace period is 30 s.
      const grace = spec.terminationGracePeriodSeconds ?? 30;
      // Then the calls cancelled at the timeout undo their work, for up to CLEANUP_MS.
      expect(
        grace,
        `${d.metadata.name}: terminationGracePeriodSeconds > --shutdown-timeout + the rollbacks' time`,
      ).toBeGreaterThan(shutdown + CLEANUP_MS / 1000);
    }
  });

  it('passes no deprecated or removed sidecar flags', () => {
    for (const { d, spec } of workloads(variant(v))) {
      for (const c of spec.containers.filter((x) => sidecarOf(x) !== undefined)) {
        const where = `${d.metadata.name}/${c.name}`;
        for (const a of c.args ?? []) {
          const flag = a.split('=')[0] ?? '';
          const why = DEPRECATED[flag];
          expect(why, `${where} ${a}`).toBeUndefined();
          if (flag === '--feature-gates') {
            for (const gate of a.slice(flag.length + 1).split(',')) {
              const gone = GA_GATES[gate.split('=')[0] ?? ''];
              expect(gone, `${where} ${gate}`).toBeUndefined();
            }
          }
        }
      }
    }
  });

  it('probes the driver through livenessprobe --http-endpoint, and leaders through their election health', () => {
    for (const { d, spec } of workloads(variant(v))) {
      const port = (p: string | number | undefined): number | undefined =>
        typeof p === 'number'
          ? p
          : spec.containers.flatMap((x) => x.ports ?? []).find((x) => x.name === p)?.containerPort;
      const endpointPort = (c: Container): number | undefined => {
        const e = argValue(c, '--http-endpoint');
        return e === undefined ? undefined : Number(e.slice(e.lastIndexOf(':') + 1));
      };
      const probe = spec.containers.find((c) => sidecarOf(c) === 'livenessprobe');
      if (!probe) throw new Error(`${d.metadata.name} has no livenessprobe`);
      const driver = spec.containers.find((c) => c.name === 'loopvol') as Container;
      // Ready is Probe (through livenessprobe); alive is the process answering on its metrics port,
      // so a shared pool that is not mounted yet never gets loopvol restarted.
      expect(driver.readinessProbe?.httpGet?.path).toBe('/healthz');
      expect(port(driver.readinessProbe?.httpGet?.port), `${d.metadata.name}: loopvol's probe port`).toBe(
        endpointPort(probe),
      );
      const metrics = argValue(driver, '--metrics-address');
      expect(driver.livenessProbe?.httpGet?.path).toBe('/livez');
      expect(port(driver.livenessProbe?.httpGet?.port)).toBe(
        Number(metrics?.slice(metrics.lastIndexOf(':') + 1)),
      );
      for (const c of spec.containers.filter((x) => x.args?.includes('--leader-election'))) {
        const where = `${d.metadata.name}/${c.name}`;
        const p = endpointPort(c);
        expect(p, `${where} --http-endpoint`).toBeDefined();
        expect(
          c.ports?.some((x) => x.containerPort === p),
          `${where} declares its port`,
        ).toBe(true);
        expect(c.livenessProbe?.httpGet?.path, where).toBe('/healthz/leader-election');
        expect(port(c.livenessProbe?.httpGet?.port), where).toBe(p);
      }
      const ports = spec.containers.flatMap((c) => (c.ports ?? []).map((x) => x.containerPort));
      expect(new Set(ports).size, `${d.metadata.name}: no port declared twice`).toBe(ports.length);
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
      expect.arrayContaining(['--extra-create-metadata', '--enable-capacity', '--leader-election']),
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

  it('never create a shared pool: --create-pool=false and a pool directory that must already exist', () => {
    // A node or controller whose shared filesystem is not mounted must not start on an empty local
    // directory of its own; node-local pools are made by their node.
    for (const [v, shared] of [
      ['shared', true],
      ['local', false],
    ] as const) {
      for (const { d, spec } of workloads(variant(v))) {
        const driver = spec.containers.find((c) => c.name === 'loopvol') as Container;
        const pool = spec.volumes?.find((vol) => vol.hostPath?.path === POOL);
        expect(argValue(driver, '--pool-dir'), d.metadata.name).toBe(POOL);
        expect(argValue(driver, '--create-pool') ?? 'true', `${v} ${d.metadata.name}`).toBe(
          shared ? 'false' : 'true',
        );
        expect(pool?.hostPath?.type, `${v} ${d.metadata.name}`).toBe(
          shared ? 'Directory' : 'DirectoryOrCreate',
        );
      }
    }
  });

  it('turn group snapshots on where the snapshot-controller can route them: the shared controller', () => {
    // In distributed snapshotting (local) snapshot-controller v8.6.0 labels only VolumeSnapshotContents
    // with their node, so a node's snapshotter would never see a group snapshot.
    const gate = '--feature-gates=CSIVolumeGroupSnapshot=true';
    const snapshotter = (v: string) =>
      workloads(variant(v))
        .flatMap(({ spec }) => spec.containers)
        .filter((c) => sidecarOf(c) === 'csi-snapshotter');
    expect(snapshotter('shared').map((c) => c.args?.includes(gate))).toEqual([true]);
    expect(snapshotter('local').map((c) => c.args?.includes(gate))).toEqual([false]);
  });

  it('pin each sidecar at the tag its RBAC rules were read at', async () => {
    const [component] = await loadDocs(path.join(DEPLOY, 'components', 'images', 'kustomization.yaml'));
    const images = (component?.images ?? []) as { name: string; newTag?: string }[];
    const used = new Set(
      VARIANTS.flatMap((v) => workloads(variant(v)).flatMap(({ spec }) => spec.containers.map(sidecarOf))),
    );
    for (const [name, s] of Object.entries(SIDECARS)) {
      expect(used.has(name), `${name} is deployed`).toBe(true);
      const pinned = images.find((i) => i.name === `registry.k8s.io/sig-storage/${name}`);
      expect(pinned?.newTag, `${name}: rules read at ${s.repo}@${s.tag}`).toBe(s.tag);
    }
  });

  it('have one ClusterRole per sidecar that uses the API, holding exactly its upstream rules', () => {
    for (const v of VARIANTS) {
      const r = variant(v);
      const deployed = new Set(workloads(r).flatMap(({ spec }) => spec.containers.map(sidecarOf)));
      for (const [name, s] of Object.entries(SIDECARS)) {
        if (!s.role) continue;
        const role = r.docs.find((d) => d.kind === 'ClusterRole' && d.metadata.name === s.role);
        // A sidecar only some variants deploy (csi-snapshot-metadata) has its role only there.
        if (!role && !deployed.has(name) && name === 'csi-snapshot-metadata') continue;
        if (!role) throw new Error(`${v}: no ClusterRole ${s.role} for ${name}`);
        const have = (
          (role.rules ?? []) as { apiGroups: string[]; resources: string[]; verbs: string[] }[]
        ).flatMap((rule) =>
          rule.apiGroups.flatMap((g) => rule.resources.map((res): Rule => [g, res, rule.verbs])),
        );
        const want = [...s.rules, ...(s.extra ?? []).map((e) => e.rule)];
        expect(triples(have), `${v}: ${s.role} = ${s.repo}@${s.tag} ${s.source ?? ''}`).toEqual(
          triples(want),
        );
      }
    }
  });
});

/** kubectl on PATH, or undefined: `kubectl kustomize` renders offline, with no cluster. */
const KUBECTL = (process.env.PATH ?? '')
  .split(path.delimiter)
  .filter((dir) => dir !== '')
  .map((dir) => path.join(dir, 'kubectl'))
  .find((file) => {
    try {
      accessSync(file, constants.X_OK);
      return true;
    } catch {
      return false;
    }
  });

describe('the real kustomize', () => {
  const why = KUBECTL === undefined ? ' (skipped: no kubectl on PATH to run `kubectl kustomize`)' : '';
  const key = (d: Obj) => `${d.kind}/${d.metadata.namespace ?? ''}/${d.metadata.name}`;
  const byKey = (docs: Obj[]) => [...docs].sort((a, b) => key(a).localeCompare(key(b)));

  it.skipIf(KUBECTL === undefined).each(VARIANTS)(
    `renders the %s variant as this test's renderer does${why}`,
    async (v) => {
      const { stdout } = await promisify(execFile)(KUBECTL as string, ['kustomize', path.join(DEPLOY, v)], {
        timeout: 60_000,
        maxBuffer: 16 * 1024 * 1024,
      });
      const docs = parseAllDocuments(stdout);
      for (const d of docs) expect(d.errors, `${v}: kubectl kustomize output parses`).toEqual([]);
      const real = docs.map((d) => d.toJS() as Obj | null).filter((d): d is Obj => d !== null);
      const ours = variant(v).docs;
      // Same objects (order aside: kustomize sorts by kind), field for field.
      expect(byKey(real).map(key)).toEqual(byKey(ours).map(key));
      expect(byKey(real)).toEqual(byKey(ours));
    },
  );
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
    // The base is a build argument (a site without registries passes its own), by default a slim
    // official Node.js image; both stages use it.
    expect(/^ARG BASE_IMAGE=(\S+)$/m.exec(text)?.[1]).toMatch(/^node:\d+-[a-z]+-slim$/);
    const froms = [...text.matchAll(/^FROM (\S+)/gm)].map((m) => m[1] ?? '');
    expect(froms).toEqual(['${BASE_IMAGE}', '${BASE_IMAGE}']);
    // No `# syntax=` directive: it would fetch a frontend image from a registry at every build.
    expect(text).not.toMatch(/^# *syntax=/m);
    // An extra CA reaches npm ci as a build secret, never as a file of any layer.
    expect(text).toMatch(
      /RUN --mount=type=secret,id=npm_ca\b[^\n]*\\\n[^\n]*NODE_EXTRA_CA_CERTS=\/run\/secrets\/npm_ca/,
    );
    expect(text).not.toMatch(/^(COPY|ADD)\b.*\.(pem|crt)\b/m);
    expect(text).toMatch(/npm prune --omit=dev/);
    expect(text).toMatch(/ENTRYPOINT \["node", "--max-semi-space-size=1", "\/opt\/loopvol\/dist\/main.js"\]/);
    // One malloc arena in the image that runs (bench/README.md, "One malloc arena"): the last value
    // the final stage's ENV lines give, continuation lines joined.
    const final = text.slice(text.lastIndexOf('\nFROM ')).replace(/\\\n\s*/g, ' ');
    const arena = [...final.matchAll(/^ENV\s+(.*)$/gm)]
      .flatMap((m) => (m[1] ?? '').split(/\s+/))
      .filter((kv) => kv.startsWith('MALLOC_ARENA_MAX='))
      .map((kv) => kv.slice('MALLOC_ARENA_MAX='.length).replace(/^"(.*)"$/, '$1'))
      .at(-1);
    expect(arena).toBe('1');
    // `npm start` and the README's command run the driver as the image does.
    const deployed = 'MALLOC_ARENA_MAX=1 node --max-semi-space-size=1 dist/main.js';
    const pkg = JSON.parse(await fs.readFile(path.join(REPO, 'package.json'), 'utf8')) as {
      scripts: Record<string, string>;
    };
    expect(pkg.scripts.start).toBe(deployed);
    expect(await fs.readFile(path.join(REPO, 'README.md'), 'utf8')).toContain(`&& ${deployed} --nodeid`);
    const installed =
      /apt-get install[^\n]*--no-install-recommends ([^\n&\\]+)/.exec(text)?.[1]?.trim().split(/\s+/) ?? [];
    const packageOf: Record<string, string> = {
      losetup: 'util-linux',
      blkid: 'util-linux',
      blockdev: 'util-linux',
      fsfreeze: 'util-linux',
      fallocate: 'util-linux',
      setpriv: 'util-linux',
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
      rm: 'coreutils',
    };
    for (const tool of new Set<string>([...NODE_TOOLS, ...CONTROLLER_TOOLS])) {
      const pkg = packageOf[tool];
      expect(pkg, `the Dockerfile test knows where ${tool} comes from`).toBeDefined();
      if (pkg !== 'coreutils') expect(installed, tool).toContain(pkg);
    }
  });
});

describe('changed block tracking (the snapshot-metadata variant)', () => {
  it('runs the sidecar beside the controller on its TLS secret, reached through the Service the SnapshotMetadataService names', async () => {
    const r = variant('snapshot-metadata');
    const controller = workloads(r).find(({ d }) => d.kind === 'Deployment');
    const sidecar = controller?.spec.containers.find((c) => c.name === 'csi-snapshot-metadata');
    if (!controller || !sidecar) throw new Error('no csi-snapshot-metadata in the controller');
    expect(sidecar.args).toEqual(
      expect.arrayContaining(['--tls-cert=/tls/tls.crt', '--tls-key=/tls/tls.key', '--port=50051']),
    );
    const tls = resolve(sidecar, '/tls/tls.crt');
    const secret = controller.spec.volumes?.find((vol) => vol.name === tls?.volume) as
      { secret?: { secretName: string } } | undefined;
    expect(secret?.secret?.secretName).toBe('loopvol-snapshot-metadata-tls');
    const service = r.docs.find((d) => d.kind === 'Service') as
      | (Obj & { spec: { selector: Record<string, string>; ports: { port: number; targetPort: string }[] } })
      | undefined;
    const labels = (controller.d.spec as { template: { metadata: { labels: Record<string, string> } } })
      .template.metadata.labels;
    expect(labels).toMatchObject(service?.spec.selector ?? { missing: true });
    const grpcPort = sidecar.ports?.find((p) => p.name === service?.spec.ports[0]?.targetPort);
    expect(grpcPort?.containerPort).toBe(50051);
    const [sms] = await loadDocs(path.join(DEPLOY, 'snapshot-metadata', 'snapshotmetadataservice.yaml'));
    expect(sms).toMatchObject({ kind: 'SnapshotMetadataService', metadata: { name: DRIVER } });
    expect((sms?.spec as { address: string }).address).toBe(
      `${service?.metadata.name ?? ''}.${service?.metadata.namespace ?? ''}:${service?.spec.ports[0]?.port ?? 0}`,
    );
    // The other variants are unchanged: no sidecar that would wait for a secret nobody made.
    for (const v of ['shared', 'local'])
      expect(workloads(variant(v)).flatMap(({ spec }) => spec.containers.map((c) => c.name))).not.toContain(
        'csi-snapshot-metadata',
      );
  });
});
