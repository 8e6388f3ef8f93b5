/**
 * The fences that keep a volume on one node at a time: attachments (ControllerPublishVolume records,
 * the controller's fence) and leases (NodeStageVolume holds, the node's fence), each a file per node
 * in the volume's directory, changed only under the volume's pool lock. A record that cannot be read
 * counts as held, by a writer: an unreadable fence never lets a volume go.
 */
import fs from 'node:fs/promises';
import type { Logger } from 'pino';
import { failpoint } from '../failpoints.js';
import { conflict, mismatch, noSpace } from '../errors.js';
import { exists, listDir, readRecord, removeFile, writeFileAtomic } from './fsutil.js';
import { isNodeId, isVolumeId } from './ids.js';
import type { NodeRegistry } from './nodes.js';
import type { Pool } from './pool.js';
import {
  type Attachment,
  isMultiNode,
  type Lease,
  parseAttachment,
  parseLease,
  type VolumeMeta,
} from './types.js';

const json = (v: unknown): string => `${JSON.stringify(v, null, 2)}\n`;

export abstract class VolumeFences {
  constructor(
    protected readonly pool: Pool,
    protected readonly nodes: NodeRegistry,
    protected readonly log: Logger,
  ) {}

  protected get layout() {
    return this.pool.layout;
  }

  /** A volume that exists and is complete, or NOT_FOUND. */
  abstract mustGet(id: string): Promise<VolumeMeta>;

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
}

function describeAttachment(a: Pick<Attachment, 'readonly' | 'accessType' | 'mode'>): string {
  return `${a.accessType} access, ${a.mode}${a.readonly ? ', read-only' : ''}`;
}
