/**
 * The real binary on a real socket: flags, Identity over @grpc/grpc-js, stale and live sockets,
 * SIGTERM, and that secrets never reach the log.
 */
import { execFileSync } from 'node:child_process';
import { closeSync, constants, openSync, writeSync } from 'node:fs';
import fs from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { type DriverArgs, type DriverProcess, runMain } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { isRoot, leaksUnder, MiB, SLOW } from '../helpers/host.js';
import { createVolume, stage } from '../helpers/volumes.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const dir = (tag: string): Promise<string> => env.dir(tag);
const driver = (args: DriverArgs): Promise<DriverProcess> => env.driver(args);

function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const srv = net.createServer().listen(0, '127.0.0.1', () => {
      const p = (srv.address() as net.AddressInfo).port;
      srv.close(() => {
        resolve(p);
      });
    });
  });
}

describe('flags', () => {
  it('prints --help with every flag and exits 0', async () => {
    const r = await runMain(['--help']);
    expect(r.code).toBe(0);
    for (const flag of [
      '--endpoint',
      '--nodeid',
      '--mode',
      '--driver-name',
      '--pool-dir',
      '--pool-name',
      '--metrics-address',
      '--log-level',
    ]) {
      expect(r.stdout).toContain(flag);
    }
  });

  it.each([
    [['--mode', 'node'], '--nodeid is required'],
    [['--nodeid', 'n1', '--endpoint', 'http://127.0.0.1:1'], 'unix:// or tcp://'],
    [['--nodeid', 'n1', '--bogus'], 'Unknown option'],
  ])('exits non-zero with a one-line reason for %j', async (args, fragment) => {
    const r = await runMain(args);
    expect(r.code).toBe(2);
    expect(r.stderr).toContain(fragment);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
  });
});

describe('identity over a unix socket', () => {
  it('answers GetPluginInfo, GetPluginCapabilities and Probe', async () => {
    const d = await driver({ dir: await dir('identity') });
    const info = await d.clients.identity.GetPluginInfo({});
    const pkg = JSON.parse(await fs.readFile(new URL('../../package.json', import.meta.url), 'utf8')) as {
      version: string;
    };
    expect(info.name).toBe('loopvol.csi.io');
    expect(info.vendor_version).toBe(pkg.version);
    const caps = await d.clients.identity.GetPluginCapabilities({});
    const services = caps.capabilities.map((c) => c.service?.type).filter(Boolean);
    expect(services).toContain('CONTROLLER_SERVICE');
    expect(services).toContain('VOLUME_ACCESSIBILITY_CONSTRAINTS');
    expect(caps.capabilities.map((c) => c.volume_expansion?.type).filter(Boolean)).toEqual(['ONLINE']);
    const probe = await d.clients.identity.Probe({});
    expect(probe.ready?.value).toBe(true);
  });

  it('does not offer the controller service in node mode', async () => {
    const d = await driver({ dir: await dir('nodemode'), mode: 'node' });
    const caps = await d.clients.identity.GetPluginCapabilities({});
    expect(caps.capabilities.map((c) => c.service?.type)).not.toContain('CONTROLLER_SERVICE');
    expect(await codeOf(d.clients.controller.ControllerGetCapabilities({}))).toBe('UNIMPLEMENTED');
  });

  it('answers Probe with FAILED_PRECONDITION naming the problem when the pool is gone', async () => {
    const d = await driver({ dir: await dir('probe') });
    await fs.rm(d.poolDir, { recursive: true, force: true });
    const err = await errorOf(d.clients.identity.Probe({}));
    expect(err.code).toBe('FAILED_PRECONDITION');
    expect(err.details).toContain('pool');
    expect(
      await d.waitForLog((l) => l.includes('"method":"Probe"') && l.includes('FAILED_PRECONDITION')),
    ).toBe(true);
  });

  it('serves a custom driver name', async () => {
    const d = await driver({ dir: await dir('name'), extra: ['--driver-name=loop.example.com'] });
    expect((await d.clients.identity.GetPluginInfo({})).name).toBe('loop.example.com');
  });
});

/** When `d` logged `msg` (its line's own time), NaN when it did not. */
const logTime = (d: DriverProcess, msg: string): number => {
  const line = d.logs().find((l) => l.includes(`"msg":"${msg}"`));
  return line ? Date.parse((JSON.parse(line) as { time: string }).time) : Number.NaN;
};

describe('the socket', () => {
  it('creates the parent directory and removes the socket on SIGTERM, exiting 0', async () => {
    const base = await dir('sigterm');
    const socket = path.join(base, 'deep', 'er', 'csi.sock');
    const d = await driver({ dir: base, socket });
    expect((await fs.lstat(socket)).isSocket()).toBe(true);
    expect(await d.stop('SIGTERM')).toBe(0);
    await expect(fs.lstat(socket)).rejects.toThrow(/ENOENT/);
  });

  it('replaces a stale socket left by a killed driver', async () => {
    const base = await dir('stale');
    const first = await driver({ dir: base });
    await first.stop('SIGKILL');
    expect((await fs.lstat(first.socket)).isSocket()).toBe(true);
    const second = await driver({ dir: base });
    expect((await second.clients.identity.GetPluginInfo({})).name).toBe('loopvol.csi.io');
    expect(await second.waitForLog((l) => l.includes('stale socket'))).toBe(true);
  });

  it('refuses to start when a live driver serves the socket', async () => {
    const base = await dir('live');
    const first = await driver({ dir: base });
    const r = await runMain([
      `--endpoint=unix://${first.socket}`,
      '--nodeid=n2',
      `--pool-dir=${path.join(base, 'pool2')}`,
    ]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain('already serving');
    expect((await first.clients.identity.GetPluginInfo({})).name).toBe('loopvol.csi.io');
  });

  it.skipIf(!isRoot())(
    'a successor on the same socket serves only once its predecessor has finished its calls and exited',
    async () => {
      const base = await dir('successor');
      // The pause outlasts the successor's start up to its wait for the predecessor, on a loaded machine
      // too; the shutdown timeout outlasts the pause, so the stage finishes and is not cancelled.
      const first = await driver({
        dir: base,
        env: { LOOPVOL_PAUSEPOINT: `stage:attached:${10_000 * SLOW}` },
        extra: [`--shutdown-timeout=${Math.ceil(30 * SLOW)}`],
      });
      const cap = mountCap('ext4');
      const made = await createVolume(first, `pvc-successor-${Date.now().toString(36)}`, cap, 32 * MiB);
      const staging = path.join(base, 'staging');
      const staged = codeOf(stage(first, made.id, staging, cap));
      expect(await first.waitForLog((l) => l.includes('attached loop device'))).toBe(true);
      // A DaemonSet rollout: the old container is told to stop while the stage is in flight, and the
      // new one starts at once. The old one stops listening at once but finishes the stage.
      first.proc.kill('SIGTERM');
      let exitedAt = 0;
      const exited = first.exited.then((c) => {
        exitedAt = Date.now();
        return c;
      });
      // Started while the old one still answers on the socket for a moment (the signal takes a moment
      // to act): its own log, not an answer on the socket, says when the new one began to serve.
      const second = await driver({ dir: base });
      expect(await staged).toBe('OK');
      expect(await exited).toBe(0);
      expect(exitedAt).toBeGreaterThan(0);
      expect(await second.waitForLog((l) => l.includes('"msg":"loopvol is serving"'))).toBe(true);
      expect(logTime(second, 'loopvol is serving')).toBeGreaterThanOrEqual(logTime(first, 'stopped'));
      expect(await second.waitForLog((l) => l.includes('still finishing its calls'))).toBe(true);
      // The successor owns the volume now: it tears the staging down.
      expect(
        await codeOf(
          second.clients.node.NodeUnstageVolume({ volume_id: made.id, staging_target_path: staging }),
        ),
      ).toBe('OK');
    },
  );

  it.skipIf(!isRoot())(
    'a call cancelled at the shutdown timeout undoes what it did before the driver exits',
    async () => {
      const base = await dir('shutdown-undo');
      const c = await driver({ dir: base });
      // A node plugin, as deployed: told to stop (a rollout) while a stage waits at a step.
      const d = await driver({
        dir: base,
        socket: path.join(base, 'node-2.sock'),
        nodeId: 'node-2',
        mode: 'node',
        extra: ['--shutdown-timeout=1'],
        env: { LOOPVOL_PAUSEPOINT: 'stage:attached:3000' },
      });
      const cap = mountCap('ext4');
      const made = await createVolume(c, `pvc-shutdown-undo-${Date.now().toString(36)}`, cap, 32 * MiB);
      const staged = codeOf(stage(d, made.id, path.join(base, 'staging'), cap));
      expect(await d.waitForLog((l) => l.includes('attached loop device'))).toBe(true);
      d.proc.kill('SIGTERM');
      expect(await staged).toBe('CANCELLED');
      expect(await d.exited).toBe(0);
      // The stage's undo ran to its end: nothing attached or mounted, and the node's lease let go.
      expect(await leaksUnder(base)).toEqual({ loops: [], mounts: [] });
      const fences = JSON.parse(
        await fs.readFile(path.join(d.poolDir, 'volumes', made.id, 'fences.json'), 'utf8'),
      ) as { leases: object };
      expect(fences.leases).toEqual({});
    },
  );

  it('serves an endpoint at the longest path a unix socket can have, its presence socket beside it', async () => {
    const base = await dir('long');
    const socket = path.join(base, 'x'.repeat(Math.max(1, 107 - base.length - '/.sock'.length)) + '.sock');
    expect(Buffer.byteLength(socket)).toBe(107);
    const d = await driver({ dir: base, socket });
    expect((await d.clients.identity.GetPluginInfo({})).name).toBe('loopvol.csi.io');
    expect((await fs.lstat(path.join(base, '.lvp'))).isSocket()).toBe(true);
  });

  it('exits with a one-line reason when the pool directory cannot be used', async () => {
    const base = await dir('badpool');
    const file = path.join(base, 'not-a-dir');
    await fs.writeFile(file, 'x');
    const r = await runMain([
      `--endpoint=unix://${path.join(base, 'csi.sock')}`,
      '--nodeid=n1',
      `--pool-dir=${file}/pool`,
    ]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain('cannot use');
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
  });

  it('listens while its pool does not answer, and exits on SIGTERM all the same', async () => {
    // A pool whose pool.json never answers a read (a FIFO nobody writes), as a hung NFS server's: the
    // open blocks one of libuv's threads for good, which process.exit() would wait for.
    const base = await dir('hungpool');
    const poolDir = path.join(base, 'pool');
    await fs.mkdir(poolDir);
    execFileSync('mkfifo', [path.join(poolDir, 'pool.json')]);
    const d = await driver({
      dir: base,
      poolDir,
      mode: 'controller',
      extra: ['--create-pool=false', '--shutdown-timeout=1'],
    });
    const e = await errorOf(d.clients.identity.Probe({}));
    expect({ code: e.code, details: e.details }).toEqual({
      code: 'FAILED_PRECONDITION',
      details: expect.stringMatching(/is not open after 2 s/) as string,
    });
    const started = Date.now();
    d.proc.kill('SIGTERM');
    const ended = await Promise.race([
      d.exited.then(() => Date.now() - started),
      new Promise<undefined>((r) =>
        setTimeout(() => {
          r(undefined);
        }, 20_000),
      ),
    ]);
    try {
      expect({ ended: ended !== undefined, signal: d.proc.signalCode, said: d.stderr() }).toEqual({
        ended: true,
        signal: 'SIGKILL',
        said: expect.stringContaining('blocked on it') as string,
      });
    } finally {
      // A driver still reading the FIFO (this test failed) gets its answer; with no reader, nothing to do.
      try {
        const w = openSync(path.join(poolDir, 'pool.json'), constants.O_WRONLY | constants.O_NONBLOCK);
        writeSync(w, '{}');
        closeSync(w);
      } catch {
        // ENXIO: nobody reads it
      }
    }
  });

  it('refuses to replace a file that is not a socket', async () => {
    const base = await dir('notsock');
    const file = path.join(base, 'csi.sock');
    await fs.writeFile(file, 'precious');
    const r = await runMain([
      `--endpoint=unix://${file}`,
      '--nodeid=n1',
      `--pool-dir=${path.join(base, 'pool')}`,
    ]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain('not a socket');
    expect(await fs.readFile(file, 'utf8')).toBe('precious');
  });

  it('serves tcp:// for debugging', async () => {
    const base = await dir('tcp');
    const port = await freePort();
    const { spawn } = await import('node:child_process');
    const { MAIN } = await import('../helpers/driver.js');
    const proc = spawn(
      process.execPath,
      [MAIN, `--endpoint=tcp://127.0.0.1:${port}`, '--nodeid=n1', `--pool-dir=${base}/pool`],
      { stdio: 'ignore' },
    );
    try {
      const { csiClients } = await import('../helpers/grpc.js');
      const c = csiClients(`127.0.0.1:${port}`);
      let name = '';
      // As long as a driver may take to start on a loaded machine (startDriverProcess waits as long).
      const until = Date.now() + 30_000 * SLOW;
      while (!name && Date.now() < until) {
        name = await c.identity.GetPluginInfo({}, { timeoutMs: 500 }).then(
          (r) => r.name,
          () => '',
        );
        if (!name) await new Promise((r) => setTimeout(r, 50));
      }
      c.close();
      expect(name).toBe('loopvol.csi.io');
    } finally {
      proc.kill('SIGTERM');
    }
  });
});

describe('metrics', () => {
  it('serves /metrics with per-call histograms, /healthz that follows Probe, and /livez', async () => {
    const base = await dir('metrics');
    const port = await freePort();
    const d = await driver({ dir: base, extra: [`--metrics-address=127.0.0.1:${port}`] });
    await d.clients.identity.Probe({});
    await codeOf(d.clients.controller.DeleteVolume({ volume_id: '' }));
    const metrics = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text();
    expect(metrics).toMatch(
      /loopvol_rpc_duration_seconds_count\{service="Controller",method="DeleteVolume",code="INVALID_ARGUMENT"\} 1/,
    );
    expect(metrics).toMatch(/loopvol_pool_bytes\{kind="available"\} \d+/);
    expect(metrics).toContain('loopvol_process_resident_memory_bytes');
    const ok = await fetch(`http://127.0.0.1:${port}/healthz`);
    expect(ok.status).toBe(200);
    await fs.rm(d.poolDir, { recursive: true, force: true });
    const sick = await fetch(`http://127.0.0.1:${port}/healthz`);
    expect(sick.status).toBe(503);
    expect(await sick.text()).toContain('pool');
    // Still alive: a missing pool makes it not ready, never a process to restart.
    expect((await fetch(`http://127.0.0.1:${port}/livez`)).status).toBe(200);
  });
});

describe('logging', () => {
  it('logs one line per call with method, duration and code, and never a secret', async () => {
    const d = await driver({ dir: await dir('logs') });
    await codeOf(
      d.clients.controller.CreateVolume({
        name: 'secret-test',
        secrets: { password: 'hunter2-do-not-log' },
        volume_capabilities: [],
      }),
    );
    await codeOf(
      d.clients.node.NodeStageVolume({ volume_id: 'x', secrets: { token: 'hunter2-do-not-log' } }),
    );
    await d.waitForLog((l) => l.includes('"method":"NodeStageVolume"'));
    await d.waitForLog((l) => l.includes('"method":"CreateVolume"'));
    const lines = d.logs();
    expect(lines.join('\n')).not.toContain('hunter2-do-not-log');
    const create = lines
      .map((l) => JSON.parse(l) as Record<string, unknown>)
      .filter((l) => l.method === 'CreateVolume');
    expect(create).toHaveLength(1);
    expect(create[0]).toMatchObject({
      name: 'secret-test',
      code: expect.any(String) as unknown,
      ms: expect.any(Number) as unknown,
    });
    expect(JSON.stringify(create[0])).toContain('[REDACTED]');
  });
});
