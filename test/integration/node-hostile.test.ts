/**
 * Node calls a hostile caller or a confused host can make (root only, real loop devices and mounts),
 * from a review that reproduced each against the driver as it was: a trailing slash that took a
 * symlink past the guard, staging paths that were symlinks or lay inside a pod's volume, mounts over
 * files, an unstage at a path the volume is not staged at, a second device of an image whose
 * filesystem is live in a mount namespace the plugin cannot see, re-stages with other mount flags, and
 * stats asked of another volume's path. Every test checks what must have stayed as it was.
 */
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { DriverProcess } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { readSys } from '../../src/host/loop.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { isMounted, isRoot, MiB, ownMountNamespace, SLOW, sha256, writeRandom } from '../helpers/host.js';
import { createVolume, publish, stage } from '../helpers/volumes.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const sh = (cmd: string, args: string[]): string =>
  execFileSync(cmd, args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });

describe.skipIf(!isRoot())('hostile node paths and a confused host', () => {
  let d: DriverProcess;
  let base: string;
  beforeAll(async () => {
    base = await env.dir('hostile');
    d = await env.driver({ dir: base });
  });
  const p = (...parts: string[]): string => path.join(base, ...parts);
  const unstage = (id: string, staging: string) =>
    d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
  const unpublish = (id: string, target: string) =>
    d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });

  it('a trailing slash takes no symlink past publish or unpublish: the other pod and the host directory stay', async () => {
    const cap = mountCap('ext4');
    const { id } = await createVolume(d, 'slash', cap, 32 * MiB);
    await stage(d, id, p('slash-st'), cap);
    await publish(d, id, p('slash-st'), p('pods', 'b', 'mnt'), cap);
    await fs.mkdir(p('pods', 'c'), { recursive: true });
    await fs.symlink(p('pods', 'b', 'mnt'), p('pods', 'c', 'mnt'));
    await fs.mkdir(p('victim'));
    await fs.writeFile(p('victim', 'important'), 'keep');
    await fs.mkdir(p('pods', 'd'), { recursive: true });
    await fs.symlink(p('victim'), p('pods', 'd', 'mnt'));

    const unpub = await codeOf(unpublish(id, `${p('pods', 'c', 'mnt')}/`));
    const pub = await codeOf(
      d.clients.node.NodePublishVolume({
        volume_id: id,
        staging_target_path: p('slash-st'),
        target_path: `${p('pods', 'd', 'mnt')}//`,
        volume_capability: cap,
      }),
    );
    const after = {
      unpub,
      pub,
      podB: await isMounted(p('pods', 'b', 'mnt')),
      victimMounted: await isMounted(p('victim')),
      victim: await fs.readdir(p('victim')),
    };
    await unpublish(id, p('pods', 'b', 'mnt'));
    await unstage(id, p('slash-st'));
    expect(after).toEqual({
      unpub: 'FAILED_PRECONDITION',
      pub: 'INVALID_ARGUMENT',
      podB: true,
      victimMounted: false,
      victim: ['important'],
    });
  });

  it('a staging path that is a symlink, lies inside a pod volume, or holds files is refused, all left as it was', async () => {
    const cap = mountCap('ext4');
    const outer = await createVolume(d, 'outer', cap, 32 * MiB);
    await stage(d, outer.id, p('outer-st'), cap);
    await publish(d, outer.id, p('outer-st'), p('pods', 'x', 'mnt'), cap);
    const { id } = await createVolume(d, 'inner', cap, 32 * MiB);
    await fs.mkdir(p('victim2'));
    await fs.writeFile(p('victim2', 'hostfile'), 'keep');
    await fs.symlink(p('victim2'), p('st-link'));
    await fs.mkdir(p('full-st'));
    await fs.writeFile(p('full-st', 'left'), 'keep');
    const codes = {
      symlink: await codeOf(stage(d, id, p('st-link'), cap)),
      symlinkSlash: await codeOf(stage(d, id, `${p('st-link')}/`, cap)),
      insideVolume: await codeOf(stage(d, id, p('pods', 'x', 'mnt', 'sub'), cap)),
      holdsFiles: await codeOf(stage(d, id, p('full-st'), cap)),
      unstageSymlink: await codeOf(unstage(outer.id, p('st-link'))),
    };
    const after = {
      codes,
      victim2: await fs.readdir(p('victim2')),
      victim2Mounted: await isMounted(p('victim2')),
      full: await fs.readdir(p('full-st')),
      fullMounted: await isMounted(p('full-st')),
      inPodVolume: (await fs.readdir(p('pods', 'x', 'mnt'))).sort(),
      subMounted: await isMounted(p('pods', 'x', 'mnt', 'sub')),
    };
    // A target that holds files is refused the same way.
    await fs.mkdir(p('pods', 'y', 'mnt'), { recursive: true });
    await fs.writeFile(p('pods', 'y', 'mnt', 'left'), 'keep');
    const target = await codeOf(publish(d, outer.id, p('outer-st'), p('pods', 'y', 'mnt'), cap));
    const targetMounted = await isMounted(p('pods', 'y', 'mnt'));
    await unpublish(outer.id, p('pods', 'x', 'mnt'));
    await unstage(outer.id, p('outer-st'));
    expect({ ...after, target, targetMounted }).toEqual({
      codes: {
        symlink: 'INVALID_ARGUMENT',
        symlinkSlash: 'INVALID_ARGUMENT',
        insideVolume: 'INVALID_ARGUMENT',
        holdsFiles: 'FAILED_PRECONDITION',
        unstageSymlink: 'FAILED_PRECONDITION',
      },
      victim2: ['hostfile'],
      victim2Mounted: false,
      full: ['left'],
      fullMounted: false,
      inPodVolume: ['lost+found', 'sub'],
      subMounted: false,
      target: 'FAILED_PRECONDITION',
      targetMounted: false,
    });
  });

  it('an unstage at a path the volume is not staged at answers OK and leaves the staging whole', async () => {
    const block = await createVolume(d, 'blk', blockCap(), 16 * MiB);
    await stage(d, block.id, p('blk-st'), blockCap());
    const devices = () => sh('losetup', ['--associated', block.image, '--noheadings', '--output', 'NAME']);
    const before = devices();
    const wrongBlock = await codeOf(unstage(block.id, p('elsewhere')));
    const stillAttached = devices();
    const published = await codeOf(publish(d, block.id, p('blk-st'), p('pods', 'blk', 'dev'), blockCap()));
    await unpublish(block.id, p('pods', 'blk', 'dev'));
    await unstage(block.id, p('blk-st'));

    // A filesystem: an unstage "at" a pod's target is not at the staging; the pod keeps its mount.
    const cap = mountCap('ext4');
    const fsVol = await createVolume(d, 'fsvol', cap, 32 * MiB);
    await stage(d, fsVol.id, p('fs-st'), cap);
    await publish(d, fsVol.id, p('fs-st'), p('pods', 'f', 'mnt'), cap);
    const atTarget = await codeOf(unstage(fsVol.id, p('pods', 'f', 'mnt')));
    const podKeeps = await isMounted(p('pods', 'f', 'mnt'));
    await unpublish(fsVol.id, p('pods', 'f', 'mnt'));
    await unstage(fsVol.id, p('fs-st'));
    expect({
      wrongBlock,
      kept: stillAttached === before && before !== '',
      published,
      atTarget,
      podKeeps,
    }).toEqual({
      wrongBlock: 'OK',
      kept: true,
      published: 'OK',
      atTarget: 'OK',
      podKeeps: true,
    });
  });

  it('mounts the device whose filesystem is live in a hidden mount namespace, never a second one on the same image', async () => {
    const cap = mountCap('ext4');
    const { id, image } = await createVolume(d, 'hidden', cap, 64 * MiB);
    await stage(d, id, p('hid-st'), cap);
    await unstage(id, p('hid-st'));
    const first = sh('losetup', ['--find', '--show', image]).trim();
    const second = sh('losetup', ['--find', '--show', image]).trim();
    const nsMount = p('ns-mnt');
    await fs.mkdir(nsMount);
    // A writer in a private mount namespace, on the second device: the host shows no mount of it.
    const [unshare = 'unshare', ...inNamespace] = ownMountNamespace(base);
    const writer = spawn(
      unshare,
      [
        ...inNamespace,
        'sh',
        '-c',
        'mount "$1" "$2" && echo precious > "$2/precious" && sync && echo ready && ' +
          'while :; do date >> "$2/log"; sleep 0.1; done',
        'sh',
        second,
        nsMount,
      ],
      { stdio: ['ignore', 'pipe', 'inherit'] },
    );
    const exited = new Promise((resolve) => writer.once('exit', resolve));
    let result: unknown;
    try {
      await new Promise<void>((resolve, reject) => {
        writer.stdout.once('data', () => {
          resolve();
        });
        writer.once('exit', () => {
          reject(new Error('the namespace writer did not start'));
        });
      });
      const code = await codeOf(stage(d, id, p('hid-st'), cap));
      const source = sh('findmnt', [
        '--noheadings',
        '--output',
        'SOURCE',
        '--mountpoint',
        p('hid-st'),
      ]).trim();
      // One filesystem: what the hidden writer wrote is here, and what is written here is there.
      const precious = await fs.readFile(p('hid-st', 'precious'), 'utf8').catch(() => 'missing');
      result = { code, source, precious };
    } finally {
      writer.kill('SIGKILL');
      await exited;
      await unstage(id, p('hid-st')).catch(() => undefined);
      // The unstage may have detached them, and another file running beside this one attached its own
      // image at the number since: only a device still on this image is detached.
      for (const dev of [first, second]) {
        if (readSys(`/sys/block/${path.basename(dev)}/loop/backing_file`) !== image) continue;
        try {
          sh('losetup', ['--detach', dev]);
        } catch {
          // detached meanwhile
        }
      }
    }
    expect(result).toEqual({ code: 'OK', source: second, precious: 'precious\n' });
  });

  it("never stages a raw block volume on a device its old pod's process holds open: it goes when closed, and its number to another volume", async () => {
    // An unstage asked while a process holds the device only marks it for detaching (autoclear); a
    // raw block staging does not hold it, so a stage on it would lose it from under the new pod, and a
    // later attach would hand its number, and so the new pod's writes, to another volume's image.
    const cap = blockCap();
    const a = await createVolume(d, 'held-a', cap, 16 * MiB);
    const b = await createVolume(d, 'held-b', cap, 16 * MiB);
    await stage(d, a.id, p('held-a-st'), cap);
    await publish(d, a.id, p('held-a-st'), p('pods', 'held-1', 'dev'), cap);
    const device = sh('losetup', ['--noheadings', '--output', 'NAME', '--associated', a.image]).trim();
    const holder = spawn('sh', ['-c', `exec 3<>${device}; echo open; exec sleep 300`], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    const gone = new Promise((resolve) => holder.once('exit', resolve));
    let codes: Record<string, string>;
    try {
      await new Promise((resolve) => holder.stdout.once('data', resolve));
      await unpublish(a.id, p('pods', 'held-1', 'dev'));
      codes = {
        unstage: await codeOf(unstage(a.id, p('held-a-st'))),
        restage: await codeOf(stage(d, a.id, p('held-a-st'), cap)),
        publish: await codeOf(publish(d, a.id, p('held-a-st'), p('pods', 'held-0', 'dev'), cap)),
      };
      // A device of the image nobody staged (no lease names it), also being detached under its holder.
      const spare = sh('losetup', ['--find', '--show', b.image]).trim();
      const spareHolder = spawn('sh', ['-c', `exec 3<>${spare}; echo open; exec sleep 300`], {
        stdio: ['ignore', 'pipe', 'inherit'],
      });
      const spareGone = new Promise((resolve) => spareHolder.once('exit', resolve));
      try {
        await new Promise((resolve) => spareHolder.stdout.once('data', resolve));
        sh('losetup', ['--detach', spare]);
        codes.spare = await codeOf(stage(d, b.id, p('held-b-st'), cap));
      } finally {
        spareHolder.kill('SIGKILL');
        await spareGone;
      }
    } finally {
      holder.kill('SIGKILL');
      await gone;
    }
    const attached = () =>
      sh('losetup', ['--associated', a.image]) + sh('losetup', ['--associated', b.image]);
    for (let i = 0; i < 100 && attached().trim() !== ''; i++) await new Promise((r) => setTimeout(r, 20));
    // Once the old holder is gone, each volume is staged on a device of its own image.
    const heads: Record<string, string> = {};
    for (const [n, v] of [
      ['a', a],
      ['b', b],
    ] as const) {
      codes[`stage-${n}`] = await codeOf(stage(d, v.id, p(`held-${n}-st`), cap));
      await publish(d, v.id, p(`held-${n}-st`), p('pods', `held-${n}2`, 'dev'), cap);
      const dev = await fs.open(p('pods', `held-${n}2`, 'dev'), 'r+');
      await dev.write(Buffer.from(`volume ${n}`), 0, 8, 0);
      await dev.sync();
      await dev.close();
    }
    for (const [n, v] of [
      ['a', a],
      ['b', b],
    ] as const) {
      await unpublish(v.id, p('pods', `held-${n}2`, 'dev'));
      await unstage(v.id, p(`held-${n}-st`));
      const h = await fs.open(v.image, 'r');
      const buf = Buffer.alloc(8);
      await h.read(buf, 0, 8, 0);
      await h.close();
      heads[n] = buf.toString();
    }
    expect({ codes, heads }).toEqual({
      codes: {
        unstage: 'FAILED_PRECONDITION',
        restage: 'FAILED_PRECONDITION',
        publish: 'FAILED_PRECONDITION',
        spare: 'FAILED_PRECONDITION',
        'stage-a': 'OK',
        'stage-b': 'OK',
      },
      heads: { a: 'volume a', b: 'volume b' },
    });
  });

  it('keeps a filesystem whose mount another mount namespace copied on this node until that namespace ends, then lets it go whole', async () => {
    // A process started with private mounts while the volume was staged (a service with PrivateMounts,
    // a container whose mounts do not propagate) holds a copy of the staging mount: the host's unmount
    // does not reach it, so the filesystem, still writable there, keeps its device.
    const cap = mountCap('ext4');
    const { id, image } = await createVolume(d, 'leaked-ns', cap, 64 * MiB);
    const staging = p('leaked-st');
    const target = p('pods', 'leaked', 'mount');
    await stage(d, id, staging, cap);
    await publish(d, id, staging, target, cap);
    const sum = await writeRandom(path.join(target, 'data.bin'), 4, 31);
    // Its copies of every other test file's mounts are dropped; the copy of this volume's stays.
    const [unshare = 'unshare', ...inNamespace] = ownMountNamespace(staging);
    const holder = spawn(unshare, [...inNamespace, 'sh', '-c', 'echo ready; exec sleep 300'], {
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    const gone = new Promise((resolve) => holder.once('exit', resolve));
    const codes: Record<string, string> = {};
    let message = '';
    let devices = 0;
    try {
      await new Promise((resolve) => holder.stdout.once('data', resolve));
      codes.unpublish = await codeOf(unpublish(id, target));
      const e = await errorOf(unstage(id, staging));
      codes.unstage = e.code;
      message = e.details;
      // What the message tells the operator to run finds the namespace that holds it.
      const pattern = /grep -lE '([^']+)'/.exec(message)?.[1] ?? 'no pattern in the message';
      expect(sh('grep', ['-lE', pattern, `/proc/${holder.pid}/mountinfo`]).trim()).toBe(
        `/proc/${holder.pid}/mountinfo`,
      );
      // Staged again meanwhile, it is the live filesystem that copy keeps (the kernel hands back its
      // superblock), never a second one on the same disk; unstaged, it stays held as before.
      codes.restage = await codeOf(stage(d, id, staging, cap));
      devices = sh('losetup', ['--associated', image]).trim().split('\n').length;
      codes.delete = await codeOf(d.clients.controller.DeleteVolume({ volume_id: id }));
      codes.again = await codeOf(unstage(id, staging));
    } finally {
      holder.kill('SIGKILL');
      await gone;
    }
    // The namespace ended: the kernel lets the device go, and the retry finishes the unstage.
    const attached = () => sh('losetup', ['--associated', image]).trim();
    for (let i = 0; i < 500 * SLOW && attached() !== ''; i++) await new Promise((r) => setTimeout(r, 20));
    codes.last = await codeOf(unstage(id, staging));
    expect(codes).toEqual({
      unpublish: 'OK',
      unstage: 'FAILED_PRECONDITION',
      restage: 'OK',
      delete: 'FAILED_PRECONDITION',
      again: 'FAILED_PRECONDITION',
      last: 'OK',
    });
    expect(message).toMatch(/still open.*another mount namespace/);
    expect(devices).toBe(1); // the restage mounted the device marked to go, with no second one beside it
    expect(attached()).toBe('');
    expect(await isMounted(staging)).toBe(false);
    // Its data is whole: staged again, the file reads back as written.
    await stage(d, id, staging, cap);
    await publish(d, id, staging, target, cap);
    expect(await sha256(path.join(target, 'data.bin'))).toBe(sum);
    await unpublish(id, target);
    expect(await codeOf(unstage(id, staging))).toBe('OK');
  });

  it('two volumes staged at one path, or published at a target and inside it, at once: one is refused, nothing stacked or hidden', async () => {
    // Each call checks the place, then mounts there: two at once both found it free and both mounted,
    // one volume hidden under the other (or inside its filesystem), and every later call stuck.
    const cap = mountCap('ext4');
    const one = async (point: string) => {
      const dir = await env.dir(`race-${point.replace(':', '-')}`);
      const n = await env.driver({ dir, env: { LOOPVOL_PAUSEPOINT: `${point}:400` } });
      const a = await createVolume(n, 'race-a', cap, 32 * MiB);
      const b = await createVolume(n, 'race-b', cap, 32 * MiB);
      return { n, a: a.id, b: b.id, at: (...parts: string[]) => path.join(dir, ...parts) };
    };
    const mountsAt = (where: string): number =>
      sh('findmnt', ['--noheadings', '--output', 'TARGET', '--mountpoint', where])
        .split('\n')
        .filter((l) => l.trim() !== '').length;
    const mountsAtOrNone = (where: string): number => {
      try {
        return mountsAt(where);
      } catch {
        return 0; // findmnt exits 1 when nothing is mounted there
      }
    };

    const st = await one('stage:attached');
    const shared = st.at('st-shared');
    const staged = await Promise.all([st.a, st.b].map((id) => codeOf(stage(st.n, id, shared, cap))));
    const stagedMounts = mountsAtOrNone(shared);
    const winner = staged[0] === 'OK' ? st.a : st.b;
    const unstaged = await codeOf(
      st.n.clients.node.NodeUnstageVolume({ volume_id: winner, staging_target_path: shared }),
    );

    const pb = await one('publish:prepared');
    await stage(pb.n, pb.a, pb.at('st-a'), cap);
    await stage(pb.n, pb.b, pb.at('st-b'), cap);
    const outer = pb.at('pods', 'p', 'vol');
    const published = await Promise.all([
      codeOf(publish(pb.n, pb.a, pb.at('st-a'), outer, cap)),
      codeOf(publish(pb.n, pb.b, pb.at('st-b'), path.join(outer, 'sub'), cap)),
    ]);
    const insideA = (await fs.readdir(pb.at('st-a'))).sort();
    const outerDown = await codeOf(
      published[0] === 'OK' ? unpublish(pb.a, outer) : unpublish(pb.b, path.join(outer, 'sub')),
    );
    const same = pb.at('pods', 'q', 'vol');
    const published2 = await Promise.all([
      codeOf(publish(pb.n, pb.a, pb.at('st-a'), same, cap)),
      codeOf(publish(pb.n, pb.b, pb.at('st-b'), same, cap)),
    ]);
    const stacked = mountsAtOrNone(same);
    const down = await codeOf(unpublish(published2[0] === 'OK' ? pb.a : pb.b, same));
    for (const id of [pb.a, pb.b])
      await pb.n.clients.node.NodeUnstageVolume({
        volume_id: id,
        staging_target_path: pb.at(id === pb.a ? 'st-a' : 'st-b'),
      });
    expect({
      staged: [...staged].sort(),
      stagedMounts,
      unstaged,
      published: [...published].sort(),
      insideA,
      outerDown,
      published2: [...published2].sort(),
      stacked,
      down,
      left: mountsAtOrNone(same),
    }).toEqual({
      staged: ['ABORTED', 'OK'],
      stagedMounts: 1,
      unstaged: 'OK',
      published: ['ABORTED', 'OK'],
      insideA: ['lost+found'],
      outerDown: 'OK',
      published2: ['ABORTED', 'OK'],
      stacked: 1,
      down: 'OK',
      left: 0,
    });
  });

  it('answers FAILED_PRECONDITION, not INTERNAL, to an unpublish while a process works in the target, OK once it left', async () => {
    const cap = mountCap('ext4');
    const { id } = await createVolume(d, 'busy-target', cap, 32 * MiB);
    const target = p('pods', 'busy', 'mnt');
    await stage(d, id, p('busy-st'), cap);
    await publish(d, id, p('busy-st'), target, cap);
    const inside = spawn('sh', ['-c', 'echo in; exec sleep 300'], {
      cwd: target,
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    const gone = new Promise((resolve) => inside.once('exit', resolve));
    let busy: string;
    try {
      await new Promise((resolve) => inside.stdout.once('data', resolve));
      busy = await codeOf(unpublish(id, target));
    } finally {
      inside.kill('SIGKILL');
      await gone;
    }
    const after = await codeOf(unpublish(id, target));
    await unstage(id, p('busy-st'));
    expect({ busy, after, mounted: await isMounted(target) }).toEqual({
      busy: 'FAILED_PRECONDITION',
      after: 'OK',
      mounted: false,
    });
  });

  it("refuses to stage a raw block volume at another volume's mounted staging path (its unstage would be refused for good)", async () => {
    const fsCap = mountCap('ext4');
    const b = await createVolume(d, 'owner-fs', fsCap, 32 * MiB);
    const c = await createVolume(d, 'intruder-raw', blockCap(), 16 * MiB);
    await stage(d, b.id, p('owner-st'), fsCap);
    const code = await codeOf(stage(d, c.id, p('owner-st'), blockCap()));
    const attachedC = sh('losetup', ['--noheadings', '--output', 'NAME', '--associated', c.image]).trim();
    const unstagedB = await codeOf(unstage(b.id, p('owner-st')));
    expect({ code, attachedC, unstagedB }).toEqual({
      code: 'FAILED_PRECONDITION',
      attachedC: '',
      unstagedB: 'OK',
    });
  });

  it('refuses a staging or target path that is not a directory (a file, below a file, a pipe) before anything is attached or formatted', async () => {
    const fsCap = mountCap('ext4');
    const { id, image } = await createVolume(d, 'not-a-dir', fsCap, 32 * MiB);
    await fs.writeFile(p('a-file'), 'keep');
    sh('mkfifo', [p('a-pipe')]);
    const attached = () => sh('losetup', ['--noheadings', '--output', 'NAME', '--associated', image]).trim();
    // Straight to the driver: the helper would make the staging directory first, as a CO does.
    const stageAt = (staging: string) =>
      codeOf(
        d.clients.node.NodeStageVolume({
          volume_id: id,
          staging_target_path: staging,
          volume_capability: fsCap,
        }),
      );
    const stages = {
      file: await stageAt(p('a-file')),
      belowFile: await stageAt(p('a-file', 'st')),
      pipe: await stageAt(p('a-pipe')),
    };
    // Nothing was attached, and the blank image was never formatted (blkid finds nothing: status 2).
    const after = { attached: attached(), blkid: spawnSync('blkid', ['-p', image]).status };
    await stage(d, id, p('nd-st'), fsCap);
    const publishAt = (vid: string, staging: string, target: string, c: typeof fsCap) =>
      codeOf(
        d.clients.node.NodePublishVolume({
          volume_id: vid,
          staging_target_path: staging,
          target_path: target,
          volume_capability: c,
        }),
      );
    const publishes = {
      file: await publishAt(id, p('nd-st'), p('a-file'), fsCap),
      belowFile: await publishAt(id, p('nd-st'), p('a-file', 'mnt'), fsCap),
    };
    const raw = await createVolume(d, 'not-a-dir-raw', blockCap(), 16 * MiB);
    await stage(d, raw.id, p('nd-raw-st'), blockCap());
    const blockBelowFile = await publishAt(raw.id, p('nd-raw-st'), p('a-file', 'dev'), blockCap());
    await unstage(raw.id, p('nd-raw-st'));
    await unstage(id, p('nd-st'));
    expect({
      stages,
      after,
      publishes,
      blockBelowFile,
      file: await fs.readFile(p('a-file'), 'utf8'),
    }).toEqual({
      stages: { file: 'FAILED_PRECONDITION', belowFile: 'FAILED_PRECONDITION', pipe: 'FAILED_PRECONDITION' },
      after: { attached: '', blkid: 2 },
      publishes: { file: 'FAILED_PRECONDITION', belowFile: 'FAILED_PRECONDITION' },
      blockBelowFile: 'FAILED_PRECONDITION',
      file: 'keep',
    });
  });

  it('answers ALREADY_EXISTS to a re-stage with other mount flags, OK to the same in another order', async () => {
    const cap = mountCap('ext4', 'SINGLE_NODE_WRITER', ['noexec', 'nosuid']);
    const { id } = await createVolume(d, 'flags', cap, 32 * MiB);
    await stage(d, id, p('flags-st'), cap);
    const codes = {
      same: await codeOf(
        stage(d, id, p('flags-st'), mountCap('ext4', 'SINGLE_NODE_WRITER', ['nosuid', 'noexec'])),
      ),
      fewer: await codeOf(stage(d, id, p('flags-st'), mountCap('ext4'))),
      more: await codeOf(
        stage(d, id, p('flags-st'), mountCap('ext4', 'SINGLE_NODE_WRITER', ['noexec', 'nosuid', 'nodev'])),
      ),
    };
    await unstage(id, p('flags-st'));
    expect(codes).toEqual({ same: 'OK', fewer: 'ALREADY_EXISTS', more: 'ALREADY_EXISTS' });
  });

  it("answers NOT_FOUND to stats of another volume's path", async () => {
    const cap = mountCap('ext4');
    const a = await createVolume(d, 'stats-a', cap, 32 * MiB);
    const b = await createVolume(d, 'stats-b', cap, 32 * MiB);
    await stage(d, a.id, p('stats-a'), cap);
    const code = await codeOf(
      d.clients.node.NodeGetVolumeStats({ volume_id: b.id, volume_path: p('stats-a') }),
    );
    await unstage(a.id, p('stats-a'));
    expect(code).toBe('NOT_FOUND');
  });
});
