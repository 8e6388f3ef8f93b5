import { describe, expect, it } from 'vitest';
import { ConfigError, FLAGS, helpText, parseConfig, parseSize } from '../../src/config.js';

function run(args: string[]) {
  const r = parseConfig(args);
  if (r.kind !== 'run') throw new Error(`expected a run config, got ${r.kind}`);
  return r.config;
}

function error(args: string[]): string {
  try {
    parseConfig(args);
  } catch (err) {
    expect(err).toBeInstanceOf(ConfigError);
    const msg = (err as Error).message;
    expect(msg).not.toContain('\n');
    return msg;
  }
  throw new Error('expected a ConfigError');
}

describe('parseConfig', () => {
  it('applies the documented defaults', () => {
    const c = run(['--nodeid', 'n1']);
    expect(c.endpoint).toEqual({ kind: 'unix', path: '/run/loopvol/csi.sock' });
    expect(c.mode).toBe('all');
    expect(c.driverName).toBe('loopvol.csi.io');
    expect(c.poolDir).toBe('/var/lib/loopvol/pool');
    expect(c.poolName).toBe('default');
    expect(c.metricsAddress).toBeUndefined();
    expect(c.logLevel).toBe('info');
    expect(c.maxVolumesPerNode).toBe(128);
    expect(c.overcommitRatio).toBe(1);
    expect(c.defaultVolumeSize).toBe(2 ** 30);
    expect(c.loopDirectIo).toBe(true);
    expect(c.nodeFenceMs).toBe(0); // silence never releases a volume unless an operator opts in
    expect(run(['--nodeid', 'n1', '--node-fence-seconds=15']).nodeFenceMs).toBe(15_000);
  });

  it('accepts every flag in both --flag value and --flag=value forms', () => {
    const c = run([
      '--endpoint=tcp://127.0.0.1:10000',
      '--nodeid',
      'node-a.example',
      '--mode=node',
      '--driver-name',
      'loop.example.com',
      '--pool-dir=/srv/pool',
      '--pool-name',
      'shared-1',
      '--metrics-address=127.0.0.1:9808',
      '--log-level=debug',
      '--max-volumes-per-node=16',
      '--overcommit-ratio=2.5',
      '--default-volume-size=512Mi',
      '--loop-direct-io=off',
      '--shutdown-timeout=5',
    ]);
    expect(c.endpoint).toEqual({ kind: 'tcp', host: '127.0.0.1', port: 10000 });
    expect(c).toMatchObject({
      nodeId: 'node-a.example',
      mode: 'node',
      driverName: 'loop.example.com',
      poolDir: '/srv/pool',
      poolName: 'shared-1',
      metricsAddress: { host: '127.0.0.1', port: 9808 },
      logLevel: 'debug',
      maxVolumesPerNode: 16,
      overcommitRatio: 2.5,
      defaultVolumeSize: 512 * 2 ** 20,
      loopDirectIo: false,
      shutdownTimeoutMs: 5000,
    });
  });

  it('accepts the gRPC unix:/path form and controller mode without a node id', () => {
    const c = run(['--endpoint', 'unix:/tmp/x.sock', '--mode', 'controller']);
    expect(c.endpoint).toEqual({ kind: 'unix', path: '/tmp/x.sock' });
    expect(c.nodeId).toBeUndefined();
  });

  it.each([
    [['--mode', 'node'], '--nodeid is required with --mode node'],
    [[], '--nodeid is required with --mode all'],
    [['--nodeid', 'n', '--endpoint', 'http://x'], 'must start with unix:// or tcp://'],
    [['--nodeid', 'n', '--endpoint', 'unix://relative.sock'], 'absolute path'],
    [['--nodeid', 'n', '--endpoint', 'tcp://localhost'], 'host:port'],
    [['--nodeid', 'n', '--endpoint', 'tcp://127.0.0.1:70000'], 'host:port'],
    [['--nodeid', 'n', '--mode', 'both'], 'must be all, controller or node'],
    [['--nodeid', '../etc'], '--nodeid ../etc'],
    [['--nodeid', 'n', '--pool-dir', 'pool'], 'absolute path'],
    [['--nodeid', 'n', '--pool-name', '-bad-'], '--pool-name'],
    [['--nodeid', 'n', '--driver-name', 'has space'], '--driver-name'],
    [['--nodeid', 'n', '--metrics-address', 'nope'], 'host:port'],
    [['--nodeid', 'n', '--log-level', 'loud'], '--log-level'],
    [['--nodeid', 'n', '--max-volumes-per-node', '0'], '--max-volumes-per-node'],
    [['--nodeid', 'n', '--overcommit-ratio', '0.5'], '--overcommit-ratio'],
    [['--nodeid', 'n', '--default-volume-size', '10'], '--default-volume-size'],
    [['--nodeid', 'n', '--loop-direct-io', 'yes'], '--loop-direct-io'],
    [['--nodeid', 'n', '--node-fence-seconds', '4'], 'must be 0 (off) or whole seconds from 15'],
    [['--nodeid', 'n', '--node-fence-seconds', '86401'], '--node-fence-seconds 86401'],
    [['--nodeid', 'n', '--node-fence-seconds', '1.5'], '--node-fence-seconds 1.5'],
    [['--nodeid', 'n', '--unknown-flag'], 'Unknown option'],
    [['--nodeid', 'n', 'positional'], 'positional'],
  ])('rejects %j with a one-line reason', (args, fragment) => {
    expect(error(args)).toContain(fragment);
  });

  it('answers --help and --version', () => {
    expect(parseConfig(['--help']).kind).toBe('help');
    expect(parseConfig(['--version']).kind).toBe('version');
  });

  it('documents every flag in --help', () => {
    const text = helpText();
    for (const f of FLAGS) expect(text).toContain(`--${f.name}`);
    for (const fixed of [
      'endpoint',
      'nodeid',
      'mode',
      'driver-name',
      'pool-dir',
      'pool-name',
      'metrics-address',
      'log-level',
    ]) {
      expect(FLAGS.map((f) => f.name)).toContain(fixed);
    }
  });
});

describe('parseSize', () => {
  it.each([
    ['1Gi', 2 ** 30],
    ['512Mi', 512 * 2 ** 20],
    ['1000', 1000],
    ['2G', 2e9],
  ])('%s = %d', (text, n) => {
    expect(parseSize(text)).toBe(n);
  });
  it.each(['', 'Gi', '1.5Gi', '-1', '1Zi'])('rejects %j', (text) => {
    expect(parseSize(text)).toBeUndefined();
  });
});
