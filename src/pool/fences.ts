/**
 * The fences that keep a volume on one node at a time: attachments (ControllerPublishVolume records,
 * the controller's fence) and leases (NodeStageVolume holds, the node's fence), all in one file per
 * volume (fences.json), changed only under the volume's pool lock, with a per-node copy of each for
 * releases that read only those. A record that cannot be read counts as held, by a writer.
 */
import fs from 'node:fs/promises';
import type { Logger } from 'pino';
import { conflict, mismatch, unsafe } from '../errors.js';
import { NodeAdmission } from './node-admission.js';
import { exists, listDir, readRecord, removeFile, sideBySide, writeFilesAtomic } from './fsutil.js';
import {
  describeAttachment,
  type FenceFile,
  type FenceRead,
  letGo,
  parseFenceFile,
  shareable,
  sharingRefused,
  unreadableAttachment,
  unreadableLease,
  without,
} from './fence-file.js';
import { isNodeId, isVolumeId } from './ids.js';
import type { NodeRegistry } from './nodes.js';
import type { HeldLock } from './lock.js';
import type { Pool } from './pool.js';
import {
  type Attachment,
  keptDevice,
  type Lease,
  parseAttachment,
  parseLease,
  sameDevice,
  type VolumeMeta,
} from './types.js';

const json = (v: unknown): string => `${JSON.stringify(v, null, 2)}\n`;
type NewFile = Parameters<typeof writeFilesAtomic>[0][number];

export abstract class VolumeFences {
  /** This process's publishes to a node, admitted in batches against the node's limit (node-admission.ts). */
  private readonly admission: NodeAdmission;

  constructor(
    protected readonly pool: Pool,
    protected readonly nodes: NodeRegistry,
    protected readonly log: Logger,
  ) {
    this.admission = new NodeAdmission(pool, nodes, (id) => this.attachments(id));
  }

  protected get layout() {
    return this.pool.layout;
  }

  /** Adds the node index entries an older release lost (see NodeAdmission.repairIndex); how many. */
  repairNodeIndex(): Promise<{ added: number; unreadable: string[] }> {
    return this.admission.repairIndex();
  }

  /** Whether volume `id` is gone; UNAVAILABLE when the pool is not there (unmounted, or replaced). */
  private async isGone(id: string): Promise<boolean> {
    if (await exists(this.layout.volumeDir(id))) return false;
    await this.pool.assertPresent();
    return true;
  }

  /** Throws UNAVAILABLE unless this pool is still there (mounted, and the same pool). */
  assertPoolPresent(): Promise<void> {
    return this.pool.assertPresent();
  }

  /** A volume that exists and is complete, or NOT_FOUND. */
  abstract mustGet(id: string): Promise<VolumeMeta>;

  /** The volume's fence file, as it is on disk. */
  private async readFenceFile(id: string): Promise<FenceRead> {
    return readRecord(this.layout.volumeFences(id), parseFenceFile);
  }

  /** The fence file to change under its lock; a damaged one (maybe a node's only hold) is never overwritten. */
  private async fenceFileForUpdate(id: string, read?: FenceRead): Promise<FenceFile> {
    const r = read ?? (await this.readFenceFile(id));
    if (r.state === 'damaged') {
      throw unsafe(
        `The fence record ${this.layout.volumeFences(id)} of volume ${id} cannot be read (${r.reason}); nothing was changed, an operator must repair it.`,
      );
    }
    return r.state === 'ok' ? r.value : { attachments: {}, leases: {}, revoked: {}, detached: {} };
  }

  /** The fence file after the per-node `copies` (side by side, appearing in order), while `lock` is held. */
  private async writeFenceFile(id: string, lock: HeldLock, f: FenceFile, copies: NewFile[] = []) {
    lock.assertHeld(); // lost: another process may have changed the file since it was read
    // And before each rename: a pool hung while the temp files were synced may have let another take it.
    await writeFilesAtomic([...copies, { file: this.layout.volumeFences(id), data: json(f) }], true, () => {
      lock.assertHeld();
    });
  }

  /**
   * Records of one kind: the fence file's, and any per-node file of a node it does not list (written
   * by a release before the fence file, or as a copy for one). Anything unreadable counts as held.
   */
  private async fenceRecords<T extends { node: string }>(
    id: string,
    kind: 'attachments' | 'leases',
    dir: string,
    file: (node: string) => string,
    parse: (v: unknown) => T | undefined,
    unreadable: (node: string) => T,
    read?: FenceRead,
  ): Promise<T[]> {
    const out = new Map<string, T>();
    const [f, names] = await sideBySide(read ? Promise.resolve(read) : this.readFenceFile(id), listDir(dir));
    if (f.state === 'damaged') {
      this.log.error(
        { volumeId: id, reason: f.reason },
        'the fence record cannot be read; treating the volume as held',
      );
      out.set('?', unreadable('unknown (fences.json unreadable)'));
    } else if (f.state === 'ok') {
      // A revoked lease still fences the volume until it is released (see released()).
      const revoked = kind === 'leases' ? Object.entries(f.value.revoked) : [];
      for (const [node, v] of [...revoked, ...Object.entries(f.value[kind])])
        out.set(node, v as unknown as T);
    }
    for (const name of names.filter((n) => n.endsWith('.json'))) {
      const node = name.slice(0, -'.json'.length);
      if (!isNodeId(node) || out.has(node)) continue;
      const r = await readRecord(file(node), parse);
      if (r.state === 'ok') out.set(node, r.value);
      else if (r.state === 'damaged') {
        this.log.error(
          { volumeId: id, node, reason: r.reason },
          `a ${kind} record cannot be read; treating it as a writer's`,
        );
        out.set(node, unreadable(node));
      }
    }
    // Code-unit order (node ids are ASCII); localeCompare would map the ICU data into memory.
    return [...out.values()].sort((a, b) => (a.node < b.node ? -1 : a.node > b.node ? 1 : 0));
  }

  async attachments(id: string, read?: FenceRead): Promise<Attachment[]> {
    return this.fenceRecords(
      id,
      'attachments',
      this.layout.attachmentsDir(id),
      (node) => this.layout.attachment(id, node),
      parseAttachment,
      unreadableAttachment,
      read,
    );
  }

  /**
   * Records that `att.node` may use the volume (ControllerPublishVolume). Same node and arguments again:
   * 'exists'. A single-node volume published elsewhere: FAILED_PRECONDITION naming the node. The node's
   * attach limit: RESOURCE_EXHAUSTED.
   */
  async publish(id: string, att: Attachment, maxVolumes: number): Promise<'created' | 'exists'> {
    await this.admission.whenRepaired();
    return this.pool.withLock(id, 'ControllerPublishVolume', async (lock) => {
      const [, file] = await sideBySide(this.mustGet(id), this.readFenceFile(id));
      const current = await this.attachments(id, file);
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
      const blocking = current.find((other) => !(shareable(other) && shareable(att)));
      if (blocking) throw conflict(sharingRefused(id, blocking, att));
      await this.admission.admit(att.node, {
        id,
        maxVolumes,
        // Runs under the node's lock, after the volume is in the node's index: the next count must see
        // it (an index entry whose volume has no attachment is dropped when the node is at its limit).
        commit: async () => {
          const f = await this.fenceFileForUpdate(id, file);
          // The per-node copy first (what an older release reads), then the fence file (what this one trusts).
          await fs.mkdir(this.layout.attachmentsDir(id), { recursive: true });
          const attachments = { ...f.attachments, [att.node]: att };
          const detached = without(f.detached, new Set([att.node]));
          const copy = { file: this.layout.attachment(id, att.node), data: json(att) };
          await this.writeFenceFile(id, lock, { ...f, attachments, detached }, [copy]);
        },
      });
      return 'created';
    });
  }

  /**
   * Removes the publication to `node` (all nodes when undefined), and that node's lease with it: once
   * the CO has detached a node, that node no longer holds the volume. This is how a dead node's hold is
   * released (Kubernetes force-detaches after the node is gone).
   */
  async unpublish(id: string, node: string | undefined): Promise<void> {
    if (!isVolumeId(id)) return;
    await this.pool.withLock(id, 'ControllerUnpublishVolume', async (lock) => {
      if (await this.isGone(id)) return;
      const file = await this.readFenceFile(id);
      const targets = node === undefined ? (await this.attachments(id, file)).map((a) => a.node) : [node];
      const f = await this.fenceFileForUpdate(id, file);
      const gone = new Set(targets);
      // A node detached while it still has the volume staged (a force-detach: Kubernetes does it when a
      // node is unreachable) may still write to it. Its lease is revoked, not removed: other nodes stay
      // out until that node confirms it stopped (it freezes the filesystem) or is seen dead.
      const revoked = { ...f.revoked };
      const detached = { ...f.detached };
      for (const n of targets) {
        if (!isNodeId(n)) continue;
        const lease = f.leases[n] ?? (await this.legacyLease(id, n));
        // Not staged there (yet): a stage of that node still under way must not take a lease after this.
        if (!lease && !(n in revoked)) detached[n] = new Date().toISOString();
        if (lease) {
          revoked[n] = { ...lease, revokedAt: new Date().toISOString() };
          this.log.warn(
            { volumeId: id, node: n },
            'revoked the stage lease of a node the volume was detached from; other nodes wait until it has fenced itself or is seen dead',
          );
        }
      }
      // The fence file first (what this release trusts), then the per-node copies.
      await this.writeFenceFile(id, lock, {
        attachments: without(f.attachments, gone),
        leases: without(f.leases, gone),
        revoked,
        detached,
      });
      for (const n of targets) {
        if (!isNodeId(n)) continue;
        // The node learns of it from its list of revocations (one file it reads every few seconds).
        // Added again on a retry (a crash here must not leave a revocation its node never hears of).
        if (revoked[n] && revoked[n].fencedAt === undefined)
          await this.nodes.changeRevocation(this.pool, n, id, true);
        await removeFile(this.layout.lease(id, n));
        await removeFile(this.layout.attachment(id, n));
        await this.nodes.removeAttached(n, id);
      }
    });
  }

  async leases(id: string, read?: FenceRead): Promise<Lease[]> {
    return this.fenceRecords(
      id,
      'leases',
      this.layout.leasesDir(id),
      (node) => this.layout.lease(id, node),
      parseLease,
      unreadableLease,
      read,
    );
  }

  /**
   * The node-side fence: takes `lease` for its node unless another node holds the volume (only
   * MULTI_NODE_READER_ONLY readers share). Returns this node's previous lease, if it had one; one for
   * another staging path stays unless `replaceStaging`.
   */
  async takeLease(
    id: string,
    lease: Lease,
    opts: { replaceStaging?: boolean } = {},
  ): Promise<Lease | undefined> {
    return this.pool.withLock(id, 'NodeStageVolume', async (lock) => {
      const [, file] = await sideBySide(this.mustGet(id), this.readFenceFile(id));
      const all = await this.leases(id, file);
      const attachedHere = async (): Promise<boolean> =>
        (await this.attachments(id, file)).some((a) => a.node === lease.node);
      const silent: string[] = [];
      for (const l of all) {
        if (l.node === lease.node) {
          if (l.revokedAt !== undefined && !(await attachedHere())) {
            // A stage that raced the detach must not undo it: the CO publishes to this node again first.
            throw conflict(
              `Volume ${id} was detached from node ${lease.node} at ${l.revokedAt}; publish it to this node again first.`,
            );
          }
          continue;
        }
        if (l.revokedAt !== undefined) {
          if (l.readonly || l.fencedAt !== undefined) continue;
          if (await this.nodes.seenDead(l.node)) {
            silent.push(l.node);
            continue;
          }
          throw conflict(
            `Volume ${id} was detached from node ${l.node} at ${l.revokedAt} while still staged there; node ${lease.node} can stage it once ${l.node} has confirmed that it stopped using it (its plugin freezes the filesystem; a node that died confirms when it is back)${this.nodes.fenceMs > 0 ? `, or has been silent for ${Math.round(this.nodes.fenceMs / 1000)} s` : ''}.`,
          );
        }
        if (!(shareable(l) && shareable(lease))) {
          throw conflict(
            `Volume ${id} is staged on node ${l.node} since ${l.since}; it must be unstaged there (or unpublished from that node) before node ${lease.node} can stage it.`,
          );
        }
      }
      const mine = all.find((l) => l.node === lease.node && l.revokedAt === undefined);
      // A first lease must not outrun a detach of its node (later detaches revoke); after others' holds.
      const detachedAt = !mine && file.state === 'ok' ? file.value.detached[lease.node] : undefined;
      if (detachedAt !== undefined && !(await attachedHere())) {
        throw conflict(
          `Volume ${id} was detached from node ${lease.node} at ${detachedAt}; publish it to this node again first.`,
        );
      }
      const moved = mine !== undefined && mine.stagingPath !== lease.stagingPath;
      if (moved && opts.replaceStaging !== true) return mine;
      const rewrite =
        !mine ||
        moved ||
        mine.accessType !== lease.accessType ||
        mine.mode !== lease.mode ||
        mine.readonly !== lease.readonly ||
        (lease.device !== undefined && !sameDevice(mine, lease)) ||
        (lease.bootId !== undefined && mine.bootId !== lease.bootId) ||
        (lease.mountFlags !== undefined && mine.mountFlags?.join('\0') !== lease.mountFlags.join('\0'));
      if (rewrite || silent.length > 0) {
        const f = await this.fenceFileForUpdate(id, file);
        // A node let go for its silence stays let go, whatever its heartbeat does later.
        const seconds = Math.round(this.nodes.fenceMs / 1000);
        let revoked = letGo(f.revoked, silent, `seen silent for ${seconds} s by node ${lease.node}`);
        let leases = f.leases;
        const copies: NewFile[] = [];
        if (rewrite) {
          const record: Lease = {
            ...lease,
            ...keptDevice(lease, mine),
            since: mine && !moved ? mine.since : lease.since,
          };
          // The per-node copy first (what an older release reads), then the fence file (what this one trusts).
          await fs.mkdir(this.layout.leasesDir(id), { recursive: true });
          copies.push({ file: this.layout.lease(id, lease.node), data: json(record) });
          leases = { ...f.leases, [lease.node]: record };
          // This node's own revoked lease is replaced by the new one. Other nodes' stay (released ones
          // stop nobody) until those nodes unstage: they say which devices on their host are theirs.
          revoked = without(revoked, new Set([lease.node]));
        }
        await this.writeFenceFile(id, lock, { ...f, leases, revoked }, copies);
      }
      return mine;
    });
  }

  /** This node's lease on the volume; an unreadable one counts as none (it is this node's to rewrite). */
  async lease(id: string, node: string): Promise<Lease | undefined> {
    if (!isVolumeId(id)) return undefined;
    const f = await this.readFenceFile(id);
    if (f.state === 'ok' && node in f.value.revoked) return undefined; // taken away from this node
    const inFile = f.state === 'ok' ? f.value.leases[node] : undefined;
    return inFile ?? this.legacyLease(id, node);
  }

  /** A per-node lease file (written by a release before fences.json). */
  private async legacyLease(id: string, node: string): Promise<Lease | undefined> {
    const r = await readRecord(this.layout.lease(id, node), parseLease);
    return r.state === 'ok' ? r.value : undefined;
  }

  /** Whether a revoked lease no longer stops others: its node fenced itself, or is seen dead. */
  async released(l: Lease): Promise<boolean> {
    return l.readonly || l.fencedAt !== undefined || (await this.nodes.seenDead(l.node));
  }

  /** Records that `node` stopped writing a volume taken from it (its revoked lease is released), `how`. */
  async markFenced(id: string, node: string, how: string): Promise<void> {
    if (!isVolumeId(id)) return;
    await this.pool.withLock(id, 'fence', async (lock) => {
      if (await this.isGone(id)) return;
      const f = await this.fenceFileForUpdate(id);
      const l = f.revoked[node];
      if (!l || l.fencedAt !== undefined) return;
      await this.writeFenceFile(id, lock, { ...f, revoked: letGo(f.revoked, [node], how) });
    });
  }

  async dropLease(id: string, node: string): Promise<void> {
    if (!isVolumeId(id)) return;
    await this.pool.withLock(id, 'NodeUnstageVolume', async (lock) => {
      if (await this.isGone(id)) return;
      const f = await this.fenceFileForUpdate(id);
      if (node in f.leases || node in f.revoked) {
        const gone = new Set([node]);
        await this.writeFenceFile(id, lock, {
          ...f,
          leases: without(f.leases, gone),
          revoked: without(f.revoked, gone),
        });
      }
      await removeFile(this.layout.lease(id, node));
    });
  }
}
