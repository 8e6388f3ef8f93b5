/**
 * Links planted in a pool (root only, real loop devices and mounts). Anyone who can write to a shared
 * export can put a symlink or a hard link where the driver keeps its own directories and images; a
 * review reproduced each of these against the driver as it was: a `trash` symlink emptied the
 * directory it led to (at gc, and at every start), a `disk.img` symlink to a block device had that
 * device formatted, and an image hard-linked from another pool made `gc --yes` unmount that pool's
 * live pod volume.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { runMain } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { codeOf } from '../helpers/grpc.js';
import { isMounted, isRoot, MiB, sha256 } from '../helpers/host.js';
import { createVolume, publish, stage } from '../helpers/volumes.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

const sh = (cmd: string, args: string[]): string =>
  execFileSync(cmd, args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });

describe.skipIf(!isRoot())('links planted in the pool', () => {
  it('a trash symlink: gc refuses the pool, a driver serves but sweeps nothing, nothing is emptied', async () => {
    const base = await env.dir('planted-trash');
    const pool = path.join(base, 'pool');
    expect((await runMain(['create-pool', `--pool-dir=${pool}`])).code).toBe(0);
    const victim = path.join(base, 'victim');
    await fs.mkdir(path.join(victim, 'sub'), { recursive: true });
    await fs.writeFile(path.join(victim, 'a.txt'), 'keep');
    await fs.writeFile(path.join(victim, 'sub', 'b.txt'), 'keep');
    // Entries old enough to be swept, as a trash's would be.
    const old = new Date(Date.now() - 3600_000);
    await fs.utimes(path.join(victim, 'a.txt'), old, old);
    await fs.rm(path.join(pool, 'trash'), { recursive: true });
    await fs.symlink(victim, path.join(pool, 'trash'));

    const gc = await runMain(['gc', '--yes', '--trash-age=1', `--pool-dir=${pool}`]);
    // The driver keeps serving (pods keep their volumes, nodes can let go of them), and says why it
    // sweeps nothing.
    const d = await env.driver({ dir: base, poolDir: pool });
    const said = await d.waitForLog((l) => l.includes('the trash is not swept'));
    const probe = await codeOf(d.clients.identity.Probe({}));
    expect({
      gc: gc.code,
      gcSays: gc.stderr,
      said,
      probe,
      victim: (await fs.readdir(victim)).sort(),
      sub: await fs.readdir(path.join(victim, 'sub')),
    }).toMatchObject({
      gc: 3,
      gcSays: expect.stringMatching(/trash is not a directory \(a symlink\)/) as unknown,
      said: true,
      probe: 'OK',
      victim: ['a.txt', 'sub'],
      sub: ['b.txt'],
    });
  });

  it('an image replaced by a symlink to a device or a host file: never attached, grown or copied', async () => {
    const base = await env.dir('planted-image');
    const d = await env.driver({ dir: base });
    const victimImage = path.join(base, 'victim.img');
    await fs.writeFile(victimImage, Buffer.alloc(16 * MiB, 'PRECIOUS RAW DATA '));
    const before = await sha256(victimImage);
    const victimDev = sh('losetup', ['--find', '--show', victimImage]).trim();
    const hostFile = path.join(base, 'host-secret');
    await fs.writeFile(hostFile, 'secret');
    let codes: Record<string, string> = {};
    try {
      const cap = mountCap('ext4');
      const a = await createVolume(d, 'planted-dev', cap, 16 * MiB);
      await fs.rm(a.image);
      await fs.symlink(victimDev, a.image);
      const b = await createVolume(d, 'planted-file', blockCap(), 16 * MiB);
      await fs.rm(b.image);
      await fs.symlink(hostFile, b.image);
      codes = {
        stage: await codeOf(stage(d, a.id, path.join(base, 'st-a'), cap)),
        stageBlock: await codeOf(stage(d, b.id, path.join(base, 'st-b'), blockCap())),
        expand: await codeOf(
          d.clients.controller.ControllerExpandVolume({
            volume_id: b.id,
            capacity_range: { required_bytes: String(32 * MiB) },
          }),
        ),
        snapshot: await codeOf(
          d.clients.controller.CreateSnapshot({ name: 'planted-snap', source_volume_id: b.id }),
        ),
      };
    } finally {
      // Whatever a faulty stage attached on top of the victim device goes first.
      for (const line of sh('losetup', ['--associated', victimDev, '--noheadings', '--output', 'NAME']).split(
        '\n',
      ))
        if (line.trim()) sh('losetup', ['--detach', line.trim()]);
      sh('losetup', ['--detach', victimDev]);
    }
    expect({
      codes,
      victim: await sha256(victimImage),
      hostFile: await fs.readFile(hostFile, 'utf8'),
      attached: sh('losetup', ['--list', '--noheadings', '--output', 'BACK-FILE']).includes(base),
    }).toEqual({
      codes: {
        stage: 'FAILED_PRECONDITION',
        stageBlock: 'FAILED_PRECONDITION',
        expand: 'FAILED_PRECONDITION',
        snapshot: 'FAILED_PRECONDITION',
      },
      victim: before,
      hostFile: 'secret',
      attached: false,
    });
  });

  it('DeleteVolume of a volume whose directory holds a planted symlink removes the link, not what it leads to', async () => {
    const base = await env.dir('planted-delete');
    const d = await env.driver({ dir: base });
    const victim = path.join(base, 'victim');
    await fs.mkdir(victim);
    await fs.writeFile(path.join(victim, 'keep'), 'keep');
    const { id } = await createVolume(d, 'planted-del', mountCap('ext4'), 16 * MiB, null);
    await fs.symlink(victim, path.join(d.poolDir, 'volumes', id, 'spool'));
    const code = await codeOf(d.clients.controller.DeleteVolume({ volume_id: id }));
    expect({ code, victim: await fs.readdir(victim) }).toEqual({ code: 'OK', victim: ['keep'] });
  });

  it("gc of a pool holding a link to another pool's image leaves that pool's live volume mounted", async () => {
    const base = await env.dir('planted-gc');
    const d = await env.driver({ dir: base });
    const cap = mountCap('ext4');
    const { id, image } = await createVolume(d, 'live', cap, 32 * MiB);
    const staging = path.join(base, 'kubelet', 'staging');
    const target = path.join(base, 'kubelet', 'pods', 'p', 'mount');
    await stage(d, id, staging, cap);
    await publish(d, id, staging, target, cap);
    const other = path.join(base, 'other');
    expect((await runMain(['create-pool', `--pool-dir=${other}`])).code).toBe(0);
    const hard = path.join(other, 'volumes', 'vol-00000000000000000000000000000001');
    const soft = path.join(other, 'volumes', 'vol-00000000000000000000000000000002');
    await fs.mkdir(hard);
    await fs.mkdir(soft);
    await fs.link(image, path.join(hard, 'disk.img'));
    await fs.symlink(image, path.join(soft, 'disk.img'));
    const gc = await runMain([
      'gc',
      '--yes',
      `--pool-dir=${other}`,
      `--kubelet-dir=${path.join(base, 'kubelet')}`,
    ]);
    const after = { staged: await isMounted(staging), published: await isMounted(target) };
    await fs.rm(path.join(hard, 'disk.img'));
    await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
    await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    expect({ ...after, unmounted: gc.stdout.includes('unmounted') }).toEqual({
      staged: true,
      published: true,
      unmounted: false,
    });
  });
});
