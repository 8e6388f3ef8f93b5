/**
 * A workload's container, read from the project's own Kubernetes manifests (a YAML parser, never a
 * hand-copied list) and mapped to a container engine the way the kubelet would run it:
 *  - args with `$(VAR)` expanded from the container's env, env from `fieldRef` filled with test values;
 *  - hostPath → a bind mount; `Bidirectional` → rshared, `HostToContainer` → rslave, none → rprivate;
 *  - emptyDir → a fresh host directory;
 *  - `privileged: true` → privileged; `readOnlyRootFilesystem` → a read-only root.
 * The host paths can be rewritten (a test keeps each "node" in a temporary directory). A mount whose
 * path is the same inside and outside the container (the kubelet directory, the pool) keeps that
 * property after rewriting: the container path is rewritten with it, and so is every argument that
 * names a path under it.
 */
import { parseAllDocuments } from 'yaml';

export type Propagation = 'rprivate' | 'rslave' | 'rshared';

export interface PlannedMount {
  /** The pod volume's name. */
  volume: string;
  kind: 'hostPath' | 'emptyDir';
  /** The path on the host (rewritten). */
  source: string;
  /** The path in the container. */
  target: string;
  propagation: Propagation;
  readOnly: boolean;
  /** hostPath's `type` (Directory, DirectoryOrCreate, ...), '' when none. */
  hostPathType: string;
}

export interface ContainerPlan {
  /** `DaemonSet/loopvol-node`, say. */
  workload: string;
  container: string;
  image: string;
  /** The image's entrypoint replaced, when the manifest has `command`. */
  command: string[] | undefined;
  args: string[];
  env: Record<string, string>;
  mounts: PlannedMount[];
  privileged: boolean;
  readOnlyRootFilesystem: boolean;
}

export interface PlanOptions {
  /** The container's name in the pod; default `loopvol`. */
  container?: string;
  /** Values for env `fieldRef`s, by field path (`spec.nodeName`, `metadata.name`, ...). */
  fieldRefs: Record<string, string>;
  /** Where a hostPath lives on this host (identity when omitted). */
  hostPath?: (path: string) => string;
  /** A host directory for the pod's emptyDir `name`. */
  emptyDir?: (name: string) => string;
}

interface K8sContainer {
  name: string;
  image: string;
  command?: string[];
  args?: string[];
  env?: {
    name: string;
    value?: string;
    valueFrom?: { fieldRef?: { fieldPath: string } };
  }[];
  securityContext?: { privileged?: boolean; readOnlyRootFilesystem?: boolean };
  volumeMounts?: { name: string; mountPath: string; mountPropagation?: string; readOnly?: boolean }[];
}

interface K8sVolume {
  name: string;
  hostPath?: { path: string; type?: string };
  emptyDir?: unknown;
}

interface Workload {
  kind: string;
  metadata: { name: string };
  spec: { template: { spec: { containers: K8sContainer[]; volumes?: K8sVolume[] } } };
}

const PROPAGATION: Record<string, Propagation> = {
  None: 'rprivate',
  HostToContainer: 'rslave',
  Bidirectional: 'rshared',
};

/** Kubernetes' `$(VAR)` expansion of command and args: `$$` escapes, unknown references stay as written. */
export function expandVars(s: string, env: Record<string, string>): string {
  return s.replace(/\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, name: string | undefined) => {
    if (m === '$$') return '$';
    return name !== undefined && name in env ? (env[name] ?? '') : m;
  });
}

/** Replaces the path `from` (or a path under it) where an argument names one: `/p`, `--x=/p`, `unix:///p`. */
function rewritePathsIn(s: string, from: string, to: string): string {
  const esc = from.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  return s.replace(new RegExp(`(^|=|unix://)${esc}(?=$|/)`, 'g'), (_m, pre: string) => `${pre}${to}`);
}

/** The first Deployment/DaemonSet/StatefulSet in `yamlText` that has a container named `container`. */
export function planFromManifest(yamlText: string, options: PlanOptions): ContainerPlan {
  const want = options.container ?? 'loopvol';
  const docs = parseAllDocuments(yamlText).map((d) => {
    if (d.errors.length > 0) throw new Error(`manifest: ${d.errors[0]?.message ?? 'YAML error'}`);
    return d.toJS() as Workload | null;
  });
  const workload = docs.find(
    (d): d is Workload =>
      d !== null &&
      ['DaemonSet', 'Deployment', 'StatefulSet'].includes(d.kind) &&
      d.spec.template.spec.containers.some((c) => c.name === want),
  );
  if (!workload) throw new Error(`no workload with a container named ${want}`);
  const pod = workload.spec.template.spec;
  const c = pod.containers.find((x) => x.name === want);
  if (!c) throw new Error(`no container ${want}`);

  const env: Record<string, string> = {};
  for (const e of c.env ?? []) {
    if (e.value !== undefined) env[e.name] = expandVars(e.value, env);
    else if (e.valueFrom?.fieldRef) {
      const v = options.fieldRefs[e.valueFrom.fieldRef.fieldPath];
      if (v === undefined)
        throw new Error(`env ${e.name}: no test value for fieldRef ${e.valueFrom.fieldRef.fieldPath}`);
      env[e.name] = v;
    } else throw new Error(`env ${e.name}: only value and fieldRef are supported here`);
  }

  const hostPath = options.hostPath ?? ((p: string) => p);
  const volumes = new Map((pod.volumes ?? []).map((v) => [v.name, v]));
  const mounts: PlannedMount[] = [];
  /** Container paths that moved with their host path (same inside and outside). */
  const moved: [string, string][] = [];
  for (const m of c.volumeMounts ?? []) {
    const v = volumes.get(m.name);
    if (!v) throw new Error(`volumeMount ${m.name}: no such volume`);
    const propagation = PROPAGATION[m.mountPropagation ?? 'None'];
    if (!propagation)
      throw new Error(`volumeMount ${m.name}: unknown mountPropagation ${m.mountPropagation ?? ''}`);
    let source: string;
    let kind: PlannedMount['kind'];
    let target = m.mountPath;
    if (v.hostPath) {
      kind = 'hostPath';
      source = hostPath(v.hostPath.path);
      if (m.mountPath === v.hostPath.path && source !== v.hostPath.path) {
        target = source;
        moved.push([m.mountPath, source]);
      }
    } else if (v.emptyDir !== undefined) {
      kind = 'emptyDir';
      if (!options.emptyDir) throw new Error(`volume ${v.name}: emptyDir needs a host directory`);
      source = options.emptyDir(v.name);
    } else throw new Error(`volume ${v.name}: only hostPath and emptyDir are supported here`);
    mounts.push({
      volume: m.name,
      kind,
      source,
      target,
      propagation,
      readOnly: m.readOnly === true,
      hostPathType: v.hostPath?.type ?? '',
    });
  }
  // Longest first, so /var/lib/kubelet/plugins moves before /var/lib/kubelet.
  moved.sort((a, b) => b[0].length - a[0].length);
  const rewrite = (s: string): string => {
    let out = expandVars(s, env);
    for (const [from, to] of moved) out = rewritePathsIn(out, from, to);
    return out;
  };
  return {
    workload: `${workload.kind}/${workload.metadata.name}`,
    container: c.name,
    image: c.image,
    command: c.command?.map(rewrite),
    args: (c.args ?? []).map(rewrite),
    env,
    mounts,
    privileged: c.securityContext?.privileged === true,
    readOnlyRootFilesystem: c.securityContext?.readOnlyRootFilesystem === true,
  };
}

/** The value of `--name=value` (or `--name value`) in args, if present. */
export function flagValue(args: readonly string[], name: string): string | undefined {
  for (let i = 0; i < args.length; i++) {
    const a = args[i] ?? '';
    if (a.startsWith(`--${name}=`)) return a.slice(name.length + 3);
    if (a === `--${name}`) return args[i + 1];
  }
  return undefined;
}

/** Linux capability numbers (include/uapi/linux/capability.h) to the names a container engine takes. */
export const CAPABILITIES = [
  'CHOWN',
  'DAC_OVERRIDE',
  'DAC_READ_SEARCH',
  'FOWNER',
  'FSETID',
  'KILL',
  'SETGID',
  'SETUID',
  'SETPCAP',
  'LINUX_IMMUTABLE',
  'NET_BIND_SERVICE',
  'NET_BROADCAST',
  'NET_ADMIN',
  'NET_RAW',
  'IPC_LOCK',
  'IPC_OWNER',
  'SYS_MODULE',
  'SYS_RAWIO',
  'SYS_CHROOT',
  'SYS_PTRACE',
  'SYS_PACCT',
  'SYS_ADMIN',
  'SYS_BOOT',
  'SYS_NICE',
  'SYS_RESOURCE',
  'SYS_TIME',
  'SYS_TTY_CONFIG',
  'MKNOD',
  'LEASE',
  'AUDIT_WRITE',
  'AUDIT_CONTROL',
  'SETFCAP',
  'MAC_OVERRIDE',
  'MAC_ADMIN',
  'SYSLOG',
  'WAKE_ALARM',
  'BLOCK_SUSPEND',
  'AUDIT_READ',
  'PERFMON',
  'BPF',
  'CHECKPOINT_RESTORE',
] as const;

/** The capabilities in a /proc/<pid>/status mask (CapBnd): which this host can grant, which it lacks. */
export function capabilitiesOf(hexMask: string): { has: string[]; lacks: string[]; unknownBits: number[] } {
  const mask = BigInt(`0x${hexMask}`);
  const has: string[] = [];
  const lacks: string[] = [];
  CAPABILITIES.forEach((name, bit) => ((mask >> BigInt(bit)) & 1n ? has : lacks).push(name));
  const unknownBits: number[] = [];
  const known: readonly string[] = CAPABILITIES;
  for (let bit = known.length; bit < 64; bit++) if ((mask >> BigInt(bit)) & 1n) unknownBits.push(bit);
  return { has, lacks, unknownBits };
}

/** The device cgroup rules a privileged loop-device user needs: every loop device and loop-control. */
export const LOOP_DEVICE_RULES = ['b 7:* rmw', 'c 10:237 rmw'];

export interface EngineRunOptions {
  image: string;
  name: string;
  labels?: Record<string, string>;
  /**
   * `full`: the engine's own privileged mode. `emulated`: every capability in `capabilities`,
   * unconfined seccomp, AppArmor and /proc, and the loop device rules — for hosts that cannot grant
   * every capability (the engine's privileged mode then fails).
   */
  privilege: { mode: 'full' } | { mode: 'emulated'; capabilities: string[] };
}

/** `docker run` arguments (after `run`) for a plan. */
export function dockerRunArgs(plan: ContainerPlan, o: EngineRunOptions): string[] {
  const out = ['--detach', '--name', o.name, '--hostname', o.name];
  for (const [k, v] of Object.entries(o.labels ?? {})) out.push('--label', `${k}=${v}`);
  for (const [k, v] of Object.entries(plan.env)) out.push('--env', `${k}=${v}`);
  for (const m of plan.mounts) {
    const parts = [`type=bind`, `source=${m.source}`, `target=${m.target}`];
    if (m.propagation !== 'rprivate') parts.push(`bind-propagation=${m.propagation}`);
    if (m.readOnly) parts.push('readonly');
    out.push('--mount', parts.join(','));
  }
  if (plan.privileged) {
    if (o.privilege.mode === 'full') out.push('--privileged');
    else {
      for (const cap of o.privilege.capabilities) out.push('--cap-add', cap);
      out.push(
        '--security-opt',
        'seccomp=unconfined',
        '--security-opt',
        'apparmor=unconfined',
        '--security-opt',
        'systempaths=unconfined',
      );
      for (const rule of LOOP_DEVICE_RULES) out.push('--device-cgroup-rule', rule);
    }
  }
  if (plan.readOnlyRootFilesystem) out.push('--read-only');
  const [entry, ...rest] = plan.command ?? [];
  if (entry !== undefined) out.push('--entrypoint', entry);
  out.push(o.image, ...rest, ...plan.args);
  return out;
}
