/**
 * The mount namespace a test makes for a node plugin (test/helpers/host.ts ownMountNamespace) drops its
 * copies of other test files' mounts, and never unmounts anything of the host's: an unmount reaches
 * the peers of the mount's parent, so a private mount under a shared parent (what / is on a systemd
 * host) is the case to get right. Root only: tmpfs mounts of its own, under a temporary directory of
 * its own (TMPDIR, which the helper reads when called).
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { isMounted, isRoot, ownMountNamespace } from '../helpers/host.js';

const sh = (cmd: string, args: string[]): string => execFileSync(cmd, args, { encoding: 'utf8' });
let root = '';
const savedTmp = process.env.TMPDIR;

afterAll(async () => {
  if (savedTmp === undefined) delete process.env.TMPDIR;
  else process.env.TMPDIR = savedTmp;
  if (!root) return;
  for (const mp of ['loopvol-other/mnt', 'loopvol-keep/mnt', '.'].map((p) => path.join(root, p))) {
    try {
      sh('umount', [mp]);
    } catch {
      // not mounted
    }
  }
  await fs.rm(root, { recursive: true, force: true });
});

describe.skipIf(!isRoot())('a test mount namespace', () => {
  it.each(['unchanged', 'private'] as const)(
    'made with %s propagation under a shared parent, drops only its copies of the others',
    async (propagation) => {
      root = root || (await fs.mkdtemp('/tmp/ownns-'));
      if (!(await isMounted(root))) {
        // The parent: shared, as / is on a systemd host. Another file's mount: private beneath it.
        sh('mount', ['-t', 'tmpfs', 'ownns-parent', root]);
        sh('mount', ['--make-shared', root]);
        for (const d of ['loopvol-other/mnt', 'loopvol-keep/mnt']) {
          await fs.mkdir(path.join(root, d), { recursive: true });
          sh('mount', ['-t', 'tmpfs', 'ownns-child', path.join(root, d)]);
          sh('mount', ['--make-private', path.join(root, d)]);
        }
      }
      process.env.TMPDIR = root;
      const [cmd = 'unshare', ...args] = ownMountNamespace(path.join(root, 'loopvol-keep'), propagation);
      const inside = sh(cmd, [...args, 'sh', '-c', 'cut -d" " -f5 /proc/self/mountinfo'])
        .split('\n')
        .filter((mp) => mp.startsWith(root));
      expect({
        inside,
        host: [
          await isMounted(path.join(root, 'loopvol-other/mnt')),
          await isMounted(path.join(root, 'loopvol-keep/mnt')),
        ],
      }).toEqual({ inside: [root, path.join(root, 'loopvol-keep/mnt')], host: [true, true] });
    },
  );
});
