/**
 * Command-line flags → a typed, validated Config. The names of the first eight flags are fixed by the
 * product contract (deploy manifests and outside harnesses use them); the rest are ours.
 */
import path from 'node:path';
import { parseArgs } from 'node:util';
import { NODE_ID_PATTERN } from './pool/ids.js';

export type Mode = 'all' | 'controller' | 'node';

export type Endpoint = { kind: 'unix'; path: string } | { kind: 'tcp'; host: string; port: number };

export interface Config {
  endpoint: Endpoint;
  nodeId: string | undefined;
  mode: Mode;
  driverName: string;
  poolDir: string;
  poolName: string;
  metricsAddress: { host: string; port: number } | undefined;
  logLevel: LogLevel;
  maxVolumesPerNode: number;
  overcommitRatio: number;
  defaultVolumeSize: number;
  loopDirectIo: boolean;
  shutdownTimeoutMs: number;
  freezeBudgetMs: number;
  createPool: boolean;
  nodeFenceMs: number;
  kubeletDir: string;
  perVolumeMetrics: boolean;
}

export const LOG_LEVELS = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'] as const;
export type LogLevel = (typeof LOG_LEVELS)[number];

export class ConfigError extends Error {
  override readonly name = 'ConfigError';
}

interface FlagSpec {
  name: string;
  value: string;
  default: string;
  help: string;
}

/** Every flag, in the order --help prints them. */
export const FLAGS: readonly FlagSpec[] = [
  {
    name: 'endpoint',
    value: 'URL',
    default: 'unix:///run/loopvol/csi.sock',
    help: 'CSI endpoint: unix:///abs/path.sock, or tcp://127.0.0.1:PORT for debugging',
  },
  {
    name: 'nodeid',
    value: 'NAME',
    default: '',
    help: "this node's name; required in the node and all modes",
  },
  { name: 'mode', value: 'MODE', default: 'all', help: 'services to serve: all, controller or node' },
  { name: 'driver-name', value: 'NAME', default: 'loopvol.csi.io', help: 'CSI driver name' },
  {
    name: 'pool-dir',
    value: 'DIR',
    default: '/var/lib/loopvol/pool',
    help: 'directory that holds the pool',
  },
  {
    name: 'create-pool',
    value: 'true|false',
    default: 'true',
    help: 'create a pool in --pool-dir when none is there; false for shared pools, so a filesystem that is not mounted never becomes a second, empty pool',
  },
  {
    name: 'pool-name',
    value: 'NAME',
    default: 'default',
    help: "the pool's name, the value of the loopvol.csi.io/pool topology key",
  },
  {
    name: 'metrics-address',
    value: 'HOST:PORT',
    default: '',
    help: 'serve Prometheus /metrics and /healthz here; off when empty',
  },
  { name: 'log-level', value: 'LEVEL', default: 'info', help: `log level: ${LOG_LEVELS.join(', ')}` },
  {
    name: 'max-volumes-per-node',
    value: 'N',
    default: '128',
    help: 'volumes one node accepts (NodeGetInfo reports it, ControllerPublishVolume enforces it)',
  },
  {
    name: 'overcommit-ratio',
    value: 'R',
    default: '1',
    help: 'how far sparse volumes may overcommit the pool: 1 promises only space that exists',
  },
  {
    name: 'default-volume-size',
    value: 'SIZE',
    default: '1Gi',
    help: 'size of a volume created without a capacity range (bytes, or Ki/Mi/Gi/Ti)',
  },
  {
    name: 'loop-direct-io',
    value: 'on|off',
    default: 'on',
    help: 'attach loop devices with direct I/O, so pages are not cached twice',
  },
  {
    name: 'freeze-budget',
    value: 'SECONDS',
    default: '5',
    help: 'longest a volume in use may stay frozen for a snapshot or clone on a pool that cannot reflink (longer copies are refused)',
  },
  {
    name: 'node-fence-seconds',
    value: 'SECONDS',
    default: '0',
    help: 'a volume the CO detached from a node that still held it waits until that node confirms it stopped using it; with N > 0 (at least 15), also until the node has been silent N s. Silence proves nothing on its own: use it only where a silent node cannot write (a watchdog reboots it)',
  },
  {
    name: 'kubelet-dir',
    value: 'DIR',
    default: '/var/lib/kubelet',
    help: "the kubelet's root directory: the node plugin's start-up check reports mounts of pool devices outside it, and a volume mounted at or above it is not one a target path may not lie in",
  },
  {
    name: 'per-volume-metrics',
    value: 'true|false',
    default: 'true',
    help: 'serve loopvol_volume_allocated_bytes, one series per volume (false for very large pools)',
  },
  {
    name: 'shutdown-timeout',
    value: 'SECONDS',
    default: '30',
    help: 'how long SIGTERM waits for calls in flight before closing them',
  },
];

export function helpText(): string {
  const width = Math.max(...FLAGS.map((f) => `--${f.name} ${f.value}`.length));
  const lines = FLAGS.map((f) => {
    const left = `--${f.name} ${f.value}`.padEnd(width);
    const def = f.default === '' ? '' : ` (default ${f.default})`;
    return `  ${left}  ${f.help}${def}`;
  });
  return [
    'Usage: loopvol [flags]            serve CSI on --endpoint',
    '       loopvol create-pool --pool-dir=DIR   create a pool once (see loopvol create-pool --help)',
    '       loopvol status|volumes|snapshots     the pool, its volumes and snapshots (tables, or --json)',
    '       loopvol check                        what is not as it should be, with what to do (exit 1 if any)',
    '       loopvol gc [--yes]                   remove what check proves safe to remove (dry run without --yes)',
    "       loopvol <command> --help             each command's flags and exit statuses",
    '',
    'loopvol is a CSI driver that turns a directory into a pool of loop-device volumes.',
    '',
    'Flags:',
    ...lines,
    `  ${'--help'.padEnd(width)}  print this help and exit`,
    `  ${'--version'.padEnd(width)}  print the version and exit`,
    '',
  ].join('\n');
}

const SIZE_UNITS: Record<string, number> = {
  '': 1,
  Ki: 2 ** 10,
  Mi: 2 ** 20,
  Gi: 2 ** 30,
  Ti: 2 ** 40,
  K: 1e3,
  M: 1e6,
  G: 1e9,
  T: 1e12,
};

/** Parses "1Gi", "512Mi", "1000000" into bytes. */
export function parseSize(text: string): number | undefined {
  const m = /^(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?$/.exec(text.trim());
  if (!m?.[1]) return undefined;
  const unit = SIZE_UNITS[m[2] ?? ''];
  if (unit === undefined) return undefined;
  const n = Number(m[1]) * unit;
  return Number.isSafeInteger(n) ? n : undefined;
}

/** CSI driver names: at most 63 characters, domain-name style (spec "GetPluginInfo"). */
const DRIVER_NAME_PATTERN = /^[A-Za-z0-9]([A-Za-z0-9.-]{0,61}[A-Za-z0-9])?$/;
/** Topology values: at most 63 characters, alphanumeric at both ends, '-', '_', '.' between. */
export const TOPOLOGY_VALUE_PATTERN = /^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$/;

function parseEndpoint(text: string): Endpoint {
  if (text.startsWith('unix:')) {
    // unix:///abs/path (URL form) and unix:/abs/path (gRPC form) both name an absolute path.
    const p = text.startsWith('unix://') ? text.slice('unix://'.length) : text.slice('unix:'.length);
    if (!path.isAbsolute(p) || p.length < 2) {
      throw new ConfigError(
        `--endpoint ${text}: a unix endpoint needs an absolute path, as in unix:///run/loopvol/csi.sock`,
      );
    }
    return { kind: 'unix', path: path.normalize(p) };
  }
  if (text.startsWith('tcp://')) {
    const hp = parseHostPort(text.slice('tcp://'.length));
    if (!hp)
      throw new ConfigError(
        `--endpoint ${text}: a tcp endpoint needs host:port, as in tcp://127.0.0.1:10000`,
      );
    return { kind: 'tcp', ...hp };
  }
  throw new ConfigError(`--endpoint ${text}: must start with unix:// or tcp://`);
}

function parseHostPort(text: string): { host: string; port: number } | undefined {
  const m = /^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]*):(\d{1,5})$/.exec(text);
  if (!m || m[1] === undefined || m[2] === undefined) return undefined;
  const port = Number(m[2]);
  if (port < 1 || port > 65535) return undefined;
  return { host: m[1] === '' ? '0.0.0.0' : m[1].replace(/^\[|\]$/g, ''), port };
}

export type ParseResult = { kind: 'help' } | { kind: 'version' } | { kind: 'run'; config: Config };

export function parseConfig(argv: readonly string[]): ParseResult {
  const options = Object.fromEntries([
    ...FLAGS.map((f) => [f.name, { type: 'string' as const }]),
    ['help', { type: 'boolean' as const, short: 'h' }],
    ['version', { type: 'boolean' as const }],
  ]) as Record<string, { type: 'string' | 'boolean'; short?: string }>;
  let values: Record<string, string | boolean | undefined>;
  try {
    const parsed = parseArgs({ args: [...argv], options, strict: true, allowPositionals: false });
    values = parsed.values;
  } catch (err) {
    const msg = err instanceof Error ? err.message.split('\n')[0] : String(err);
    throw new ConfigError(`${msg ?? 'bad arguments'} (see --help)`);
  }
  if (values.help === true) return { kind: 'help' };
  if (values.version === true) return { kind: 'version' };

  const get = (name: string): string => {
    const v = values[name];
    if (typeof v === 'string') return v;
    const spec = FLAGS.find((f) => f.name === name);
    return spec?.default ?? '';
  };

  const mode = get('mode');
  if (mode !== 'all' && mode !== 'controller' && mode !== 'node') {
    throw new ConfigError(`--mode ${mode}: must be all, controller or node`);
  }
  const nodeIdText = get('nodeid');
  const nodeId = nodeIdText === '' ? undefined : nodeIdText;
  if (mode !== 'controller' && nodeId === undefined) {
    throw new ConfigError(`--nodeid is required with --mode ${mode}`);
  }
  if (nodeId !== undefined && !NODE_ID_PATTERN.test(nodeId)) {
    throw new ConfigError(
      `--nodeid ${nodeId}: use 1-240 letters, digits, '.', '_' or '-', starting with a letter or digit`,
    );
  }
  const driverName = get('driver-name');
  if (!DRIVER_NAME_PATTERN.test(driverName)) {
    throw new ConfigError(
      `--driver-name ${driverName}: must be a domain-style name of at most 63 characters`,
    );
  }
  const poolDir = get('pool-dir');
  if (!path.isAbsolute(poolDir)) throw new ConfigError(`--pool-dir ${poolDir}: must be an absolute path`);
  const poolName = get('pool-name');
  if (!TOPOLOGY_VALUE_PATTERN.test(poolName)) {
    throw new ConfigError(
      `--pool-name ${poolName}: must be at most 63 characters, alphanumeric at both ends, with '-', '_' or '.' between`,
    );
  }
  const metricsText = get('metrics-address');
  let metricsAddress: Config['metricsAddress'];
  if (metricsText !== '') {
    metricsAddress = parseHostPort(metricsText);
    if (!metricsAddress) throw new ConfigError(`--metrics-address ${metricsText}: must be host:port`);
  }
  const logLevel = get('log-level');
  if (!(LOG_LEVELS as readonly string[]).includes(logLevel)) {
    throw new ConfigError(`--log-level ${logLevel}: must be one of ${LOG_LEVELS.join(', ')}`);
  }
  const maxText = get('max-volumes-per-node');
  const maxVolumesPerNode = /^\d+$/.test(maxText) ? Number(maxText) : NaN;
  if (!Number.isSafeInteger(maxVolumesPerNode) || maxVolumesPerNode < 1 || maxVolumesPerNode > 1_000_000) {
    throw new ConfigError(`--max-volumes-per-node ${maxText}: must be a whole number from 1 to 1000000`);
  }
  const ratioText = get('overcommit-ratio');
  const overcommitRatio = Number(ratioText);
  if (!/^\d+(\.\d+)?$/.test(ratioText) || !(overcommitRatio >= 1) || overcommitRatio > 1000) {
    throw new ConfigError(`--overcommit-ratio ${ratioText}: must be a number from 1 to 1000`);
  }
  const sizeText = get('default-volume-size');
  const defaultVolumeSize = parseSize(sizeText);
  if (defaultVolumeSize === undefined || defaultVolumeSize < 2 ** 20) {
    throw new ConfigError(`--default-volume-size ${sizeText}: must be a size of at least 1Mi, such as 1Gi`);
  }
  const dio = get('loop-direct-io');
  if (dio !== 'on' && dio !== 'off') throw new ConfigError(`--loop-direct-io ${dio}: must be on or off`);
  const shutdownText = get('shutdown-timeout');
  const shutdownSeconds = /^\d+$/.test(shutdownText) ? Number(shutdownText) : NaN;
  if (!Number.isSafeInteger(shutdownSeconds) || shutdownSeconds > 3600) {
    throw new ConfigError(`--shutdown-timeout ${shutdownText}: must be whole seconds from 0 to 3600`);
  }

  const fenceText = get('node-fence-seconds');
  const fenceSeconds = /^\d+$/.test(fenceText) ? Number(fenceText) : NaN;
  if (
    !Number.isSafeInteger(fenceSeconds) ||
    (fenceSeconds !== 0 && fenceSeconds < 15) ||
    fenceSeconds > 86_400
  ) {
    throw new ConfigError(
      `--node-fence-seconds ${fenceText}: must be 0 (off) or whole seconds from 15 (three heartbeats) to 86400`,
    );
  }
  const createText = get('create-pool');
  if (createText !== 'true' && createText !== 'false') {
    throw new ConfigError(`--create-pool ${createText}: must be true or false`);
  }
  const kubeletDir = get('kubelet-dir');
  if (!path.isAbsolute(kubeletDir))
    throw new ConfigError(`--kubelet-dir ${kubeletDir}: must be an absolute path`);
  const perVolumeText = get('per-volume-metrics');
  if (perVolumeText !== 'true' && perVolumeText !== 'false') {
    throw new ConfigError(`--per-volume-metrics ${perVolumeText}: must be true or false`);
  }
  const budgetText = get('freeze-budget');
  const budgetSeconds = /^\d+(\.\d+)?$/.test(budgetText) ? Number(budgetText) : NaN;
  if (!(budgetSeconds >= 0) || budgetSeconds > 3600) {
    throw new ConfigError(`--freeze-budget ${budgetText}: must be seconds from 0 to 3600`);
  }

  return {
    kind: 'run',
    config: {
      endpoint: parseEndpoint(get('endpoint')),
      nodeId,
      mode,
      driverName,
      poolDir: path.normalize(poolDir),
      poolName,
      metricsAddress,
      logLevel: logLevel as LogLevel,
      maxVolumesPerNode,
      overcommitRatio,
      defaultVolumeSize,
      loopDirectIo: dio === 'on',
      shutdownTimeoutMs: shutdownSeconds * 1000,
      freezeBudgetMs: Math.round(budgetSeconds * 1000),
      createPool: createText === 'true',
      nodeFenceMs: fenceSeconds * 1000,
      kubeletDir: path.normalize(kubeletDir),
      perVolumeMetrics: perVolumeText === 'true',
    },
  };
}

export const servesController = (c: Pick<Config, 'mode'>): boolean => c.mode !== 'node';
export const servesNode = (c: Pick<Config, 'mode'>): boolean => c.mode !== 'controller';
