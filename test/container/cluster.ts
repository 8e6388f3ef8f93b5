/**
 * A one-host "cluster" for the built image: node plugins started exactly as the node DaemonSet starts
 * them and a controller as its Deployment does (test/container/plan.ts reads both manifests), each
 * "node" with its own kubelet directory under one temporary directory, and one shared pool.
 *
 * Layout (TOP is made by test/container/run.sh, so its trap can clean up whatever happens):
 *   TOP                                 bound onto itself and made rshared, as systemd makes / on a
 *                                       real node (Bidirectional and HostToContainer need it)
 *   TOP/host/<node>/var/lib/kubelet     each node's kubelet directory (hostPaths under /var/lib/kubelet)
 *   TOP/host/var/lib/loopvol/pool       every other hostPath (the pool: one filesystem all nodes share)
 *   /dev                                the host's own (loop devices made later appear in containers)
 *   TOP/emptydir/<pod>-<volume>         emptyDir volumes
 *
 * The state (which containers run, for which node) is kept in TOP/state.json, so that separate test
 * runs (start, e2e, sanity, restart, teardown) act on the same cluster.
 */
import { execFile, execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { promisify } from 'node:util';
import { csiClients, type CsiClients } from '../helpers/grpc.js';
import { cleanupUnder, type Leaks, leaksUnder } from '../helpers/host.js';
import { REPO } from '../helpers/driver.js';
import {
  capabilitiesOf,
  type ContainerPlan,
  dockerRunArgs,
  type EngineRunOptions,
  flagValue,
  planFromManifest,
} from './plan.js';

const run = promisify(execFile);
export const DOCKER = process.env.DOCKER ?? 'docker';
export const LABEL = 'io.loopvol.test-run';
const MANIFESTS = path.join(REPO, 'deploy', 'kubernetes', process.env.LOOPVOL_VARIANT ?? 'shared');

export async function docker(args: string[], timeoutMs = 120_000): Promise<string> {
  try {
    const { stdout } = await run(DOCKER, args, { timeout: timeoutMs, maxBuffer: 64 << 20 });
    return stdout.trim();
  } catch (err) {
    const e = err as { stderr?: string; message: string };
    throw new Error(`${DOCKER} ${args.slice(0, 3).join(' ')}…: ${(e.stderr ?? e.message).trim()}`);
  }
}

/** Appends one measurement to the run's report (printed by run.sh at the end, never asserted). */
export async function report(what: string, value: unknown): Promise<void> {
  const file = process.env.LOOPVOL_CONTAINER_REPORT;
  if (!file) return;
  await fs.appendFile(file, `${JSON.stringify({ what, value })}\n`);
}

export interface Member {
  /** `node-1`, or `controller`. */
  role: string;
  name: string;
  plan: ContainerPlan;
  /** The plugin's socket, as the host sees it. */
  socket: string;
  startedAtMs: number;
}

interface State {
  top: string;
  image: string;
  runId: string;
  capabilities: string[];
  members: Member[];
  retired: string[];
}

export interface StartResult {
  member: Member;
  /** From the engine's `run` until it returned, and until Probe said ready. */
  runMs: number;
  readyMs: number;
}

export class Cluster {
  private constructor(private state: State) {}

  get top(): string {
    return this.state.top;
  }
  /** The "node's /": everything the suite's leak check covers. */
  get root(): string {
    return path.join(this.state.top, 'host');
  }
  get image(): string {
    return this.state.image;
  }
  get members(): readonly Member[] {
    return this.state.members;
  }
  get capabilities(): readonly string[] {
    return this.state.capabilities;
  }

  kubeletDir(node: string): string {
    return path.join(this.root, node, 'var/lib/kubelet');
  }

  /** Where a manifest's hostPath lives for `node`. */
  hostPath(node: string): (p: string) => string {
    return (p) => {
      if (p === '/dev' || p.startsWith('/dev/') || p.startsWith('/sys') || p.startsWith('/proc')) return p;
      if (p === '/var/lib/kubelet' || p.startsWith('/var/lib/kubelet/')) return path.join(this.root, node, p);
      return path.join(this.root, p);
    };
  }

  get pool(): string {
    return this.hostPath('any')('/var/lib/loopvol/pool');
  }

  static async create(top: string, image: string, runId: string): Promise<Cluster> {
    await fs.mkdir(path.join(top, 'host'), { recursive: true });
    // What systemd does for / on a real node; the engine refuses rshared/rslave binds of private mounts.
    execFileSync('mount', ['--bind', top, top]);
    execFileSync('mount', ['--make-rshared', top]);
    const status = await fs.readFile('/proc/self/status', 'utf8');
    const caps = capabilitiesOf(/CapBnd:\s*([0-9a-f]+)/.exec(status)?.[1] ?? '0');
    const c = new Cluster({ top, image, runId, capabilities: caps.has, members: [], retired: [] });
    // The shared variant's pool is a hostPath of type Directory: the operator mounts the export there
    // on every node before the pods start (README, "Create the shared pool"). Here it is one directory.
    await fs.mkdir(c.pool, { recursive: true });
    await c.save();
    return c;
  }

  static async load(top = process.env.LOOPVOL_CONTAINER_TOP ?? ''): Promise<Cluster> {
    if (!top) throw new Error('LOOPVOL_CONTAINER_TOP is not set (run test/container/run.sh)');
    return new Cluster(JSON.parse(await fs.readFile(path.join(top, 'state.json'), 'utf8')) as State);
  }

  private async save(): Promise<void> {
    await fs.writeFile(path.join(this.state.top, 'state.json'), JSON.stringify(this.state, null, 2));
  }

  member(role: string): Member {
    const m = this.state.members.find((x) => x.role === role);
    if (!m) throw new Error(`no running ${role}`);
    return m;
  }

  /** The plan for the node DaemonSet's loopvol container on `node`. */
  async nodePlan(node: string): Promise<ContainerPlan> {
    return planFromManifest(await fs.readFile(path.join(MANIFESTS, 'node.yaml'), 'utf8'), {
      fieldRefs: {
        'spec.nodeName': node,
        'metadata.name': `loopvol-node-${node}`,
        'metadata.namespace': 'loopvol',
        'status.hostIP': '127.0.0.1',
      },
      hostPath: this.hostPath(node),
    });
  }

  async controllerPlan(): Promise<ContainerPlan> {
    return planFromManifest(await fs.readFile(path.join(MANIFESTS, 'controller.yaml'), 'utf8'), {
      fieldRefs: {
        'spec.nodeName': 'control-plane',
        'metadata.name': 'loopvol-controller-0',
        'metadata.namespace': 'loopvol',
      },
      hostPath: this.hostPath('control-plane'),
      emptyDir: (name) => path.join(this.state.top, 'emptydir', `controller-${name}`),
    });
  }

  /** What the kubelet has made before any pod runs on `node`. */
  async prepareNode(node: string): Promise<void> {
    for (const d of ['plugins', 'plugins_registry', 'pods']) {
      await fs.mkdir(path.join(this.kubeletDir(node), d), { recursive: true });
    }
  }

  /** Checks and creates the plan's host directories as the kubelet would (hostPath `type`). */
  private async prepareMounts(plan: ContainerPlan): Promise<void> {
    for (const m of plan.mounts) {
      if (m.kind === 'emptyDir') {
        await fs.mkdir(m.source, { recursive: true });
        continue;
      }
      if (m.hostPathType === 'DirectoryOrCreate') await fs.mkdir(m.source, { recursive: true, mode: 0o755 });
      else if (m.hostPathType === 'Directory') {
        const st = await fs.stat(m.source).catch(() => undefined);
        if (!st?.isDirectory()) throw new Error(`hostPath ${m.source} (${m.volume}) must be a directory`);
      }
    }
  }

  /** The host path of the plugin's socket: `--endpoint`'s path through the mount that holds it. */
  static socketOf(plan: ContainerPlan): string {
    const endpoint = flagValue(plan.args, 'endpoint') ?? 'unix:///run/loopvol/csi.sock';
    const inside = endpoint.replace(/^unix:\/\//, '');
    const holder = plan.mounts
      .filter((m) => inside === m.target || inside.startsWith(`${m.target}/`))
      .sort((a, b) => b.target.length - a.target.length)[0];
    if (!holder) throw new Error(`the socket ${inside} is on no mount the host can reach`);
    return path.join(holder.source, path.relative(holder.target, inside));
  }

  private runOptions(name: string): EngineRunOptions {
    return {
      image: this.state.image,
      name,
      labels: { [LABEL]: this.state.runId },
      privilege: { mode: 'emulated', capabilities: [...this.state.capabilities] },
    };
  }

  /** `--create-pool=false` in the plan: make the pool first with the image's `create-pool` subcommand. */
  private async createPoolFor(plan: ContainerPlan): Promise<string | undefined> {
    if (flagValue(plan.args, 'create-pool') !== 'false') return undefined;
    const poolDir = flagValue(plan.args, 'pool-dir');
    if (!poolDir) throw new Error('--create-pool=false without --pool-dir');
    const poolMount = plan.mounts.find((m) => poolDir === m.target || poolDir.startsWith(`${m.target}/`));
    if (!poolMount) throw new Error(`--pool-dir ${poolDir} is on no mount`);
    const name = flagValue(plan.args, 'pool-name');
    return docker([
      'run',
      '--rm',
      '--label',
      `${LABEL}=${this.state.runId}`,
      '--mount',
      `type=bind,source=${poolMount.source},target=${poolMount.target}`,
      this.state.image,
      'create-pool',
      `--pool-dir=${poolDir}`,
      ...(name ? [`--pool-name=${name}`] : []),
    ]);
  }

  /** Starts a container for `role` from `plan`, and waits until its Probe says ready. */
  async start(role: string, plan: ContainerPlan, name: string): Promise<StartResult> {
    await this.prepareMounts(plan);
    const made = await this.createPoolFor(plan);
    if (made) await report(`create-pool before ${role} (its manifest says --create-pool=false)`, made);
    const socket = Cluster.socketOf(plan);
    let args = dockerRunArgs(plan, this.runOptions(name));
    const t0 = performance.now();
    for (;;) {
      try {
        await docker(['run', ...args]);
        break;
      } catch (err) {
        // An engine older than the kernel does not know every capability: grant the ones it knows.
        const unknown = /unknown capability: "?(?:CAP_)?([A-Z_]+)"?/.exec(String(err))?.[1];
        if (!unknown || !this.state.capabilities.includes(unknown)) throw err;
        this.state.capabilities = this.state.capabilities.filter((c) => c !== unknown);
        await report(`capability the container engine does not know (not granted)`, unknown);
        args = dockerRunArgs(plan, this.runOptions(name));
      }
    }
    const runMs = performance.now() - t0;
    await waitReady(socket, name, 30_000);
    const readyMs = performance.now() - t0;
    const member: Member = { role, name, plan, socket, startedAtMs: Date.now() };
    this.state.members = [...this.state.members.filter((m) => m.role !== role), member];
    await this.save();
    return { member, runMs, readyMs };
  }

  /** The DaemonSet's node plugin on `node`; `mode` replaces its --mode (only for a like-for-like comparison). */
  async startNode(node: string, mode?: string): Promise<StartResult> {
    await this.prepareNode(node);
    const plan = await this.nodePlan(node);
    if (mode) plan.args = plan.args.map((a) => (a.startsWith('--mode=') ? `--mode=${mode}` : a));
    return this.start(node, plan, `loopvol-node-${node}-${Date.now().toString(36)}`);
  }

  async startController(): Promise<StartResult> {
    await this.prepareNode('control-plane');
    return this.start(
      'controller',
      await this.controllerPlan(),
      `loopvol-controller-${Date.now().toString(36)}`,
    );
  }

  /** Takes a member out (its container is stopped by the caller, or already gone); kept for teardown. */
  async retire(role: string): Promise<Member> {
    const m = this.member(role);
    this.state.members = this.state.members.filter((x) => x.role !== role);
    this.state.retired.push(m.name);
    await this.save();
    return m;
  }

  clients(role: string): CsiClients {
    return csiClients(`unix://${this.member(role).socket}`);
  }

  /** The driver's pid on the host (it is pid 1 in its container). */
  async hostPid(name: string): Promise<number> {
    return Number(await docker(['inspect', '--format', '{{.State.Pid}}', name]));
  }

  /** Resident memory of the driver process, in bytes. */
  async rss(name: string): Promise<number> {
    const status = await fs.readFile(`/proc/${await this.hostPid(name)}/status`, 'utf8');
    return Number(/VmRSS:\s+(\d+) kB/.exec(status)?.[1] ?? 'NaN') * 1024;
  }

  /**
   * The floor under the driver's idle RSS on the image's own Node.js: bench/bare-server.mjs (grpc-js on
   * the same proto, constant answers) in a container of this image with the entrypoint's Node flags.
   * Bytes, read once it has listened and sat idle as long as the driver did.
   */
  async bareServerRss(idleMs: number): Promise<number> {
    const name = `loopvol-bare-${this.state.runId}`;
    await docker([
      'run',
      '--detach',
      '--name',
      name,
      '--label',
      `${LABEL}=${this.state.runId}`,
      '--network',
      'none',
      '--mount',
      `type=bind,source=${path.join(REPO, 'bench', 'bare-server.mjs')},target=/opt/loopvol/bench/bare-server.mjs,readonly`,
      '--entrypoint',
      'node',
      this.state.image,
      '--max-semi-space-size=1',
      '/opt/loopvol/bench/bare-server.mjs',
      'unix:///tmp/bare.sock',
    ]);
    try {
      const deadline = Date.now() + 30_000;
      while (!(await this.logs(name)).includes('ready')) {
        if (Date.now() > deadline)
          throw new Error(`the bare server never listened: ${await this.logs(name)}`);
        await new Promise((r) => setTimeout(r, 200));
      }
      await new Promise((r) => setTimeout(r, idleMs));
      return await this.rss(name);
    } finally {
      await docker(['rm', '--force', name]);
    }
  }

  async logs(name: string): Promise<string> {
    try {
      const { stdout, stderr } = await run(DOCKER, ['logs', name], { maxBuffer: 256 << 20 });
      return stdout + stderr;
    } catch {
      return '';
    }
  }

  /** Saves every container's log (the run's output directory) before they are removed. */
  async saveLogs(dir = process.env.LOOPVOL_CONTAINER_OUT): Promise<void> {
    if (!dir) return;
    await fs.mkdir(dir, { recursive: true });
    const names = await docker([
      'ps',
      '-a',
      '--filter',
      `label=${LABEL}=${this.state.runId}`,
      '--format',
      '{{.Names}}',
    ]);
    for (const n of names.split('\n').filter(Boolean))
      await fs.writeFile(path.join(dir, `${n}.log`), await this.logs(n));
  }

  /** Every container of this run (running or not), every mount and loop device under TOP, TOP's own mount. */
  async teardown(): Promise<{ containers: string[]; leaks: Leaks; left: Leaks }> {
    await this.saveLogs().catch(() => undefined);
    const ids = (await docker(['ps', '-aq', '--filter', `label=${LABEL}=${this.state.runId}`]))
      .split('\n')
      .filter(Boolean);
    const containers: string[] = [];
    for (const id of ids) {
      containers.push(await docker(['inspect', '--format', '{{.Name}}', id]).catch(() => id));
      await docker(['rm', '--force', '--volumes', id]);
    }
    const leaks = await cleanupUnder(this.root);
    await fs.rm(path.join(this.state.top, 'emptydir'), { recursive: true, force: true });
    const left = await leaksUnder(this.root);
    return { containers, leaks, left };
  }
}

/** Polls the socket until Probe answers ready (or the deadline passes). */
export async function waitReady(socket: string, name: string, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  let last = 'no socket yet';
  while (Date.now() < deadline) {
    if (await fs.stat(socket).catch(() => undefined)) {
      const c = csiClients(`unix://${socket}`);
      try {
        const r = await c.identity.Probe({}, { timeoutMs: 1000 });
        if (r.ready?.value !== false) return;
        last = 'Probe: not ready';
      } catch (err) {
        last = String(err);
      } finally {
        c.close();
      }
    }
    await new Promise((r) => setTimeout(r, 25));
  }
  const state = await docker([
    'inspect',
    '--format',
    '{{.State.Status}} exit={{.State.ExitCode}}',
    name,
  ]).catch((e: unknown) => String(e));
  const logs = await run(DOCKER, ['logs', '--tail', '30', name]).then(
    (r) => r.stdout + r.stderr,
    () => '',
  );
  throw new Error(`${name} was not ready in ${timeoutMs} ms (${last}; container ${state})\n${logs}`);
}
