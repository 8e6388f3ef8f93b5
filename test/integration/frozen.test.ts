/**
 * How check tells a frozen filesystem (root only, real filesystems on loop devices): ext4 from its
 * superblock, changing nothing; xfs only by trying to freeze it (--probe-frozen), which must leave a
 * filesystem that was not frozen thawed, and one that was frozen frozen.
 */
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { ext4Frozen, probeFrozen } from '../../src/audit/frozen.js';
import { bindExec, ExecRunner } from '../../src/exec/runner.js';
import { TestEnv } from '../helpers/env.js';
import { isRoot, type ScratchFs, scratchFilesystem } from '../helpers/host.js';

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
});
