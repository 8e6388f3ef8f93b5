/**
 * The CSI Node service: loop devices, formatting, staging and bind mounts on this host.
 *
 * The host is the truth: every call reads /proc/self/mountinfo and /sys/block, so a restarted plugin
 * answers correctly and can tear down what its predecessor set up. The pool's lease files record who
 * staged what (the node-side fence) but never replace a look at the host.
 *
 * Safety rules: a device is formatted only when blkid finds no signature and the volume was never
 * initialized (formatted, or used raw); another filesystem or a partition table is refused untouched;
 * every step a failed call took is undone; only mounts and loop devices of this volume are touched.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import type { Config } from '../config.js';
import {
  CsiError,
  alreadyExists,
  errnoCode,
  failedPrecondition,
  internal,
  invalidArgument,
  notFound,
} from '../errors.js';
import { CommandError } from '../exec/runner.js';
import { failpoint } from '../failpoints.js';
import type { NodeHandlers } from '../gen/csi/v1/Node.js';
import type { NodeServiceCapability } from '../gen/csi/v1/NodeServiceCapability.js';
import type { VolumeCondition } from '../gen/csi/v1/VolumeCondition.js';
import {
  checkFilesystem,
  filesystemSize,
  filesystemUsage,
  flushDeviceBuffers,
  formatDevice,
  growExt4Offline,
  growOnline,
  growthSlack,
  mountedFilesystemSize,
  OnlineGrowthUnsupported,
  probeDevice,
  type DeviceContent,
} from '../host/filesystem.js';
import { attachLoop, detachLoop, type LoopDevice, loopsFor, refreshLoopSize } from '../host/loop.js';
import {
  canonicalPath,
  isReadOnlyMount,
  type MountEntry,
  mountsAt,
  readMounts,
  unmountAll,
} from '../host/mounts.js';
import { isVolumeId } from '../pool/ids.js';
import { allocatedBytes } from '../pool/images.js';
import type { NodeRegistry } from '../pool/nodes.js';
import {
  type AccessMode,
  type Capability,
  FS_TYPES,
  type FsType,
  isFsType,
  isReaderOnly,
  type Lease,
} from '../pool/types.js';
import type { VolumeStore } from '../pool/volumes.js';
import type { CallContext } from '../server/call.js';
import { method, type Methods } from '../server/call.js';
import { parseCapability, parseRange, requireField, requirePath, TOPOLOGY_KEY } from './validate.js';

export interface NodeDeps {
  config: Pick<Config, 'poolName' | 'maxVolumesPerNode' | 'loopDirectIo'> & { nodeId: string };
  volumes: VolumeStore;
  nodes: NodeRegistry;
  /** The pool's real path: no staging or target path may lie inside it. */
  poolRoot: string;
}

export const NODE_CAPABILITIES = [
  'STAGE_UNSTAGE_VOLUME',
  'GET_VOLUME_STATS',
  'VOLUME_CONDITION',
  'SINGLE_NODE_MULTI_WRITER',
  'EXPAND_VOLUME',
] as const;

/** Access modes that allow the volume at more than one target on this node (spec NodePublishVolume table). */
const manyTargets = (mode: AccessMode): boolean =>
  mode === 'SINGLE_NODE_MULTI_WRITER' || mode === 'MULTI_NODE_READER_ONLY';

/** The loop device a mount shows: a filesystem on /dev/loopN, or a bind of the device node itself. */
export function loopOfMount(m: MountEntry, loops: readonly LoopDevice[]): LoopDevice | undefined {
  if (/^\/dev\/loop\d+$/.test(m.source)) return loops.find((l) => l.path === m.source);
  if (/^\/loop\d+$/.test(m.root)) return loops.find((l) => l.name === m.root.slice(1));
  return undefined;
}

const isDeviceBind = (m: MountEntry): boolean => /^\/loop\d+$/.test(m.root);

function mountFailure(err: unknown, what: string, userFlags: readonly string[]): CsiError {
  const detail = err instanceof CommandError ? err.lastStderrLine : '';
  const flags = userFlags.length > 0 ? ` (mount flags: ${userFlags.join(',')})` : '';
  return internal(`${what} failed${flags}${detail ? `: ${detail}` : ''}.`, err);
}

/** Mount options for a staged filesystem. XFS always gets nouuid, so a clone mounts beside its source. */
export function stageMountOptions(fsType: FsType, readOnly: boolean, userFlags: readonly string[]): string[] {
  const opts = userFlags.filter((f) => f !== 'rw' && f !== 'ro');
  if (readOnly) {
    opts.unshift('ro');
    // A read-only device cannot replay a journal; mount what is on disk.
    if (fsType === 'ext4') opts.push('noload');
    if (fsType === 'xfs') opts.push('norecovery');
  }
  if (fsType === 'xfs' && !opts.includes('nouuid')) opts.push('nouuid');
  return [...new Set(opts)];
}

export type FormatDecision =
  | { action: 'format'; fsType: FsType }
  | { action: 'keep'; fsType: FsType }
  | { action: 'refuse'; reason: string };

/**
 * Whether to format a device (the one decision that can destroy data). Format only a device with no
 * signature at all that was never initialized; keep the filesystem that is there when it is the one
 * asked for (or when none was asked for explicitly); refuse everything else, touching nothing.
 */
export function decideFormat(
  content: DeviceContent,
  initialized: boolean,
  requestedFs: string,
  volumeFs: FsType,
): FormatDecision {
  const wanted: FsType = isFsType(requestedFs) ? requestedFs : volumeFs;
  switch (content.kind) {
    case 'blank':
      return initialized
        ? {
            action: 'refuse',
            reason:
              'holds data but no filesystem signature (it was formatted or used as a raw device before); it was not formatted.',
          }
        : { action: 'format', fsType: wanted };
    case 'filesystem':
      if (content.type === wanted) return { action: 'keep', fsType: wanted };
      if (requestedFs === '' && isFsType(content.type)) return { action: 'keep', fsType: content.type };
      return {
        action: 'refuse',
        reason: `holds a ${content.type} filesystem, not ${wanted}; it was left untouched.`,
      };
    case 'other':
      return { action: 'refuse', reason: `holds ${content.what}; it was left untouched.` };
  }
}

export function nodeService(d: NodeDeps): Methods<NodeHandlers> {
  const { volumes } = d;
  const nodeId = d.config.nodeId;
  const lockKey = (id: string): string => `node:${id}`;

  /**
   * The canonical form of a staging or target path the CO gave, refused when it is the root or lies in
   * the pool (a mount there would hand a pod the pool's own files).
   */
  async function callerPath(p: string, field: string): Promise<string> {
    const real = await canonicalPath(p);
    if (
      real === '/' ||
      real === d.poolRoot ||
      real.startsWith(`${d.poolRoot}/`) ||
      d.poolRoot.startsWith(`${real}/`)
    ) {
      throw invalidArgument(
        `${field} ${p} is the root, the pool, or a directory holding the pool; refusing to mount there.`,
      );
    }
    return real;
  }

  async function mustGetVolume(id: string) {
    const meta = isVolumeId(id) ? await volumes.get(id) : undefined;
    if (!meta) throw notFound(`Volume ${id} does not exist.`);
    return meta;
  }

  /** The loop device staged for a volume: the one its staging mount shows, or (block) the one matching the lease. */
  function stagingLoop(
    loops: readonly LoopDevice[],
    lease: Lease | undefined,
    mounts: readonly MountEntry[],
  ): LoopDevice | undefined {
    if (!lease) return undefined;
    if (lease.accessType === 'mount') {
      const top = mountsAt(mounts, lease.stagingPath).at(-1);
      return top ? loops.find((l) => l.path === top.source) : undefined;
    }
    if (lease.device !== undefined) return loops.find((l) => l.name === lease.device);
    return loops.find((l) => l.readOnly === isReaderOnly(lease.mode));
  }

  /**
   * Loop devices of `image` that belong to other nodes' stagings. Only several node plugins sharing one
   * host (a test rig, or a pool tried out on one machine) ever see them; they are never reused, and
   * never detached, by this node.
   */
  async function othersLoops(
    id: string,
    loops: readonly LoopDevice[],
    mounts: readonly MountEntry[],
  ): Promise<Set<string>> {
    const others = new Set<string>();
    if (loops.length === 0) return others;
    for (const l of await volumes.leases(id)) {
      if (l.node === nodeId) continue;
      const theirs = stagingLoop(loops, l, mounts);
      if (theirs) others.add(theirs.name);
    }
    return others;
  }

  async function attach(ctx: CallContext, image: string, readOnly: boolean): Promise<LoopDevice> {
    const loop = await attachLoop(ctx, image, { readOnly, directIo: d.config.loopDirectIo });
    ctx.log.info({ device: loop.path, readOnly, directIo: loop.directIo }, 'attached loop device');
    return loop;
  }

  /** Formats a blank device, attaching it read-write for the purpose when it is staged read-only. */
  async function formatBlank(
    ctx: CallContext,
    id: string,
    image: string,
    loop: LoopDevice,
    fsType: FsType,
  ): Promise<LoopDevice> {
    let target = loop;
    if (loop.readOnly) {
      await detachLoop(ctx, loop);
      target = await attach(ctx, image, false);
    }
    try {
      await formatDevice(ctx, fsType, target.path);
    } catch (err) {
      if (err instanceof CommandError && /contains|existing|appears to/i.test(err.stderr)) {
        throw failedPrecondition(
          `mkfs found existing data on volume ${id} and refused to format it: ${err.lastStderrLine}`,
          err,
        );
      }
      throw mountFailure(err, `Formatting volume ${id} as ${fsType}`, []);
    }
    failpoint('stage:formatted');
    await volumes.markInitialized(id, `node ${nodeId} (mkfs.${fsType})`);
    ctx.log.info({ device: target.path, fsType }, 'formatted a blank volume');
    if (loop.readOnly) {
      await detachLoop(ctx, target);
      target = await attach(ctx, image, true);
    }
    return target;
  }

  /** Grows a mounted xfs/btrfs (or ext4 where allowed) filesystem to its device and checks that it did. */
  async function growMounted(
    ctx: CallContext,
    fsType: FsType,
    loop: LoopDevice,
    mountPoint: string,
  ): Promise<void> {
    const current = await mountedFilesystemSize(ctx, fsType, loop.path, mountPoint);
    if (current !== undefined && current >= loop.sizeBytes - growthSlack(loop.sizeBytes)) return;
    const before = (await filesystemUsage(mountPoint)).totalBytes;
    await growOnline(ctx, fsType, loop.path, mountPoint);
    const size = await mountedFilesystemSize(ctx, fsType, loop.path, mountPoint);
    const after = (await filesystemUsage(mountPoint)).totalBytes;
    if (size === undefined || size < loop.sizeBytes - growthSlack(loop.sizeBytes) || after <= before) {
      throw internal(
        `Growing the ${fsType} filesystem on ${loop.path} did not take effect (device ${loop.sizeBytes} bytes, filesystem ${size ?? 'unreadable'}, statfs ${before} → ${after}).`,
      );
    }
    ctx.log.info({ device: loop.path, fsType, from: before, to: after }, 'grew mounted filesystem');
  }

  /**
   * Unmounts what is mounted at `p` if it is volume `id` (judged by its loop device's backing file).
   * A mount of anything else is left alone: this volume is not there.
   */
  async function unmountOurs(
    ctx: CallContext,
    p: string,
    table: MountEntry[],
    loops: readonly LoopDevice[],
  ): Promise<{ outcome: 'none' | 'ours' | 'foreign'; table: MountEntry[]; unmounted: MountEntry[] }> {
    const mounts = mountsAt(table, p);
    if (mounts.length === 0) return { outcome: 'none', table, unmounted: [] };
    const foreign = mounts.find((m) => !loopOfMount(m, loops));
    if (foreign) {
      ctx.log.warn(
        { path: p, source: foreign.source },
        'this path holds a mount of something else; leaving it alone',
      );
      return { outcome: 'foreign', table, unmounted: [] };
    }
    return { outcome: 'ours', table: await unmountAll(ctx, p, table), unmounted: mounts };
  }

  /** Detaches the loop devices in `loops` that no mount of `mounts` (a fresh table) uses. */
  async function detachUnused(
    ctx: CallContext,
    loops: readonly LoopDevice[],
    mounts: readonly MountEntry[],
    keep?: LoopDevice,
  ): Promise<void> {
    for (const loop of loops) {
      if (keep && loop.name === keep.name) continue;
      const used = mounts.some((m) => loopOfMount(m, [loop]));
      if (!used) {
        await detachLoop(ctx, loop);
        ctx.log.info({ device: loop.path }, 'detached loop device');
      }
    }
  }

  async function removeTarget(p: string): Promise<void> {
    let st;
    try {
      st = await fs.lstat(p);
    } catch (err) {
      if (errnoCode(err) === 'ENOENT') return;
      throw err;
    }
    try {
      if (st.isDirectory()) await fs.rmdir(p);
      else await fs.unlink(p);
    } catch (err) {
      if (errnoCode(err) === 'ENOTEMPTY') {
        throw failedPrecondition(
          `${p} is not empty after unmounting; it holds files written beside the volume, so it was left in place.`,
        );
      }
      if (errnoCode(err) !== 'ENOENT') throw err;
    }
  }

  return {
    NodeGetCapabilities: method({
      validate: () => null,
      quiet: true,
      run: () =>
        Promise.resolve({
          capabilities: NODE_CAPABILITIES.map((type): NodeServiceCapability => ({ rpc: { type } })),
        }),
    }),

    NodeGetInfo: method({
      validate: () => null,
      quiet: true,
      run: async () => {
        await d.nodes.register(nodeId, d.config.poolName, d.config.maxVolumesPerNode);
        return {
          node_id: nodeId,
          max_volumes_per_node: String(d.config.maxVolumesPerNode),
          accessible_topology: { segments: { [TOPOLOGY_KEY]: d.config.poolName } },
        };
      },
    }),

    NodeStageVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        staging: requirePath(req.staging_target_path, 'staging_target_path'),
        cap: parseCapability(req.volume_capability, 'volume_capability'),
        publishPool: req.publish_context['loopvol.csi.io/pool'],
      }),
      locks: (v) => [lockKey(v.id)],
      run: async (v, ctx) => {
        const vol = await mustGetVolume(v.id);
        if (v.publishPool !== undefined && v.publishPool !== d.config.poolName) {
          throw failedPrecondition(
            `Volume ${v.id} was published from pool ${v.publishPool}, but this node serves ${d.config.poolName}.`,
          );
        }
        const staging = await callerPath(v.staging, 'staging_target_path');
        const image = volumes.imagePath(v.id);
        const readOnly = isReaderOnly(v.cap.mode);
        const cap: Capability = v.cap;
        const loops = await loopsFor(image);
        const mounts = await readMounts();
        const ownLease = await volumes.lease(v.id, nodeId);

        // Already staged? (the host decides)
        if (cap.accessType === 'mount') {
          const top = mountsAt(mounts, staging).at(-1);
          if (top) {
            const loop = loops.find((l) => l.path === top.source);
            if (!loop)
              throw failedPrecondition(
                `${staging} already has ${top.source} mounted, which is not volume ${v.id}.`,
              );
            if (
              (cap.fsType !== '' && top.fsType !== cap.fsType) ||
              isReadOnlyMount(top) !== readOnly ||
              ownLease?.accessType === 'block'
            ) {
              throw alreadyExists(
                `Volume ${v.id} is already staged at ${staging} as ${top.fsType}${isReadOnlyMount(top) ? ' read-only' : ''}, which this request does not match.`,
              );
            }
            await volumes.takeLease(v.id, {
              node: nodeId,
              stagingPath: staging,
              accessType: 'mount',
              mode: cap.mode,
              readonly: readOnly,
              since: new Date().toISOString(),
            });
            return {};
          }
        }
        const live = ownLease ? stagingLoop(loops, ownLease, mounts) : undefined;
        if (ownLease && live) {
          if (ownLease.stagingPath !== staging) {
            throw failedPrecondition(
              `Volume ${v.id} is already staged on this node at ${ownLease.stagingPath}; unstage it there first.`,
            );
          }
          if (ownLease.accessType === 'block' && cap.accessType === 'block') {
            if (ownLease.mode !== cap.mode || ownLease.readonly !== readOnly) {
              throw alreadyExists(
                `Volume ${v.id} is already staged at ${staging} with access mode ${ownLease.mode}.`,
              );
            }
            return {};
          }
          if (ownLease.accessType !== cap.accessType) {
            throw alreadyExists(
              `Volume ${v.id} is already staged at ${staging} for ${ownLease.accessType} access.`,
            );
          }
        }

        // A loop device of this image that nothing uses is a leftover of an interrupted call: reused
        // when it is attached the right way round, detached otherwise. One in use is another staging's.
        const others = await othersLoops(v.id, loops, mounts);
        const mine = loops.filter((l) => !others.has(l.name));
        const inUse = (l: LoopDevice): boolean => mounts.some((m) => loopOfMount(m, [l]));
        const usable = mine.filter((l) => l.readOnly === readOnly && !inUse(l));
        const stale = mine.filter((l) => l.readOnly !== readOnly);
        const busy = stale.find(inUse);
        if (busy) {
          throw failedPrecondition(
            `Volume ${v.id} is in use on this node ${busy.readOnly ? 'read-only' : 'read-write'} (${busy.path}); it cannot also be staged ${readOnly ? 'read-only' : 'read-write'}.`,
          );
        }

        // The node-side fence: no other node may hold it.
        const lease: Lease = {
          node: nodeId,
          stagingPath: staging,
          accessType: cap.accessType,
          mode: cap.mode,
          readonly: readOnly,
          since: new Date().toISOString(),
        };
        const previous = await volumes.takeLease(v.id, lease);
        if (previous && previous.stagingPath !== staging) {
          // A lease for another path whose staging is gone (the host rebooted): replace it.
          await volumes.dropLease(v.id, nodeId);
          await volumes.takeLease(v.id, lease);
        }
        const leaseTaken = !previous;

        let loop: LoopDevice | undefined = usable[0];
        let attachedNow: LoopDevice | undefined;
        let mountedNow = false;
        try {
          for (const l of stale) await detachLoop(ctx, l);
          if (!loop) {
            loop = await attach(ctx, image, readOnly);
            attachedNow = loop;
            failpoint('stage:attached');
          } else {
            // A reused attachment (left by an interrupted call): make it see the image's current size
            // (it may have grown since), and drop cached blocks so we read what is on disk.
            if ((await fs.stat(image)).size !== loop.sizeBytes) loop = await refreshLoopSize(ctx, loop);
            if (cap.accessType === 'mount') await flushDeviceBuffers(ctx, loop.path);
          }
          if (cap.accessType === 'block') {
            // Nothing is mounted for a staged block volume: the lease says which device is this node's.
            await volumes.takeLease(v.id, { ...lease, device: loop.name });
            if (!(await volumes.isInitialized(v.id)))
              await volumes.markInitialized(v.id, `node ${nodeId} (raw block)`);
            return {};
          }

          const initialized = await volumes.isInitialized(v.id);
          // An image with no block allocated (a fresh sparse volume) reads as zeros: it holds no
          // signature, so blkid has nothing to find. Anything else is probed.
          const fresh = !initialized && (await allocatedBytes(image)) === 0;
          const content: DeviceContent = fresh ? { kind: 'blank' } : await probeDevice(ctx, loop.path);
          const decision = decideFormat(content, initialized, cap.fsType, vol.fsType);
          if (decision.action === 'refuse') throw failedPrecondition(`Volume ${v.id} ${decision.reason}`);
          const fsType = decision.fsType;
          let growAfterMount = false;
          if (decision.action === 'format') {
            const formatted = await formatBlank(ctx, v.id, image, loop, fsType);
            if (formatted !== loop) {
              attachedNow = formatted;
              loop = formatted;
            }
          } else {
            if (!initialized) await volumes.markInitialized(v.id, `node ${nodeId} (found ${fsType})`);
            if (!readOnly) {
              await checkFilesystem(ctx, fsType, loop.path);
              const size = await filesystemSize(fsType, loop.path);
              growAfterMount = size !== undefined && size < loop.sizeBytes - growthSlack(loop.sizeBytes);
              if (growAfterMount && fsType === 'ext4') {
                // Offline growth needs no CAP_SYS_RESOURCE: every stage makes up for a failed online grow.
                await growExt4Offline(ctx, loop.path);
                growAfterMount = false;
                const grown = await filesystemSize('ext4', loop.path);
                if (grown === undefined || grown < loop.sizeBytes - growthSlack(loop.sizeBytes)) {
                  throw internal(
                    `resize2fs left the ext4 filesystem of volume ${v.id} at ${grown ?? 'an unreadable size'} on a ${loop.sizeBytes}-byte device.`,
                  );
                }
                ctx.log.info(
                  { device: loop.path, from: size, to: grown },
                  'grew ext4 filesystem before mounting',
                );
              }
            }
          }

          await fs.mkdir(staging, { recursive: true, mode: 0o750 });
          const opts = stageMountOptions(fsType, readOnly, cap.mountFlags);
          try {
            await ctx.run(
              'mount',
              ['-t', fsType, ...(opts.length ? ['-o', opts.join(',')] : []), loop.path, staging],
              { timeoutMs: 120_000 },
            );
          } catch (err) {
            throw mountFailure(err, `Mounting volume ${v.id} at ${staging}`, cap.mountFlags);
          }
          mountedNow = true;
          failpoint('stage:mounted');
          if (growAfterMount) await growMounted(ctx, fsType, loop, staging);
          ctx.log.info({ device: loop.path, staging, fsType, options: opts }, 'staged volume');
          return {};
        } catch (err) {
          if (mountedNow)
            await unmountAll(ctx, staging).catch((e: unknown) => {
              ctx.log.error({ err: e }, 'rollback: unmount failed');
            });
          if (attachedNow)
            await detachLoop(ctx, attachedNow).catch((e: unknown) => {
              ctx.log.error({ err: e }, 'rollback: detach failed');
            });
          if (leaseTaken)
            await volumes.dropLease(v.id, nodeId).catch((e: unknown) => {
              ctx.log.error({ err: e }, 'rollback: lease release failed');
            });
          throw err;
        }
      },
    }),

    NodeUnstageVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        staging: requirePath(req.staging_target_path, 'staging_target_path'),
      }),
      locks: (v) => [lockKey(v.id)],
      run: async (v, ctx) => {
        const staging = await canonicalPath(v.staging);
        if (!isVolumeId(v.id)) throw notFound(`Volume ${v.id} does not exist.`);
        const image = volumes.imagePath(v.id);
        const known = (await volumes.read(v.id)) !== undefined;
        const loops = await loopsFor(image);
        const mounts = await readMounts();
        const atStaging = mountsAt(mounts, staging);
        const lease = await volumes.lease(v.id, nodeId);
        if (!known && atStaging.length === 0 && loops.length === 0 && !lease)
          throw notFound(`Volume ${v.id} does not exist.`);

        // Loop devices of other nodes' stagings (several node plugins on one host) are not ours to
        // judge or detach.
        const others = await othersLoops(v.id, loops, mounts);
        const ours = loops.filter((l) => !others.has(l.name));
        // Still published somewhere on this node? The CO must unpublish first.
        const published = mounts.filter((m) => m.mountPoint !== staging && loopOfMount(m, ours));
        if (published.length > 0) {
          throw failedPrecondition(
            `Volume ${v.id} is still published at ${published.map((m) => m.mountPoint).join(', ')}; unpublish it first.`,
          );
        }
        const { outcome, table } = await unmountOurs(ctx, staging, mounts, ours);
        if (outcome === 'ours') ctx.log.info({ staging }, 'unmounted staging path');
        await detachUnused(ctx, ours, table);
        if (lease) await volumes.dropLease(v.id, nodeId);
        return {};
      },
    }),

    NodePublishVolume: method({
      validate: (req) => {
        const id = requireField(req.volume_id, 'volume_id');
        const target = requirePath(req.target_path, 'target_path');
        const cap = parseCapability(req.volume_capability, 'volume_capability');
        if (req.staging_target_path === '') {
          throw failedPrecondition(
            'staging_target_path is required: this driver stages volumes (STAGE_UNSTAGE_VOLUME).',
          );
        }
        return {
          id,
          target,
          cap,
          staging: requirePath(req.staging_target_path, 'staging_target_path'),
          readonly: req.readonly,
        };
      },
      locks: (v) => [lockKey(v.id)],
      run: async (v, ctx) => {
        await mustGetVolume(v.id);
        const staging = await callerPath(v.staging, 'staging_target_path');
        const target = await callerPath(v.target, 'target_path');
        const image = volumes.imagePath(v.id);
        const readOnly = v.readonly || isReaderOnly(v.cap.mode);
        const loops = await loopsFor(image);
        const mounts = await readMounts();
        const lease = await volumes.lease(v.id, nodeId);
        const staged = stagingLoop(loops, lease, mounts);
        if (!lease || lease.stagingPath !== staging || !staged) {
          throw failedPrecondition(
            `Volume ${v.id} is not staged at ${staging} on this node; call NodeStageVolume first.`,
          );
        }
        if (lease.accessType !== v.cap.accessType) {
          throw failedPrecondition(
            `Volume ${v.id} is staged for ${lease.accessType} access, not ${v.cap.accessType}.`,
          );
        }
        const isBlock = v.cap.accessType === 'block';

        // Already published at this target?
        const existing = mountsAt(mounts, target).at(-1);
        if (existing) {
          const loop = loopOfMount(existing, loops);
          if (!loop || isDeviceBind(existing) !== isBlock) {
            throw failedPrecondition(
              `${target} already has a mount of ${existing.source} that is not volume ${v.id}.`,
            );
          }
          if (isReadOnlyMount(existing) !== readOnly) {
            throw alreadyExists(
              `Volume ${v.id} is already published at ${target} ${isReadOnlyMount(existing) ? 'read-only' : 'read-write'}.`,
            );
          }
          return {};
        }
        if (!manyTargets(v.cap.mode)) {
          const other = mounts.find(
            (m) => m.mountPoint !== staging && m.mountPoint !== target && loopOfMount(m, loops),
          );
          if (other) {
            throw failedPrecondition(
              `Volume ${v.id} (${v.cap.mode}) is already published at ${other.mountPoint} on this node.`,
            );
          }
        }

        let created = false;
        let extraLoop: LoopDevice | undefined;
        try {
          await fs.mkdir(path.dirname(target), { recursive: true, mode: 0o750 });
          if (isBlock) {
            try {
              const handle = await fs.open(target, 'wx', 0o660);
              await handle.close();
              created = true;
            } catch (err) {
              if (errnoCode(err) !== 'EEXIST') throw err;
              if ((await fs.lstat(target)).isDirectory())
                throw failedPrecondition(`${target} is a directory; a block volume is published on a file.`);
            }
            // A read-only bind of a device node does not stop writes: publish a read-only loop device.
            let device = staged;
            if (readOnly && !staged.readOnly) {
              extraLoop = await attach(ctx, image, true);
              device = extraLoop;
            }
            await ctx.run('mount', ['--bind', ...(readOnly ? ['-o', 'ro'] : []), device.path, target], {
              timeoutMs: 60_000,
            });
          } else {
            try {
              await fs.mkdir(target, { mode: 0o750 });
              created = true;
            } catch (err) {
              if (errnoCode(err) !== 'EEXIST') throw err;
            }
            await ctx.run('mount', ['--bind', ...(readOnly ? ['-o', 'ro'] : []), staging, target], {
              timeoutMs: 60_000,
            });
          }
          if (readOnly) {
            // Read-only is a promise to the pod: check the kernel kept it (old util-linux needs a remount).
            const now = mountsAt(await readMounts(), target).at(-1);
            if (!now) {
              throw internal(
                `The bind mount of volume ${v.id} at ${target} did not appear in the mount table.`,
              );
            }
            if (!isReadOnlyMount(now)) {
              await ctx.run('mount', ['-o', 'remount,bind,ro', target], { timeoutMs: 60_000 });
            }
          }
          ctx.log.info({ target, readOnly, block: isBlock }, 'published volume');
          return {};
        } catch (err) {
          await unmountAll(ctx, target).catch(() => undefined);
          if (extraLoop) await detachLoop(ctx, extraLoop).catch(() => undefined);
          if (created) await removeTarget(target).catch(() => undefined);
          if (err instanceof CommandError)
            throw mountFailure(err, `Bind-mounting volume ${v.id} at ${target}`, []);
          throw err;
        }
      },
    }),

    NodeUnpublishVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        target: requirePath(req.target_path, 'target_path'),
      }),
      locks: (v) => [lockKey(v.id)],
      run: async (v, ctx) => {
        if (!isVolumeId(v.id)) throw notFound(`Volume ${v.id} does not exist.`);
        const target = await canonicalPath(v.target);
        const image = volumes.imagePath(v.id);
        const known = (await volumes.read(v.id)) !== undefined;
        const loops = await loopsFor(image);
        const { outcome, table, unmounted } = await unmountOurs(ctx, target, await readMounts(), loops);
        if (outcome === 'foreign') return {};
        const present =
          outcome === 'ours' ||
          (await fs.lstat(target).then(
            () => true,
            () => false,
          ));
        if (!known && !present) throw notFound(`Volume ${v.id} does not exist.`);
        await removeTarget(target);
        if (unmounted.some(isDeviceBind)) {
          // A read-only loop device attached only for this block publish goes with it.
          const staged = stagingLoop(loops, await volumes.lease(v.id, nodeId), table);
          const others = await othersLoops(v.id, loops, table);
          if (staged)
            await detachUnused(
              ctx,
              loops.filter((l) => !others.has(l.name)),
              table,
              staged,
            );
        }
        if (outcome === 'ours') ctx.log.info({ target }, 'unpublished volume');
        return {};
      },
    }),

    NodeGetVolumeStats: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        volumePath: requireField(req.volume_path, 'volume_path'),
      }),
      quiet: true,
      run: async ({ id, volumePath }) => {
        await mustGetVolume(id);
        if (!path.isAbsolute(volumePath)) throw notFound(`Volume ${id} is not published at ${volumePath}.`);
        const p = await canonicalPath(volumePath);
        try {
          await fs.lstat(p);
        } catch {
          throw notFound(`Volume ${id} is not published at ${volumePath}.`);
        }
        const image = volumes.imagePath(id);
        const loops = await loopsFor(image);
        const top = mountsAt(await readMounts(), p).at(-1);
        const abnormal = (message: string): VolumeCondition => ({ abnormal: true, message });
        const imagePresent = await fs.stat(image).then(
          () => true,
          () => false,
        );
        if (!top) {
          return {
            usage: [],
            volume_condition: abnormal(
              imagePresent
                ? `The volume is not mounted at ${volumePath}.`
                : 'The disk image is missing from the pool.',
            ),
          };
        }
        const loop = loopOfMount(top, loops);
        if (!loop) {
          const anyLoop = /^\/dev\/loop\d+$/.test(top.source) || isDeviceBind(top);
          if (!anyLoop) throw notFound(`Volume ${id} is not published at ${volumePath}.`);
          return {
            usage: [],
            volume_condition: abnormal(
              imagePresent
                ? 'The loop device behind this path is detached or backed by another file.'
                : 'The disk image is missing from the pool.',
            ),
          };
        }
        let condition: VolumeCondition = {
          abnormal: false,
          message: 'The volume is attached, mounted and healthy.',
        };
        if (!imagePresent) condition = abnormal('The disk image is missing from the pool.');
        if (isDeviceBind(top)) {
          return { usage: [{ unit: 'BYTES', total: String(loop.sizeBytes) }], volume_condition: condition };
        }
        const lease = await volumes.lease(id, nodeId);
        if (top.superOptions.includes('ro') && lease && !lease.readonly && condition.abnormal === false) {
          condition = abnormal('The filesystem went read-only, usually after I/O or consistency errors.');
        }
        try {
          const u = await filesystemUsage(p);
          return {
            usage: [
              {
                unit: 'BYTES',
                total: String(u.totalBytes),
                available: String(u.availableBytes),
                used: String(u.usedBytes),
              },
              {
                unit: 'INODES',
                total: String(u.totalInodes),
                available: String(u.freeInodes),
                used: String(u.totalInodes - u.freeInodes),
              },
            ],
            volume_condition: condition,
          };
        } catch (err) {
          return {
            usage: [],
            volume_condition: abnormal(`The filesystem does not answer (${errnoCode(err) ?? 'error'}).`),
          };
        }
      },
    }),

    NodeExpandVolume: method({
      validate: (req) => ({
        id: requireField(req.volume_id, 'volume_id'),
        volumePath: requireField(req.volume_path, 'volume_path'),
        range: parseRange(req.capacity_range),
        cap: req.volume_capability ? parseCapability(req.volume_capability, 'volume_capability') : undefined,
      }),
      locks: (v) => [lockKey(v.id)],
      run: async ({ id, volumePath, range }, ctx) => {
        await mustGetVolume(id);
        if (!path.isAbsolute(volumePath)) throw notFound(`Volume ${id} is not published at ${volumePath}.`);
        const p = await canonicalPath(volumePath);
        const image = volumes.imagePath(id);
        const loops = await loopsFor(image);
        const top = mountsAt(await readMounts(), p).at(-1);
        const loop = top ? loopOfMount(top, loops) : undefined;
        if (!top || !loop) throw notFound(`Volume ${id} is not staged or published at ${volumePath}.`);
        let size = loop.sizeBytes;
        for (const l of loops) {
          const refreshed = await refreshLoopSize(ctx, l);
          if (l.name === loop.name) size = refreshed.sizeBytes;
        }
        if (range.requiredBytes > 0 && size < range.requiredBytes) {
          throw failedPrecondition(
            `The disk image of volume ${id} is ${size} bytes, less than the ${range.requiredBytes} asked for; expand it with ControllerExpandVolume first.`,
          );
        }
        if (isDeviceBind(top)) return { capacity_bytes: String(size) };
        const fsType = top.fsType;
        if (!isFsType(fsType))
          throw failedPrecondition(
            `${volumePath} holds ${fsType}, which this driver does not grow (it knows ${FS_TYPES.join(', ')}).`,
          );
        const grown = { ...loop, sizeBytes: size };
        if (isReadOnlyMount(top)) {
          const fsSize = await mountedFilesystemSize(ctx, fsType, loop.path, p);
          if (fsSize !== undefined && fsSize >= size - growthSlack(size))
            return { capacity_bytes: String(size) };
          throw failedPrecondition(
            `Volume ${id} is mounted read-only here; its filesystem will be grown when it is next staged read-write.`,
          );
        }
        try {
          await growMounted(ctx, fsType, grown, p);
        } catch (err) {
          if (err instanceof OnlineGrowthUnsupported) {
            throw failedPrecondition(
              `Cannot grow volume ${id} while it is mounted: ${err.message}. The filesystem will be grown when the volume is next staged (restart the pod).`,
              err,
            );
          }
          throw err;
        }
        return { capacity_bytes: String(size) };
      },
    }),
  };
}
