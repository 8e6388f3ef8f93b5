/**
 * The operator's commands against a pool with every kind of leak and inconsistency made for real
 * (root only): a loop device attached by hand from a pool image, a leaked mount, a mount of a staged
 * volume outside the kubelet directory, a hand-frozen filesystem, a fenced one, a stale lease of a
 * node that was removed, an image without a record, a corrupt record, a record without an image, a
 * quarantined record, an abandoned lock and old trash. `check` must find exactly those, `gc` must
 * remove exactly the safe ones and nothing else, and both must say so in their exit statuses. The
 * server's start-up report says the same, in its log and its metrics. A driver serves the pool all
 * along: the commands work beside it.
 */
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type DriverProcess, runMain } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { errorOf } from '../helpers/grpc.js';
import { isMounted, isRoot, MiB, RUN } from '../helpers/host.js';

const env = new TestEnv();
const thawAtEnd: string[] = [];
afterAll(async () => {
  for (const mp of thawAtEnd) spawnSync('fsfreeze', ['--unfreeze', mp], { stdio: 'ignore' });
  expect(await env.teardown()).toEqual([]);
});

const sh = (cmd: string, args: string[]): string => execFileSync(cmd, args, { encoding: 'utf8' }).trim();

interface Found {
  kind: string;
  severity: string;
  subject: string;
  gc?: { action: string };
  gcSkipped?: string;
}

/** The loop device's backing file as sysfs shows it ('' once detached). */
async function backing(dev: string): Promise<string> {
  return fs
    .readFile(`/sys/block/${path.basename(dev)}/loop/backing_file`, 'utf8')
    .then((t) => t.trim())
    .catch(() => '');
}

async function waitFor(what: string, ok: () => Promise<boolean>, seconds = 15): Promise<void> {
  const end = Date.now() + seconds * 1000;
  while (!(await ok())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

describe.skipIf(!isRoot())('loopvol check and gc', () => {
  let base: string;
  let pool: string;
  let kubelet: string;
  let d: DriverProcess;
  const ids: Record<string, string> = {};
  const dev: Record<string, string> = {};
  const p: Record<string, string> = {};
  let oldTrashAt = 0;

  /**
   * The --trash-age of every check: the fresh entry, freshened just before a command starts, must still
   * be younger when that command reaches the trash, also on a machine loaded by other test files.
   */
  const TRASH_AGE = 10;
  /** Keeps the fresh trash entry younger than --trash-age (adding a file changes its ctime). */
  const freshen = async () => {
    if (!p.freshTrash) return;
    await fs.mkdir(p.freshTrash, { recursive: true });
    await fs.writeFile(path.join(p.freshTrash, `f${Date.now()}`), '');
  };
  const loopvol = async (args: string[]) => {
    await freshen();
    const r = await runMain([...args, `--pool-dir=${pool}`]);
    return {
      ...r,
      json:
        r.stdout.trim().startsWith('{') || r.stdout.trim().startsWith('[')
          ? (JSON.parse(r.stdout) as unknown)
          : undefined,
    };
  };
  const checkArgs = () => [`--kubelet-dir=${kubelet}`, `--trash-age=${TRASH_AGE}`, '--json'];
  const findings = async (extra: string[] = []) => {
    const r = await loopvol(['check', ...checkArgs(), ...extra]);
    const body = r.json as { findings: Found[]; exitCode: number };
    expect(body.exitCode).toBe(r.code);
    return { code: r.code, found: body.findings };
  };
  const pairs = (found: readonly Found[]) => found.map((f) => `${f.kind} ${f.subject}`).sort();

  const create = async (tag: string, cap = mountCap('ext4'), labels = true): Promise<string> => {
    const r = await d.clients.controller.CreateVolume({
      name: `pvc-op-${tag}-${RUN}`,
      capacity_range: { required_bytes: String(16 * MiB) },
      volume_capabilities: [cap],
      parameters: labels
        ? {
            'csi.storage.k8s.io/pvc/name': `data-${tag}`,
            'csi.storage.k8s.io/pvc/namespace': 'ops',
            'csi.storage.k8s.io/pv/name': `pv-${tag}`,
          }
        : {},
    });
    const id = r.volume?.volume_id ?? '';
    ids[tag] = id;
    return id;
  };
  const image = (id: string) => path.join(pool, 'volumes', id, 'disk.img');
  const stage = async (node: DriverProcess, nodeId: string, tag: string, cap = mountCap('ext4')) => {
    const staging = path.join(kubelet, nodeId, tag, 'staging');
    await fs.mkdir(staging, { recursive: true });
    await d.clients.controller.ControllerPublishVolume({
      volume_id: ids[tag],
      node_id: nodeId,
      volume_capability: cap,
    });
    await node.clients.node.NodeStageVolume({
      volume_id: ids[tag],
      staging_target_path: staging,
      volume_capability: cap,
    });
    return staging;
  };

  beforeAll(async () => {
    base = await env.dir('operator');
    pool = path.join(base, 'pool');
    kubelet = path.join(base, 'kubelet');
    d = await env.driver({ dir: base, nodeId: 'node-1' });

    // A: a loop device attached by hand from a pool image. It is snapshotted first (a listing).
    await create('a');
    await d.clients.controller.CreateSnapshot({ name: `snap-op-a-${RUN}`, source_volume_id: ids.a });
    dev.a = sh('losetup', ['--find', '--show', image(ids.a ?? '')]);
    env.declareOwn(dev.a);

    // B: staged (raw block) on a node that is then removed: killed, its registration and heartbeat gone.
    await create('b', blockCap());
    const gone = await env.driver({
      dir: base,
      nodeId: 'node-gone',
      mode: 'node',
      socket: path.join(base, 'gone.sock'),
    });
    await stage(gone, 'node-gone', 'b', blockCap());
    await gone.stop('SIGKILL');
    const fencesB = await fs.readFile(path.join(pool, 'volumes', ids.b ?? '', 'fences.json'), 'utf8');
    dev.b = `/dev/${(JSON.parse(fencesB) as { leases: Record<string, { device: string }> }).leases['node-gone']?.device ?? '?'}`;
    env.declareOwn(dev.b); // the removed node's device: left for its "reboot", the teardown
    for (const f of ['node-gone.json', 'node-gone.alive'])
      await fs.rm(path.join(pool, 'nodes', f), { force: true });

    // C: an image without a record.
    ids.c = `vol-${'c'.repeat(32)}`;
    await fs.mkdir(path.join(pool, 'volumes', ids.c));
    await fs.writeFile(image(ids.c), Buffer.alloc(4096, 1));

    // D: a corrupt record. E: a record without an image.
    await create('d');
    await fs.writeFile(path.join(pool, 'volumes', ids.d ?? '', 'meta.json'), '{"format": 1, "id": ');
    await create('e');
    await fs.rm(image(ids.e ?? ''));

    // Q: a corrupt record that a DeleteVolume quarantined, and its image attached by hand.
    await create('q');
    await fs.writeFile(path.join(pool, 'volumes', ids.q ?? '', 'meta.json'), 'not json');
    expect((await errorOf(d.clients.controller.DeleteVolume({ volume_id: ids.q ?? '' }))).code).toBe(
      'FAILED_PRECONDITION',
    );
    const [qEntry] = (await fs.readdir(path.join(pool, 'quarantine'))).filter((e) =>
      e.startsWith(ids.q ?? '-'),
    );
    p.quarantined = path.join(pool, 'quarantine', qEntry ?? '');
    dev.q = sh('losetup', ['--find', '--show', '--read-only', path.join(p.quarantined, 'disk.img')]);
    env.declareOwn(dev.q);

    // An abandoned lock: its holder, a process of this host, has exited.
    const child = spawnSync(process.execPath, ['-e', 'process.stdout.write(String(process.pid))'], {
      encoding: 'utf8',
    });
    p.lock = path.join(pool, 'locks', 'operator-test.lock');
    await fs.writeFile(
      p.lock,
      JSON.stringify({
        host: sh('hostname', []),
        bootId: (await fs.readFile('/proc/sys/kernel/random/boot_id', 'utf8')).trim(),
        pidNs: await fs.readlink('/proc/self/ns/pid'),
        pid: Number(child.stdout),
        start: '1',
        token: 'abandoned',
        purpose: 'a test lock',
        since: new Date().toISOString(),
      }),
    );

    // F: a leaked mount (read-only, outside the kubelet directory) of a device attached by hand.
    await create('f');
    dev.f = sh('losetup', ['--find', '--show', image(ids.f ?? '')]);
    env.declareOwn(dev.f);
    sh('mkfs.ext4', ['-q', '-F', dev.f]);
    p.stray = path.join(base, 'stray');
    await fs.mkdir(p.stray);
    sh('mount', ['-o', 'ro', dev.f, p.stray]);
    env.declareOwn(p.stray);
  });

  it('reports at start what check would say, in the log and the metrics', async () => {
    // A node plugin starting on this host (before anything is frozen: a start thaws what it did not fence).
    const node2 = await env.driver({
      dir: base,
      nodeId: 'node-2',
      mode: 'node',
      socket: path.join(base, 'node-2.sock'),
      extra: ['--metrics-address=127.0.0.1:19841', `--kubelet-dir=${kubelet}`],
    });
    expect(
      await node2.waitForLog(
        (l) => l.includes('loopvol check: ') && l.includes(`leaked-loop-device ${dev.a ?? ''}`),
      ),
    ).toBe(true);
    const hostMetrics = await (await fetch('http://127.0.0.1:19841/metrics')).text();
    expect(hostMetrics).toContain('loopvol_check_findings{scope="host",kind="leaked-loop-device"} 3');
    expect(hostMetrics).toContain('loopvol_check_findings{scope="host",kind="leaked-mount"} 1');
    await node2.stop();
    const ctl = await env.driver({
      dir: base,
      mode: 'controller',
      socket: path.join(base, 'ctl.sock'),
      extra: ['--metrics-address=127.0.0.1:19842'],
    });
    expect(
      await ctl.waitForLog((l) => l.includes('problem(s) in the pool') && l.includes('image-without-record')),
    ).toBe(true);
    const poolMetrics = await (await fetch('http://127.0.0.1:19842/metrics')).text();
    for (const kind of [
      'image-without-record',
      'damaged-record',
      'record-without-image',
      'quarantined-record',
    ])
      expect(poolMetrics).toContain(`loopvol_check_findings{scope="pool",kind="${kind}"} 1`);
    await ctl.stop();
  });

  it('finds exactly what is wrong, and exits 1', async () => {
    // Trash (made now: every driver start sweeps it): one entry older than --trash-age by the time of
    // the check, one kept fresh.
    p.oldTrash = path.join(pool, 'trash', `vol-${'0'.repeat(32)}.0123456789ab`);
    await fs.mkdir(p.oldTrash);
    await fs.writeFile(path.join(p.oldTrash, 'meta.json'), '{}');
    oldTrashAt = Date.now();
    p.freshTrash = path.join(pool, 'trash', `vol-${'1'.repeat(32)}.fre5h0`);
    // G: staged under the kubelet directory, bound elsewhere by hand, then frozen by hand.
    await create('g');
    p.g = await stage(d, 'node-1', 'g');
    p.elsewhere = path.join(base, 'elsewhere');
    await fs.mkdir(p.elsewhere);
    sh('mount', ['--bind', p.g, p.elsewhere]);
    dev.g = sh('findmnt', ['-n', '-o', 'SOURCE', '--mountpoint', p.g]);
    // Left staged on purpose (frozen, bound elsewhere): the teardown takes them down.
    env.declareOwn(p.elsewhere, p.g, dev.g);
    thawAtEnd.push(p.g);
    sh('fsfreeze', ['--freeze', p.g]);
    // H: staged, then force-detached: node-1 fences it (freezes it for good) within seconds.
    await create('h');
    p.h = await stage(d, 'node-1', 'h');
    thawAtEnd.push(p.h);
    dev.h = sh('findmnt', ['-n', '-o', 'SOURCE', '--mountpoint', p.h]);
    env.declareOwn(p.h, dev.h); // fenced: only a "reboot" (the teardown, after a thaw) ends it
    await d.clients.controller.ControllerUnpublishVolume({ volume_id: ids.h, node_id: 'node-1' });
    await waitFor('node-1 to fence volume h', async () =>
      (await fs.readFile(path.join(pool, 'nodes', 'node-1.fenced'), 'utf8').catch(() => '')).includes(
        ids.h ?? '-',
      ),
    );

    while (Date.now() - oldTrashAt < TRASH_AGE * 1000 + 500) await new Promise((r) => setTimeout(r, 100));
    const { code, found } = await findings();
    expect(code).toBe(1);
    const vol = (tag: string, file: string) => path.join(pool, 'volumes', ids[tag] ?? '', file);
    expect(pairs(found)).toEqual(
      [
        `image-without-record ${vol('c', 'disk.img')}`,
        `damaged-record ${vol('d', 'meta.json')}`,
        `record-without-image ${vol('e', 'disk.img')}`,
        `quarantined-record ${p.quarantined ?? ''}`,
        `stale-lease ${vol('b', 'fences.json')}`,
        `stale-attachment ${vol('b', 'fences.json')}`,
        `abandoned-lock ${p.lock ?? ''}`,
        `old-trash ${p.oldTrash}`,
        `leaked-loop-device ${dev.a ?? ''}`,
        `leaked-loop-device ${dev.q ?? ''}`,
        `leaked-loop-device ${dev.f ?? ''}`,
        `leaked-mount ${p.stray ?? ''}`,
        `mount-outside-kubelet ${p.elsewhere}`,
        `frozen-filesystem ${p.g}`,
        `fenced-filesystem ${dev.h}`,
      ].sort(),
    );
    // The fence is a notice, never garbage; the quarantined image's device is left to an operator.
    expect(found.find((f) => f.kind === 'fenced-filesystem')).toMatchObject({ severity: 'notice' });
    expect(found.filter((f) => f.severity === 'notice')).toHaveLength(1);
    expect(found.find((f) => f.subject === dev.q)?.gcSkipped).toMatch(/quarantined/);
    // Tables for people: the same findings, with what to do.
    const human = await loopvol(['check', `--kubelet-dir=${kubelet}`, `--trash-age=${TRASH_AGE}`]);
    expect(human.code).toBe(1);
    expect(human.stdout).toContain(`PROBLEM  leaked-loop-device  ${dev.a ?? ''}`);
    expect(human.stdout).toMatch(/NOTICE +fenced-filesystem/);
    expect(human.stdout).toContain('14 problem(s), 5 of which loopvol gc removes; 1 notice(s)');
  });

  it('lists volumes and snapshots with their PVCs, states, publications and stagings', async () => {
    const all = (await loopvol(['volumes', '--json'])).json as {
      id: string;
      pvc: { namespace: string; name: string } | null;
      state: string;
      publishedTo: string[];
      stagedOn: { node: string; revoked: boolean; fenced: boolean }[];
    }[];
    const byId = new Map(all.map((v) => [v.id, v]));
    expect(byId.get(ids.a ?? '')).toMatchObject({
      pvc: { namespace: 'ops', name: 'data-a' },
      state: 'ready',
    });
    expect(byId.get(ids.c ?? '')?.state).toBe('no-record');
    expect(byId.get(ids.d ?? '')?.state).toBe('unreadable');
    expect(byId.get(ids.e ?? '')?.state).toBe('no-image');
    expect(byId.get(ids.h ?? '')?.stagedOn).toEqual([
      { node: 'node-1', revoked: true, fenced: true, device: path.basename(dev.h ?? '') },
    ]);
    const gone = (await loopvol(['volumes', '--json', '--node=node-gone'])).json as { id: string }[];
    expect(gone.map((v) => v.id)).toEqual([ids.b]);
    const byPvc = (await loopvol(['volumes', '--json', '--pvc=ops/data-g'])).json as { id: string }[];
    expect(byPvc.map((v) => v.id)).toEqual([ids.g]);
    const table = await loopvol(['volumes']);
    expect(table.code).toBe(0);
    expect(table.stdout).toMatch(
      new RegExp(`${ids.b ?? ''} +ops/data-b +pv-b .* block .*node-gone +node-gone`),
    );
    const snaps = (await loopvol(['snapshots', '--json', `--volume=${ids.a ?? ''}`])).json as {
      sourcePvc: unknown;
      state: string;
    }[];
    expect(snaps).toEqual([
      expect.objectContaining({ sourcePvc: { namespace: 'ops', name: 'data-a' }, state: 'ready' }),
    ]);
    const status = await loopvol(['status', '--json']);
    expect(status.code).toBe(0);
    expect(status.json).toMatchObject({ quarantined: 1, trash: 2, snapshots: { total: 1 } });
  });

  it('gc removes exactly the safe ones, after a dry run, and exits 1 while one is in use', async () => {
    const dry = await loopvol(['gc', ...checkArgs()]);
    expect(dry.code).toBe(0);
    const planned = (dry.json as { planned: Found[] }).planned;
    expect(pairs(planned)).toEqual(
      [
        `abandoned-lock ${p.lock ?? ''}`,
        `old-trash ${p.oldTrash ?? ''}`,
        `leaked-loop-device ${dev.a ?? ''}`,
        `leaked-loop-device ${dev.f ?? ''}`,
        `leaked-mount ${p.stray ?? ''}`,
      ].sort(),
    );
    // A dry run changes nothing.
    const was = { a: await backing(dev.a ?? ''), f: await backing(dev.f ?? '') };
    expect(was.a).not.toBe('');
    expect(await isMounted(p.stray ?? '')).toBe(true);

    // Something uses the leaked mount: it and its device stay, the rest goes, and gc exits 1.
    const busy = await fs.open(path.join(p.stray ?? '', 'lost+found'), 'r');
    let first;
    try {
      first = await loopvol(['gc', '--yes', ...checkArgs()]);
    } finally {
      await busy.close();
    }
    expect(first.code).toBe(1);
    const results = (first.json as { outcomes: { subject: string; result: string }[] }).outcomes;
    expect(Object.fromEntries(results.map((o) => [o.subject, o.result]))).toEqual({
      [dev.a ?? '']: 'removed',
      [dev.f ?? '']: 'failed',
      [p.stray ?? '']: 'failed',
      [p.lock ?? '']: 'removed',
      [p.oldTrash ?? '']: 'removed',
    });
    const second = await loopvol(['gc', '--yes', ...checkArgs()]);
    expect(second.code).toBe(0);

    // What went: exactly those. (A detach while something briefly has the device open, such as a
    // concurrent probe, completes at its last close: the kernel's deferred detach. Its number may then
    // serve another file's image, as files run side by side.)
    await waitFor(
      'the detached devices to let go of their images',
      async () => (await backing(dev.a ?? '')) !== was.a && (await backing(dev.f ?? '')) !== was.f,
      5,
    );
    expect(await isMounted(p.stray ?? '')).toBe(false);
    await expect(fs.stat(p.lock ?? '')).rejects.toThrow(/ENOENT/);
    await expect(fs.stat(p.oldTrash ?? '')).rejects.toThrow(/ENOENT/);
    // What stayed: every image and record, quarantine, fences, frozen and fenced filesystems, leases.
    await fs.stat(p.freshTrash ?? '');
    for (const tag of ['a', 'b', 'c', 'f', 'g', 'h']) await fs.stat(image(ids[tag] ?? ''));
    expect(await fs.readFile(path.join(pool, 'volumes', ids.d ?? '', 'meta.json'), 'utf8')).toBe(
      '{"format": 1, "id": ',
    );
    await fs.stat(path.join(p.quarantined ?? '', 'disk.img'));
    expect(await backing(dev.q ?? '')).toContain(p.quarantined ?? '-');
    expect(await isMounted(p.elsewhere ?? '')).toBe(true);
    expect(await isMounted(p.h ?? '')).toBe(true);
    expect(spawnSync('fsfreeze', ['--freeze', p.h ?? '']).stderr.toString()).toMatch(/busy/i); // still frozen
    expect(spawnSync('fsfreeze', ['--freeze', p.g ?? '']).stderr.toString()).toMatch(/busy/i);
    const fences = await fs.readFile(path.join(pool, 'volumes', ids.b ?? '', 'fences.json'), 'utf8');
    expect(fences).toContain('node-gone');

    // check now finds only what needs an operator.
    const after = await findings();
    expect(after.code).toBe(1);
    expect(pairs(after.found)).toEqual(
      [
        `image-without-record ${path.join(pool, 'volumes', ids.c ?? '', 'disk.img')}`,
        `damaged-record ${path.join(pool, 'volumes', ids.d ?? '', 'meta.json')}`,
        `record-without-image ${path.join(pool, 'volumes', ids.e ?? '', 'disk.img')}`,
        `quarantined-record ${p.quarantined ?? ''}`,
        `stale-lease ${path.join(pool, 'volumes', ids.b ?? '', 'fences.json')}`,
        `stale-attachment ${path.join(pool, 'volumes', ids.b ?? '', 'fences.json')}`,
        `leaked-loop-device ${dev.q ?? ''}`,
        `mount-outside-kubelet ${p.elsewhere ?? ''}`,
        `frozen-filesystem ${p.g ?? ''}`,
        `fenced-filesystem ${dev.h ?? ''}`,
      ].sort(),
    );
    // Scoped looks.
    const hostOnly = await findings(['--only=host']);
    expect(
      hostOnly.found.every((f) =>
        ['leaked-loop-device', 'mount-outside-kubelet', 'frozen-filesystem', 'fenced-filesystem'].includes(
          f.kind,
        ),
      ),
    ).toBe(true);
  });

  it('exits 0 on a clean pool, 2 on bad flags, 3 without a pool', async () => {
    const clean = await env.dir('operator-clean');
    const created = await runMain(['create-pool', `--pool-dir=${path.join(clean, 'pool')}`]);
    expect(created.code).toBe(0);
    const ok = await runMain(['check', `--pool-dir=${path.join(clean, 'pool')}`]);
    expect({ code: ok.code, out: ok.stdout }).toEqual({ code: 0, out: 'clean: no problems\n' });
    expect((await runMain(['gc', '--yes', `--pool-dir=${path.join(clean, 'pool')}`])).code).toBe(0);
    const bad = await runMain(['check', '--bogus']);
    expect(bad.code).toBe(2);
    expect(bad.stderr.trim().split('\n')).toHaveLength(1);
    expect((await runMain(['check', '--only=everything'])).code).toBe(2);
    const missing = await runMain(['check', `--pool-dir=${path.join(clean, 'nothing-here')}`]);
    expect(missing.code).toBe(3);
    expect(missing.stderr).toContain('no pool.json');
    for (const c of ['status', 'volumes', 'snapshots', 'check', 'gc']) {
      const help = await runMain([c, '--help']);
      expect(help.code).toBe(0);
      expect(help.stdout).toMatch(/Exit status: 0/);
    }
  });
});
