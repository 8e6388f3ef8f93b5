/**
 * Correctness to the letter (root only): mount options across stage and publish as the kernel shows
 * them (spec: NodeStageVolume/NodePublishVolume mount_flags, readonly), read-only in the mount
 * options, sizes the pool's filesystem cannot hold, a capacity limit that is not a whole MiB, block
 * volumes without a filesystem label, a restore racing a delete of its source, and mount failures
 * that say why.
 */
import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { VolumeCapability } from '../../src/gen/csi/v1/VolumeCapability.js';
import type { DriverProcess } from '../helpers/driver.js';
import { blockCap, mountCap, TestEnv } from '../helpers/env.js';
import { codeOf, errorOf } from '../helpers/grpc.js';
import { isRoot, MiB, RUN, sha256, writeRandom } from '../helpers/host.js';
import { createVolume, publish } from '../helpers/volumes.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});
const TiB = 2 ** 40;

/** The per-mount options the kernel shows for `mp`. */
async function optionsAt(mp: string): Promise<string[]> {
  const line = (await fs.readFile('/proc/self/mountinfo', 'utf8'))
    .split('\n')
    .find((l) => l.split(' ')[4] === mp);
  return line?.split(' ')[5]?.split(',') ?? [];
}

let d: DriverProcess;
let base = '';
beforeAll(async () => {
  if (!isRoot()) return;
  base = await env.dir('correct');
  d = await env.driver({ dir: base, extra: ['--overcommit-ratio=1000'] });
});

async function volume(name: string, cap: VolumeCapability, bytes = 32 * MiB) {
  const made = await createVolume(d, `${name}-${RUN}`, cap, bytes);
  const staging = path.join(base, `st-${name}`);
  await fs.mkdir(staging, { recursive: true });
  return { ...made, staging };
}

describe.skipIf(!isRoot())('mount options across stage and publish, as the kernel shows them', () => {
  const SECURITY = ['nosuid', 'nodev', 'noexec'];
  it.each([
    // [stage mount flags, publish read-only, options the target must show, options it must not]
    [[], false, ['rw'], ['ro']],
    [[], true, ['ro'], []],
    [SECURITY, false, ['rw', ...SECURITY], []],
    [SECURITY, true, ['ro', ...SECURITY], []],
    [['noatime'], true, ['ro', 'noatime'], []],
    [['ro'], false, ['ro'], []], // read-only in the mount options: honoured, never ignored
    [['ro', 'nodev'], false, ['ro', 'nodev'], []],
  ] as [string[], boolean, string[], string[]][])(
    'stage %j, publish read-only %s',
    async (flags, readonly, wanted, unwanted) => {
      const cap = mountCap('ext4', 'SINGLE_NODE_WRITER', flags);
      const name = `pvc-opts-${flags.join('-') || 'none'}-${readonly}`;
      const { id, staging } = await volume(name, cap);
      await d.clients.node.NodeStageVolume({
        volume_id: id,
        staging_target_path: staging,
        volume_capability: cap,
      });
      const stagedOpts = await optionsAt(staging);
      for (const f of flags) expect(stagedOpts).toContain(f);
      if (!flags.includes('ro')) expect(stagedOpts).toContain('rw');
      const target = path.join(base, `pod-${name}`, 'mount');
      await publish(d, id, staging, target, cap, readonly);
      const opts = await optionsAt(target);
      for (const w of wanted) expect(opts, `target options ${opts.join(',')}`).toContain(w);
      for (const u of unwanted) expect(opts).not.toContain(u);
      if (flags.includes('noexec') && !readonly) {
        // noexec kept: a binary copied onto the volume does not run from the pod's path.
        await fs.copyFile('/bin/true', path.join(target, 'true'));
        await fs.chmod(path.join(target, 'true'), 0o755);
        expect(() => execFileSync(path.join(target, 'true'))).toThrow(/EACCES/);
      }
      if (readonly || flags.includes('ro')) {
        await expect(fs.writeFile(path.join(target, 'w'), 'x')).rejects.toThrow(/EROFS/);
      }
      await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    },
  );
});

describe.skipIf(!isRoot())('sizes', () => {
  it("reports no maximum the pool's filesystem cannot hold, and refuses one with OUT_OF_RANGE", async () => {
    // This pool is on ext4 with 4 KiB blocks (the test machine's /tmp): 16 TiB - 4 KiB per file.
    const cap = await d.clients.controller.GetCapacity({});
    expect(Number(cap.maximum_volume_size?.value)).toBeLessThan(16 * TiB);
    const e = await errorOf(
      d.clients.controller.CreateVolume({
        name: `pvc-huge-${RUN}`,
        capacity_range: { required_bytes: String(17 * TiB) },
        volume_capabilities: [mountCap('ext4')],
      }),
    );
    expect(e.code).toBe('OUT_OF_RANGE');
    expect(e.details).toMatch(/files of at most 16(\.0)? TiB/);
  });

  it('makes a volume under a limit that is not a whole MiB', async () => {
    const res = await d.clients.controller.CreateVolume({
      name: `pvc-limit-${RUN}`,
      capacity_range: { limit_bytes: String(3 * MiB + 5) },
      volume_capabilities: [blockCap()],
    });
    expect(res.volume?.capacity_bytes).toBe(String(3 * MiB));
    await d.clients.controller.DeleteVolume({ volume_id: res.volume?.volume_id ?? '' });
  });
});

describe.skipIf(!isRoot())('a block volume has no filesystem of ours', () => {
  it('restores by what the image holds, not by a label', async () => {
    const cap = blockCap();
    const { id, staging, volume: vol } = await volume('pvc-raw', cap, 320 * MiB);
    expect(vol?.volume_context['loopvol.csi.io/fstype']).toBeUndefined();
    const vvc = await d.clients.controller.ValidateVolumeCapabilities({
      volume_id: id,
      volume_capabilities: [mountCap('ext4')],
    });
    expect(vvc.confirmed).toBeNull();
    expect(vvc.message).toMatch(/raw block/);
    await d.clients.node.NodeStageVolume({
      volume_id: id,
      staging_target_path: staging,
      volume_capability: cap,
    });
    const target = path.join(base, 'pod-raw', 'dev');
    await publish(d, id, staging, target, cap);
    // The pod makes an xfs of it, then goes (a copy of a block volume in use is refused on this pool).
    execFileSync('mkfs.xfs', ['-q', '-f', target]);
    const down = async () => {
      await d.clients.node.NodeUnpublishVolume({ volume_id: id, target_path: target });
      await d.clients.node.NodeUnstageVolume({ volume_id: id, staging_target_path: staging });
    };
    await down();
    const snap = await d.clients.controller.CreateSnapshot({ name: `snap-raw-${RUN}`, source_volume_id: id });
    const source = { snapshot: { snapshot_id: snap.snapshot?.snapshot_id ?? '' } };
    const restore = (fsType: string, c: VolumeCapability = mountCap(fsType)) =>
      d.clients.controller.CreateVolume({
        name: `pvc-raw-restore-${fsType || 'block'}-${RUN}`,
        volume_capabilities: [c],
        volume_content_source: source,
      });
    const asXfs = await restore('xfs');
    expect(asXfs.volume?.volume_context['loopvol.csi.io/fstype']).toBe('xfs');
    const wrong = await errorOf(restore('ext4'));
    expect(wrong.code).toBe('INVALID_ARGUMENT');
    expect(wrong.details).toMatch(/holds xfs/);
    // Raw data (no filesystem) restores as block, never as a filesystem.
    await writeRandom(path.join(d.poolDir, 'volumes', id, 'disk.img'), 4, 3);
    const raw = await d.clients.controller.CreateSnapshot({ name: `snap-raw2-${RUN}`, source_volume_id: id });
    const rawMount = await errorOf(
      d.clients.controller.CreateVolume({
        name: `pvc-raw-restore2-${RUN}`,
        volume_capabilities: [mountCap('')],
        volume_content_source: { snapshot: { snapshot_id: raw.snapshot?.snapshot_id ?? '' } },
      }),
    );
    expect(rawMount.code).toBe('INVALID_ARGUMENT');
    expect(rawMount.details).toMatch(/no .*filesystem/);
  });
});

describe.skipIf(!isRoot())('a restore racing a delete of its source from another controller', () => {
  it('either restores whole or finds no source; never INTERNAL', async () => {
    const other = await env.driver({ dir: base, mode: 'controller', socket: path.join(base, 'other.sock') });
    const cap = blockCap();
    const { id } = await volume('pvc-race-src', cap, 256 * MiB);
    const image = path.join(d.poolDir, 'volumes', id, 'disk.img');
    await writeRandom(image, 192, 5); // as a pod would have (not in use now: a copy would be refused)
    const sum = await sha256(image);
    for (let round = 0; round < 4; round++) {
      const snap = await d.clients.controller.CreateSnapshot({
        name: `snap-race-${round}-${RUN}`,
        source_volume_id: id,
      });
      const snapshotId = snap.snapshot?.snapshot_id ?? '';
      const restore = d.clients.controller.CreateVolume({
        name: `pvc-race-restore-${round}-${RUN}`,
        volume_capabilities: [cap],
        volume_content_source: { snapshot: { snapshot_id: snapshotId } },
      });
      await new Promise((r) => setTimeout(r, round * 40));
      const del = other.clients.controller.DeleteSnapshot({ snapshot_id: snapshotId });
      const [r, dl] = await Promise.all([codeOf(restore), codeOf(del)]);
      expect(['OK', 'NOT_FOUND']).toContain(r);
      expect(['OK', 'ABORTED']).toContain(dl);
      if (r === 'OK') {
        const restored = (await restore).volume?.volume_id ?? '';
        expect(await sha256(path.join(d.poolDir, 'volumes', restored, 'disk.img'))).toBe(sum);
      }
      await other.clients.controller.DeleteSnapshot({ snapshot_id: snapshotId });
    }
  });
});

describe.skipIf(!isRoot())('a mount that fails', () => {
  it('says what failed, not where to look', async () => {
    const cap = mountCap('ext4', 'SINGLE_NODE_WRITER', ['data=bogus']);
    const { id, staging } = await volume('pvc-badopt', cap);
    const e = await errorOf(
      d.clients.node.NodeStageVolume({ volume_id: id, staging_target_path: staging, volume_capability: cap }),
    );
    expect(e.details).toMatch(/bad option/);
    expect(e.details).not.toMatch(/dmesg/);
    expect(e.details).not.toMatch(/\.\.$/);
  });
});
