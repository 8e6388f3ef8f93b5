/** mkfs options chosen for the node's kernel: a table of kernels and of what the installed mkfs knows. */
import { pino } from 'pino';
import { describe, expect, it, vi } from 'vitest';
import { bindExec, type Runner } from '../../src/exec/runner.js';
import { compatArgs, kernelVersion, type MkfsKnows } from '../../src/host/mkfs-compat.js';

/** xfsprogs 6.1 (Debian 12) knows nrext64; 6.13 (Debian 13) also exchange, parent and metadir. */
const XFS_6_1: MkfsKnows = {
  features: new Set(['crc', 'finobt', 'rmapbt', 'reflink', 'inobtcount', 'bigtime', 'nrext64', 'sparse']),
};
const XFS_6_13: MkfsKnows = { features: new Set([...XFS_6_1.features, 'exchange', 'parent', 'metadir']) };
const XFS_5_10: MkfsKnows = {
  features: new Set(['crc', 'finobt', 'rmapbt', 'reflink', 'inobtcount', 'bigtime']),
};
const E2FS_1_47: MkfsKnows = { features: new Set(['metadata_csum', 'metadata_csum_seed', 'orphan_file']) };
const E2FS_1_46: MkfsKnows = { features: new Set(['metadata_csum', 'metadata_csum_seed']) };
const BTRFS_6_2: MkfsKnows = {
  features: new Set(['mixed-bg', 'extref', 'raid56', 'skinny-metadata', 'no-holes', 'raid1c34', 'zoned']),
  runtimeFeatures: new Set(['quota', 'free-space-tree']),
};

describe('kernelVersion', () => {
  it.each([
    ['6.18.44-fc-v669', [6, 18, 44]],
    ['4.18.0-553.el8_10.x86_64', [4, 18, 0]],
    ['5.10.226-214.880.amzn2.x86_64', [5, 10, 226]],
    ['5.4.0-200-generic', [5, 4, 0]],
    ['6.1', [6, 1, 0]],
  ])('%s → %j', (release, version) => {
    expect(kernelVersion(release)).toEqual(version);
  });
});

describe('compatArgs', () => {
  it.each([
    // RHEL 8 (4.18), Ubuntu 20.04 (5.4): no nrext64, bigtime or inobtcount.
    [
      'xfs',
      [4, 18, 0],
      XFS_6_13,
      ['-i', 'nrext64=0,exchange=0', '-m', 'bigtime=0,inobtcount=0,metadir=0', '-n', 'parent=0'],
    ],
    ['xfs', [5, 4, 0], XFS_6_1, ['-i', 'nrext64=0', '-m', 'bigtime=0,inobtcount=0']],
    // Amazon Linux 2 with 5.10, Ubuntu 22.04 (5.15): no nrext64.
    ['xfs', [5, 10, 0], XFS_6_1, ['-i', 'nrext64=0']],
    ['xfs', [5, 15, 0], XFS_6_13, ['-i', 'nrext64=0,exchange=0', '-n', 'parent=0', '-m', 'metadir=0']],
    // Debian 12 (6.1) with Debian 13's xfsprogs: the newest features only.
    ['xfs', [6, 1, 0], XFS_6_13, ['-i', 'exchange=0', '-n', 'parent=0', '-m', 'metadir=0']],
    ['xfs', [6, 13, 0], XFS_6_13, []],
    // An option the installed mkfs does not know is never passed (it would fail).
    ['xfs', [4, 18, 0], XFS_5_10, ['-m', 'bigtime=0,inobtcount=0']],
    ['xfs', [4, 4, 0], XFS_6_1, ['-i', 'nrext64=0', '-m', 'bigtime=0,inobtcount=0,reflink=0,rmapbt=0']],
    ['ext4', [4, 18, 0], E2FS_1_47, ['-O', '^orphan_file']],
    ['ext4', [5, 15, 0], E2FS_1_47, []],
    ['ext4', [5, 4, 0], E2FS_1_46, []],
    ['ext4', [3, 10, 0], E2FS_1_47, ['-O', '^orphan_file,^metadata_csum_seed,^metadata_csum']],
    ['btrfs', [5, 4, 0], BTRFS_6_2, []],
    ['btrfs', [4, 4, 0], BTRFS_6_2, ['-R', '^free-space-tree']],
    ['btrfs', [3, 10, 0], BTRFS_6_2, ['-R', '^free-space-tree', '-O', '^no-holes']],
  ] as const)('%s on Linux %j', (fsType, kernel, knows, args) => {
    expect(compatArgs(fsType, kernel, knows).args).toEqual(args);
  });

  it('says what it turned off and why', () => {
    expect(compatArgs('xfs', [5, 4, 0], XFS_6_1).off).toEqual([
      'nrext64 (needs Linux 5.19)',
      'bigtime (needs Linux 5.10)',
      'inobtcount (needs Linux 5.10)',
    ]);
  });
});

describe('asking the installed mkfs', () => {
  type Compat = typeof import('../../src/host/mkfs-compat.js') & typeof import('../../src/exec/runner.js');
  /** The modules afresh (what the module learned of the tool is kept per process), errors and all. */
  const fresh = async (): Promise<Compat> => {
    vi.resetModules();
    return {
      ...(await import('../../src/host/mkfs-compat.js')),
      ...(await import('../../src/exec/runner.js')),
    };
  };
  /** mkfs.xfs's usage (no arguments), as far as it is read: every option it knows as "name=0|1". */
  const USAGE = '-i sparse=0|1,nrext64=0|1\n-m bigtime=0|1,inobtcount=0|1,reflink=0|1,rmapbt=0|1';
  const OLD_KERNEL = [5, 4, 0] as const; // no nrext64, bigtime, inobtcount
  const OFF = ['-i', 'nrext64=0', '-m', 'bigtime=0,inobtcount=0'];
  const log = pino({ level: 'silent' });
  const answering = (asked: string[]): Runner => ({
    run: (_scope, command) => {
      asked.push(command);
      return Promise.resolve({ exitCode: 1, stdout: '', stderr: USAGE });
    },
  });

  it("asks free of the caller's deadline: a caller too late to run a command still gets the tool's answer", async () => {
    const a = await fresh();
    const expected = (await a.mkfsCompat(a.bindExec(new a.ExecRunner(), { log }), 'xfs', OLD_KERNEL)).args;
    expect(expected.length).toBeGreaterThan(0); // this mkfs.xfs knows features a 5.4 kernel cannot mount
    const b = await fresh();
    // Inside the real runner's margin: the caller itself may start no command.
    const late = b.bindExec(new b.ExecRunner(), { log, deadline: Date.now() + 450 });
    await expect(late.run('true', [])).rejects.toBeInstanceOf(b.CallStopped);
    expect((await b.mkfsCompat(late, 'xfs', OLD_KERNEL)).args).toEqual(expected);
  });

  it('asks once, for every caller to come', async () => {
    const { mkfsCompat } = await fresh();
    const asked: string[] = [];
    const x = () => bindExec(answering(asked), { log });
    expect((await mkfsCompat(x(), 'xfs', OLD_KERNEL)).args).toEqual(OFF);
    expect((await mkfsCompat(x(), 'xfs', OLD_KERNEL)).args).toEqual(OFF);
    expect(asked).toEqual(['mkfs.xfs']);
  });

  it.each([
    ['timed out', 'timeout'],
    ['was killed (a signal, as from the OOM killer)', 'spawn'],
  ] as const)(
    'keeps no answer from a question that %s: the next caller asks again',
    async (_what, reason) => {
      const { mkfsCompat, CommandError } = await fresh();
      const asked: string[] = [];
      const failing: Runner = {
        run: (_scope, command, args) => {
          asked.push(command);
          const why = reason === 'spawn' ? 'SIGKILL' : undefined;
          return Promise.reject(
            new CommandError(command, args, undefined, '', reason, `${command} failed`, why),
          );
        },
      };
      const x = (runner: Runner) => bindExec(runner, { log, deadline: Infinity });
      await expect(mkfsCompat(x(failing), 'xfs', OLD_KERNEL)).rejects.toBeInstanceOf(CommandError);
      expect((await mkfsCompat(x(answering(asked)), 'xfs', OLD_KERNEL)).args).toEqual(OFF);
      expect(asked).toEqual(['mkfs.xfs', 'mkfs.xfs']);
    },
  );

  it('reads what the tool printed whatever its exit status', async () => {
    const { mkfsCompat, CommandError } = await fresh();
    const usageExit2: Runner = {
      run: (_scope, command, args) =>
        Promise.reject(new CommandError(command, args, 2, USAGE, 'exit', `${command} exited with status 2`)),
    };
    expect((await mkfsCompat(bindExec(usageExit2, { log }), 'xfs', OLD_KERNEL)).args).toEqual(OFF);
  });

  it('takes a tool that is not installed to know nothing extra', async () => {
    const { mkfsCompat, CommandError } = await fresh();
    const missing: Runner = {
      run: (_scope, command, args) =>
        Promise.reject(
          new CommandError(
            command,
            args,
            undefined,
            '',
            'spawn',
            `${command} could not be started`,
            'ENOENT',
          ),
        ),
    };
    expect((await mkfsCompat(bindExec(missing, { log }), 'xfs', OLD_KERNEL)).args).toEqual([]);
  });
});
