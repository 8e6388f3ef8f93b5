/**
 * The nodes that serve a pool. A node plugin registers itself when it starts (and again on
 * NodeGetInfo), so ControllerPublishVolume can tell a real node from a typo (NOT_FOUND) and knows each
 * node's attach limit. A per-node index of published volumes keeps counting that limit cheap.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import { errnoCode, isNotFoundErrno, unsafe } from '../errors.js';
import { isRecord, listDir, readJson, removeFile, writeFileAtomic } from './fsutil.js';
import { isVolumeId } from './ids.js';
import type { PoolLayout } from './layout.js';
import type { Pool } from './pool.js';
import { type NodeRecord, parseNodeRecord } from './types.js';

/** How often a node plugin rewrites its heartbeat. */
export const HEARTBEAT_MS = 5_000;
/**
 * A filesystem a node froze for good because its volume was taken from it while mounted: the device
 * and the identity of its backing file, so a device that is freed and reused is not taken for it.
 */
export interface FencedEntry {
  volumeId: string;
  device: string;
  backingDev: string;
  backingIno: string;
  bootId: string;
  at: string;
}

export const isFencedEntry = (e: unknown): e is FencedEntry =>
  isRecord(e) &&
  ['volumeId', 'device', 'backingDev', 'backingIno', 'bootId', 'at'].every((k) => typeof e[k] === 'string');

export class NodeRegistry {
  /** What this process saw of other nodes' heartbeats, and since when (its own monotonic clock). */
  private readonly sightings = new Map<string, { fingerprint: string; since: number }>();
  private seq = 0;

  /**
   * `fenceMs`: how long a node's heartbeat must be seen unchanged before a volume taken from it is let
   * go without its confirmation (--node-fence-seconds); 0: never, a node must confirm.
   */
  constructor(
    private readonly layout: PoolLayout,
    readonly fenceMs = 0,
  ) {}

  /** Rewrites this node's heartbeat: a file whose content changes every time. */
  async heartbeat(node: string): Promise<void> {
    this.seq++;
    await writeFileAtomic(
      this.layout.nodeAlive(node),
      `${JSON.stringify({ node, pid: process.pid, seq: this.seq, at: new Date().toISOString() })}\n`,
      false,
    );
  }

  /**
   * True when `node`'s heartbeat has not changed for fenceMs by this process's own clock (or has been
   * missing that long): the node is dead, or cut off from the pool. Clocks of other hosts are never
   * compared with ours; a first look starts the count.
   */
  async seenDead(node: string): Promise<boolean> {
    if (this.fenceMs <= 0) return false;
    let fingerprint: string;
    try {
      fingerprint = (await fs.readFile(this.layout.nodeAlive(node), 'utf8')).trim();
    } catch (err) {
      if (!isNotFoundErrno(err)) throw err;
      fingerprint = 'missing';
    }
    const now = performance.now();
    const seen = this.sightings.get(node);
    if (!seen || seen.fingerprint !== fingerprint) {
      this.sightings.set(node, { fingerprint, since: now });
      return false;
    }
    return now - seen.since >= this.fenceMs;
  }

  /**
   * The filesystems `node` froze for good (boot `bootId`'s, every boot's when undefined; an entry of an
   * earlier boot is gone with it).
   * 'unreadable' when the record cannot be read: then any filesystem may be a fence, and none may be
   * thawed.
   */
  async fenced(node: string, bootId: string | undefined): Promise<FencedEntry[] | 'unreadable'> {
    let raw: unknown;
    try {
      raw = await readJson(this.layout.nodeFenced(node));
    } catch {
      return 'unreadable';
    }
    if (raw === undefined) return [];
    if (!Array.isArray(raw) || !raw.every(isFencedEntry)) return 'unreadable';
    return bootId === undefined ? raw : raw.filter((e) => e.bootId === bootId);
  }

  async setFenced(node: string, entries: readonly FencedEntry[]): Promise<void> {
    await writeFileAtomic(this.layout.nodeFenced(node), `${JSON.stringify(entries, null, 2)}\n`);
  }

  /**
   * Volumes taken from `node` (force-detached while it held them) that it has not yet confirmed: the
   * node's plugin reads this one file every few seconds, fences what it still has, and confirms.
   */
  async revocations(node: string): Promise<string[]> {
    const file = this.layout.nodeRevocations(node);
    const repair = `repair it: a JSON list of the ids of the volumes whose fences.json holds a revoked lease of node ${node}`;
    let raw: unknown;
    try {
      raw = await readJson(file);
    } catch (err) {
      throw unsafe(`The list of revocations ${file} cannot be read; nothing was changed, ${repair}.`, err);
    }
    if (raw === undefined) return [];
    // A damaged list is never read as empty, nor rewritten: the revocations in it would be lost for good.
    if (!Array.isArray(raw) || !raw.every((v) => typeof v === 'string' && isVolumeId(v))) {
      throw unsafe(
        `The list of revocations ${file} is not a list of volume ids; nothing was changed, ${repair}.`,
      );
    }
    return raw as string[];
  }

  /** Adds (or removes) a volume in `node`'s list of revocations, under that list's lock. */
  async changeRevocation(pool: Pool, node: string, volumeId: string, add: boolean): Promise<void> {
    await pool.withLock(
      `revocations-${node}`,
      'revocations',
      async () => {
        const now = new Set(await this.revocations(node));
        if (add === now.has(volumeId)) return;
        if (add) now.add(volumeId);
        else now.delete(volumeId);
        await writeFileAtomic(this.layout.nodeRevocations(node), `${JSON.stringify([...now].sort())}\n`);
      },
      10_000,
    );
  }

  async register(node: string, pool: string, maxVolumes: number): Promise<NodeRecord> {
    const existing = await this.get(node);
    const record: NodeRecord = {
      node,
      pool,
      maxVolumes,
      host: os.hostname(),
      registeredAt: existing?.registeredAt ?? new Date().toISOString(),
    };
    if (
      !existing ||
      existing.pool !== record.pool ||
      existing.maxVolumes !== record.maxVolumes ||
      existing.host !== record.host
    ) {
      await writeFileAtomic(this.layout.node(node), `${JSON.stringify(record, null, 2)}\n`);
    }
    await this.makeAttachedDir(node);
    return record;
  }

  async get(node: string): Promise<NodeRecord | undefined> {
    return parseNodeRecord(await readJson(this.layout.node(node)));
  }

  /** Volumes the index says are published to `node`. */
  async attachedVolumes(node: string): Promise<string[]> {
    return (await listDir(this.layout.nodeAttachedDir(node))).filter(isVolumeId);
  }

  /** Not recursive: a pool has nodes/, an empty mount point where the pool should be has not. */
  private async makeAttachedDir(node: string): Promise<void> {
    await fs.mkdir(this.layout.nodeAttachedDir(node)).catch((err: unknown) => {
      if (errnoCode(err) !== 'EEXIST') throw err;
    });
  }

  async addAttached(node: string, volumeId: string): Promise<void> {
    await this.makeAttachedDir(node);
    const handle = await fs.open(this.layout.nodeAttached(node, volumeId), 'a');
    await handle.close();
  }

  async removeAttached(node: string, volumeId: string): Promise<void> {
    try {
      await removeFile(this.layout.nodeAttached(node, volumeId));
    } catch (err) {
      if (!isNotFoundErrno(err)) throw err;
    }
  }
}
