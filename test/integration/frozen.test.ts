/**
 * How check tells a frozen filesystem (root only, real filesystems on loop devices): ext4 from its
 * superblock, changing nothing; xfs only by trying to freeze it (--probe-frozen), which must leave a
 * filesystem that was not frozen thawed, and one that was frozen frozen.
 */
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { ext4Frozen, probeFrozen } from '../../src/audit/frozen.js';
import { bindExec, ExecRunner } from '../../src/exec/runner.js';
import { MAIN } from '../helpers/driver.js';
import { mountCap, TestEnv } from '../helpers/env.js';
import { isRoot, MiB, type ScratchFs, scratchFilesystem, SLOW } from '../helpers/host.js';
import { createVolume, stage } from '../helpers/volumes.js';

const env = new TestEnv();
const scratches: ScratchFs[] = [];
afterAll(async () => {
  for (const s of scratches) {
    spawnSync('fsfreeze', ['--unfreeze', s.mountPoint], { stdio: 'ignore' });
    await s.remove();
  }
  expect(await env.teardown()).toEqual([]);
});

const x = bindExec(new ExecRunner(), { log: pino({ level: 'silent' }), deadline: Number.POSITIVE_INFINITY });
const isFrozen = (mp: string): boolean => {
  const r = spawnSync('fsfreeze', ['--freeze', mp], { encoding: 'utf8' });
  if (r.status === 0) {
    execFileSync('fsfreeze', ['--unfreeze', mp]);
    return false;
  }
  return /busy/i.test(r.stderr);
};

describe.skipIf(!isRoot())('frozen filesystems', () => {
  it('ext4: read from the superblock, without touching the filesystem', async () => {
    const s = await scratchFilesystem(await env.dir('frozen-ext4'), 'ext4', 64);
    scratches.push(s);
    await fs.writeFile(path.join(s.mountPoint, 'f'), 'data');
    expect(await ext4Frozen(s.device)).toBe('not-frozen');
    execFileSync('fsfreeze', ['--freeze', s.mountPoint]);
    expect(await ext4Frozen(s.device)).toBe('frozen');
    expect(await ext4Frozen(s.device)).toBe('frozen'); // looking twice changes nothing
    execFileSync('fsfreeze', ['--unfreeze', s.mountPoint]);
    expect(await ext4Frozen(s.device)).toBe('not-frozen');
  });

  it('xfs: by trying, and a filesystem that was not frozen is thawed again at once', async () => {
    const s = await scratchFilesystem(await env.dir('frozen-xfs'), 'xfs', 320);
    scratches.push(s);
    expect(await probeFrozen(x, s.mountPoint)).toBe('not-frozen');
    expect(isFrozen(s.mountPoint)).toBe(false);
    await fs.writeFile(path.join(s.mountPoint, 'f'), 'writes go through');
    execFileSync('fsfreeze', ['--freeze', s.mountPoint]);
    expect(await probeFrozen(x, s.mountPoint)).toBe('frozen');
    expect(isFrozen(s.mountPoint)).toBe(true); // still frozen: the probe thawed nothing
    execFileSync('fsfreeze', ['--unfreeze', s.mountPoint]);
  });

  // A Ctrl-C while fsfreeze --freeze holds (its freeze took effect in the kernel, the command has not
  // returned yet), or while the thaw after it runs: the Ctrl-C kills that fsfreeze too. A thaw that
  // hangs is left by a third Ctrl-C, which says what may be left frozen.
  it.each([
    [
      'its freeze holds',
      'if [ "$1" = --freeze ]; then "$real" "$@" || exit $?; : > "$FROZE_MARK"; exec sleep 60; fi\n',
      1,
    ],
    [
      'its thaw runs',
      'if [ "$1" = --unfreeze ] && [ ! -e "$FROZE_MARK" ]; then : > "$FROZE_MARK"; exec sleep 60; fi\n',
      1,
    ],
    ['its thaw hangs', 'if [ "$1" = --unfreeze ]; then : > "$FROZE_MARK"; exec sleep 60; fi\n', 3],
  ])('check --probe-frozen, interrupted while %s', async (_, holds, signals) => {
    const base = await env.dir('frozen-cli');
    const d = await env.driver({ dir: base });
    const cap = mountCap('xfs');
    const { id } = await createVolume(d, `pvc-probe-interrupted-${path.basename(base)}`, cap, 320 * MiB);
    const staging = path.join(base, 'kubelet', 'staging', id);
    await stage(d, id, staging, cap);
    const bin = path.join(base, 'bin');
    const mark = path.join(base, 'froze');
    await fs.mkdir(bin);
    await fs.writeFile(
      path.join(bin, 'fsfreeze'),
      `#!/bin/sh\nreal=$(PATH=/usr/sbin:/sbin:/usr/bin:/bin command -v fsfreeze)\n${holds}exec "$real" "$@"\n`,
      { mode: 0o755 },
    );
    try {
      // Its own process group, as a command in a terminal: the Ctrl-C reaches fsfreeze too.
      const cli = spawn(
        process.execPath,
        [
          MAIN,
          'check',
          `--pool-dir=${d.poolDir}`,
          `--kubelet-dir=${path.join(base, 'kubelet')}`,
          '--probe-frozen',
        ],
        {
          detached: true,
          stdio: ['ignore', 'pipe', 'pipe'],
          env: { ...process.env, PATH: `${bin}:${process.env.PATH ?? ''}`, FROZE_MARK: mark },
        },
      );
      let stderr = '';
      cli.stderr.on('data', (b: Buffer) => (stderr += b.toString()));
      cli.stdout.resume();
      const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
        cli.on('exit', (code, signal) => {
          resolve({ code, signal });
        }),
      );
      const until = Date.now() + 20_000 * SLOW;
      while (
        Date.now() < until &&
        !(await fs.stat(mark).then(
          () => true,
          () => false,
        ))
      )
        await new Promise((r) => setTimeout(r, 50));
      expect(isFrozen(staging)).toBe(true); // the probe's freeze holds now
      for (let i = 0; i < signals; i++) {
        process.kill(-(cli.pid ?? 0), 'SIGINT');
        await new Promise((r) => setTimeout(r, 300));
      }
      expect(await exited).toEqual({ code: signals === 1 ? 130 : 4, signal: null });
      if (signals === 1) {
        expect(stderr).toMatch(/interrupted; every filesystem it froze to probe was thawed/);
        expect(isFrozen(staging)).toBe(false);
      } else {
        expect(stderr).toMatch(/exiting at once: a filesystem it was probing may be left frozen/);
        expect(isFrozen(staging)).toBe(true); // what it said: left frozen (thawed below)
      }
    } finally {
      spawnSync('fsfreeze', ['--unfreeze', staging], { stdio: 'ignore' });
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    }
  });
});
