/**
 * Volumes in the pool. What CreateVolume does on a crash, what DeleteVolume leaves behind, and how
 * attachments and node leases fence a volume all live here.
 *
 * Create: the directory volumes/<id> (id derived from the name) is the reservation. Its meta.json says
 * "creating" until the image is complete and renamed into place, then "ready". A retry that finds a
 * "creating" volume (a crash at any point) discards it and starts over, because nothing was ever
 * returned for it; a retry that finds a "ready" one returns it. So a name never yields two volumes, and
 * a half-written image is never handed out.
 *
 * Delete: one rename moves the directory into the trash (the volume is gone at that instant, for every
 * process), then the files are removed. A crash in between leaves only trash, swept at the next start.
 */
import fs from 'node:fs/promises';
import type { Logger } from 'pino';
import { failpoint } from '../failpoints.js';
import { conflict, mismatch, missing, noSpace } from '../errors.js';
import type { Capacity } from './capacity.js';
import {
  createExclusive,
  exists,
  fsyncDir,
  listDir,
  readRecord,
  type RecordRead,
  removeFile,
  writeFileAtomic,
} from './fsutil.js';
import { isNodeId, isVolumeId } from './ids.js';
import { allocatedBytes } from './images.js';
import type { NodeRegistry } from './nodes.js';
import type { HeldLock } from './lock.js';
import { damagedRecord, type Pool } from './pool.js';
import {
  type Attachment,
  isMultiNode,
  type Lease,
  parseAttachment,
  parseLease,
  parseVolumeMeta,
  type VolumeMeta,
} from './types.js';

const LIST_BATCH = 256;

const json = (v: unknown): string => `${JSON.stringify(v, null, 2)}\n`;

export interface FillResult {
  /** The image holds a filesystem or raw data already (a clone or a restore). */
  initialized: boolean;
}

export class VolumeStore {
  constructor(
    private readonly pool: Pool,
    private readonly capacity: Capacity,
    private readonly nodes: NodeRegistry,
    private readonly log: Logger,
  ) {}

  private get layout() {
    return this.pool.layout;
  }

  imagePath(id: string): string {
    return this.layout.volumeImage(id);
  }

  /** The volume's record as it is on disk: absent, sound, or damaged. */
  inspect(id: string): Promise<RecordRead<VolumeMeta>> {
    if (!isVolumeId(id)) return Promise.resolve({ state: 'absent' });
    return readRecord(this.layout.volumeMeta(id), parseVolumeMeta);
  }

  /**
   * The volume's record in whatever state it is; undefined when there is none (or the id is not ours).
   * A record that cannot be read is an error, never "absent": it may stand for data.
   */
  async read(id: string): Promise<VolumeMeta | undefined> {
    const r = await this.inspect(id);
    if (r.state === 'damaged') throw damagedRecord(`volume ${id}`, r.reason);
    return r.state === 'ok' ? r.value : undefined;
  }

  /** A volume that exists and is complete. */
  async get(id: string): Promise<VolumeMeta | undefined> {
    const meta = await this.read(id);
    return meta?.state === 'ready' ? meta : undefined;
  }

  async mustGet(id: string): Promise<VolumeMeta> {
    const meta = await this.get(id);
    if (!meta) throw missing(`Volume ${id} does not exist.`);
    return meta;
  }

  private async writeMeta(meta: VolumeMeta, durable = true): Promise<void> {
    await writeFileAtomic(this.layout.volumeMeta(meta.id), json(meta), durable);
  }

  /**
   * Creates the volume `meta` describes, or returns the one already made under its name. `fill` writes
   * the image at the path it is given. The caller holds the volume's in-flight key.
   */
  async create(
    meta: VolumeMeta,
    fill: (imagePath: string, lock: HeldLock) => Promise<FillResult>,
  ): Promise<{ volume: VolumeMeta; created: boolean }> {
    const { id } = meta;
    return this.pool.withLock(id, 'CreateVolume', async (lock) => {
      const record = await this.inspect(id);
      if (record.state === 'ok' && record.value.state === 'ready')
        return { volume: record.value, created: false };
      const dir = this.layout.volumeDir(id);
      await this.pool.clearLeftover(`volume ${id}`, dir, record, this.layout.volumeImage(id));
      await this.pool.refuseQuarantined(`volume ${id}`, id);
      const settle = await this.capacity.reserve(
        meta.capacityBytes,
        meta.allocation === 'preallocate' && !meta.contentSource ? 'preallocate' : 'sparse',
        `volume ${meta.name}`,
      );
      let promisedAfter: number | undefined;
      try {
        // Nothing before the final "ready" record needs to survive a power cut: a retry finds either
        // no directory or an unfinished one, and starts over. So only that record (and the image and
        // the directory entry it stands for) is synced.
        await fs.mkdir(dir, { mode: 0o750 });
        failpoint('create-volume:dir');
        await this.writeMeta({ ...meta, state: 'creating' }, false);
        failpoint('create-volume:meta-creating');
        const partial = this.layout.volumeImageTemp(id);
        const { initialized } = await fill(partial, lock);
        failpoint('create-volume:image-written');
        await fs.rename(partial, this.layout.volumeImage(id));
        failpoint('create-volume:image-renamed');
        if (initialized) await this.markInitialized(id, 'controller (content source)');
        lock.assertHeld();
        const ready: VolumeMeta = { ...meta, state: 'ready', updatedAt: new Date().toISOString() };
        await this.writeMeta(ready); // its directory sync also makes the image's rename durable
        await fsyncDir(this.layout.volumesDir);
        failpoint('create-volume:ready');
        promisedAfter = Math.max(0, meta.capacityBytes - (await allocatedBytes(this.layout.volumeImage(id))));
        return { volume: ready, created: true };
      } catch (err) {
        await this.pool.discard(dir).catch((cleanupErr: unknown) => {
          this.log.error({ volumeId: id, err: cleanupErr }, 'could not remove a failed volume creation');
        });
        throw err;
      } finally {
        settle(promisedAfter);
      }
    });
  }

  /**
   * Deletes a volume; absent is success. Refused while any node has it published or staged, or while
   * `inUseHere` (a look at this host) says its image is attached. A volume whose record cannot be read
   * is quarantined, not deleted.
   */
  async delete(id: string, inUseHere?: (image: string) => Promise<string | undefined>): Promise<void> {
    if (!isVolumeId(id)) return;
    await this.pool.withLock(id, 'DeleteVolume', async () => {
      const dir = this.layout.volumeDir(id);
      if (!(await exists(dir))) return;
      const record = await this.inspect(id);
      if (record.state !== 'ok') {
        // An unfinished creation goes; anything that may hold data is quarantined.
        await this.pool.clearLeftover(`volume ${id}`, dir, record, this.layout.volumeImage(id));
        return;
      }
      const attachments = await this.attachments(id);
      if (attachments.length > 0) {
        throw conflict(
          `Volume ${id} is still published to node ${attachments.map((a) => a.node).join(', ')}; unpublish it first.`,
        );
      }
      const leases = await this.leases(id);
      if (leases.length > 0) {
        throw conflict(
          `Volume ${id} is still staged on node ${leases.map((l) => l.node).join(', ')}; unstage it first.`,
        );
      }
      const here = await inUseHere?.(this.layout.volumeImage(id));
      if (here !== undefined) {
        throw conflict(`Volume ${id} is still in use on this host (${here}); it was not deleted.`);
      }
      let promised = 0;
      try {
        const st = await fs.stat(this.layout.volumeImage(id));
        promised = Math.max(0, st.size - st.blocks * 512);
      } catch {
        promised = 0;
      }
      await this.pool.discard(dir);
      this.capacity.adjust(-promised);
    });
  }

  /** One page of complete volumes in id order, starting after `after`. max 0 means all. */
  async list(
    after: string | undefined,
    max: number,
  ): Promise<{ volumes: VolumeMeta[]; next: string | undefined }> {
    const ids = (await listDir(this.layout.volumesDir)).filter(isVolumeId).sort();
    let i = after === undefined ? 0 : ids.findIndex((id) => id > after);
    if (i < 0) i = ids.length;
    const limit = max > 0 ? max : Number.POSITIVE_INFINITY;
    const volumes: VolumeMeta[] = [];
    while (volumes.length < limit && i < ids.length) {
      const want = Math.min(LIST_BATCH, limit - volumes.length);
      const batch = ids.slice(i, i + want);
      i += batch.length;
      for (const r of await Promise.all(batch.map((id) => this.inspect(id)))) {
        if (r.state === 'ok' && r.value.state === 'ready') volumes.push(r.value);
      }
    }
    const last = volumes.at(-1);
    return { volumes, next: i < ids.length && last ? last.id : undefined };
  }

  async attachments(id: string): Promise<Attachment[]> {
    const dir = this.layout.attachmentsDir(id);
    const names = (await listDir(dir)).filter((n) => n.endsWith('.json'));
    const out: Attachment[] = [];
    for (const name of names) {
      const node = name.slice(0, -'.json'.length);
      if (!isNodeId(node)) continue;
      const r = await readRecord(this.layout.attachment(id, node), parseAttachment);
      if (r.state === 'ok') out.push(r.value);
      else if (r.state === 'damaged') {
        // Unreadable: it still says the node may use the volume. Assume the most it could say.
        this.log.error(
          { volumeId: id, node, reason: r.reason },
          'an attachment record cannot be read; treating it as a writer',
        );
        out.push({
          node,
          readonly: false,
          accessType: 'mount',
          mode: 'SINGLE_NODE_WRITER',
          since: 'unknown (unreadable record)',
        });
      }
    }
    return out.sort((a, b) => a.node.localeCompare(b.node));
  }

  /**
   * Records that `att.node` may use the volume (ControllerPublishVolume). Same node and arguments again:
   * 'exists'. A single-node volume published elsewhere: FAILED_PRECONDITION naming the node. The node's
   * attach limit: RESOURCE_EXHAUSTED.
   */
  async publish(id: string, att: Attachment, maxVolumes: number): Promise<'created' | 'exists'> {
    return this.pool.withLock(id, 'ControllerPublishVolume', async () => {
      await this.mustGet(id);
      const current = await this.attachments(id);
      const same = current.find((a) => a.node === att.node);
      if (same) {
        if (same.readonly !== att.readonly || same.accessType !== att.accessType || same.mode !== att.mode) {
          throw mismatch(
            `Volume ${id} is already published to node ${att.node} with ${describeAttachment(same)}, not ${describeAttachment(att)}.`,
          );
        }
        await this.nodes.addAttached(att.node, id);
        return 'exists';
      }
      const shareable = (a: Attachment): boolean => isMultiNode(a.mode) && a.readonly;
      const blocking = current.find((other) => !(shareable(other) && shareable(att)));
      if (blocking) {
        throw conflict(
          `Volume ${id} is published to node ${blocking.node}; a single-node volume cannot be published to ${att.node} too.`,
        );
      }
      await this.pool.withLock(`node-${att.node}`, 'ControllerPublishVolume', async () => {
        const count = await this.countAttached(att.node, id);
        if (count >= maxVolumes) {
          throw noSpace(
            `Node ${att.node} already has ${count} volumes published, its limit of ${maxVolumes}; unpublish one first.`,
          );
        }
        await this.nodes.addAttached(att.node, id);
        failpoint('publish:indexed');
      });
      await fs.mkdir(this.layout.attachmentsDir(id), { recursive: true });
      await writeFileAtomic(this.layout.attachment(id, att.node), json(att));
      return 'created';
    });
  }

  /** Volumes published to `node` other than `except`, dropping index entries whose volume no longer has the attachment. */
  private async countAttached(node: string, except: string): Promise<number> {
    let count = 0;
    for (const vid of await this.nodes.attachedVolumes(node)) {
      if (vid === except) continue;
      if (await exists(this.layout.attachment(vid, node))) count++;
      else await this.nodes.removeAttached(node, vid);
    }
    return count;
  }

  /**
   * Removes the publication to `node` (all nodes when undefined), and that node's lease with it: once
   * the CO has detached a node, that node no longer holds the volume. This is how a dead node's hold is
   * released (Kubernetes force-detaches after the node is gone).
   */
  async unpublish(id: string, node: string | undefined): Promise<void> {
    if (!isVolumeId(id)) return;
    await this.pool.withLock(id, 'ControllerUnpublishVolume', async () => {
      const targets = node === undefined ? (await this.attachments(id)).map((a) => a.node) : [node];
      for (const n of targets) {
        if (!isNodeId(n)) continue;
        if (await removeFile(this.layout.lease(id, n))) {
          this.log.warn(
            { volumeId: id, node: n },
            'released the stage lease of a node the volume was unpublished from',
          );
        }
        await removeFile(this.layout.attachment(id, n));
        await this.nodes.removeAttached(n, id);
      }
    });
  }

  async leases(id: string): Promise<Lease[]> {
    const names = (await listDir(this.layout.leasesDir(id))).filter((n) => n.endsWith('.json'));
    const out: Lease[] = [];
    for (const name of names) {
      const node = name.slice(0, -'.json'.length);
      if (!isNodeId(node)) continue;
      const r = await readRecord(this.layout.lease(id, node), parseLease);
      if (r.state === 'ok') out.push(r.value);
      else if (r.state === 'damaged') {
        // Unreadable: the node may still have it staged. Assume it does, as a writer.
        this.log.error(
          { volumeId: id, node, reason: r.reason },
          'a lease record cannot be read; treating it as held by a writer',
        );
        out.push({
          node,
          stagingPath: '',
          accessType: 'mount',
          mode: 'SINGLE_NODE_WRITER',
          readonly: false,
          since: 'unknown (unreadable record)',
        });
      }
    }
    return out;
  }

  /**
   * The node-side fence: takes `lease` for its node unless another node holds the volume (only
   * MULTI_NODE_READER_ONLY readers share). Returns this node's previous lease, if it had one.
   */
  async takeLease(id: string, lease: Lease): Promise<Lease | undefined> {
    return this.pool.withLock(id, 'NodeStageVolume', async () => {
      await this.mustGet(id);
      const all = await this.leases(id);
      const shareable = (l: Lease): boolean => isMultiNode(l.mode) && l.readonly;
      const blocking = all.find((l) => l.node !== lease.node && !(shareable(l) && shareable(lease)));
      if (blocking) {
        throw conflict(
          `Volume ${id} is staged on node ${blocking.node} since ${blocking.since}; it must be unstaged there (or unpublished from that node) before node ${lease.node} can stage it.`,
        );
      }
      const mine = all.find((l) => l.node === lease.node);
      if (mine && mine.stagingPath !== lease.stagingPath) return mine;
      if (
        !mine ||
        mine.accessType !== lease.accessType ||
        mine.mode !== lease.mode ||
        mine.readonly !== lease.readonly ||
        (lease.device !== undefined && mine.device !== lease.device)
      ) {
        await fs.mkdir(this.layout.leasesDir(id), { recursive: true });
        await writeFileAtomic(
          this.layout.lease(id, lease.node),
          json({ ...lease, device: lease.device ?? mine?.device, since: mine?.since ?? lease.since }),
        );
      }
      return mine;
    });
  }

  /** This node's lease on the volume; an unreadable one counts as none (it is this node's to rewrite). */
  async lease(id: string, node: string): Promise<Lease | undefined> {
    if (!isVolumeId(id)) return undefined;
    const r = await readRecord(this.layout.lease(id, node), parseLease);
    return r.state === 'ok' ? r.value : undefined;
  }

  async dropLease(id: string, node: string): Promise<void> {
    if (!isVolumeId(id)) return;
    await this.pool.withLock(id, 'NodeUnstageVolume', async () => {
      await removeFile(this.layout.lease(id, node));
    });
  }

  async isInitialized(id: string): Promise<boolean> {
    return exists(this.layout.volumeInitialized(id));
  }

  /**
   * Records that the volume holds a filesystem or data, so it is never formatted again. False when it
   * was recorded already.
   */
  async markInitialized(id: string, by: string): Promise<boolean> {
    return createExclusive(this.layout.volumeInitialized(id), json({ by, at: new Date().toISOString() }));
  }

  /**
   * Runs `fn` holding the volume's format lock, which every node takes to decide whether to format it
   * and to format it: two nodes staging a fresh volume at once never both run mkfs. mkfs takes time,
   * so the lock is waited for longer than the short-step locks.
   */
  withFormatLock<T>(id: string, waitMs: number, fn: () => Promise<T>): Promise<T> {
    return this.pool.withLock(`${id}.format`, 'format decision', fn, waitMs);
  }

  /** Runs `fn` on the current record under the volume's lock and stores what it returns. */
  async update(
    id: string,
    purpose: string,
    fn: (meta: VolumeMeta) => Promise<VolumeMeta | undefined>,
  ): Promise<VolumeMeta> {
    return this.pool.withLock(id, purpose, async () => {
      const meta = await this.mustGet(id);
      const next = await fn(meta);
      if (!next) return meta;
      const stored = { ...next, updatedAt: new Date().toISOString() };
      await this.writeMeta(stored);
      return stored;
    });
  }
}

function describeAttachment(a: Pick<Attachment, 'readonly' | 'accessType' | 'mode'>): string {
  return `${a.accessType} access, ${a.mode}${a.readonly ? ', read-only' : ''}`;
}
