/**
 * The nodes that serve a pool. A node plugin registers itself when it starts (and again on
 * NodeGetInfo), so ControllerPublishVolume can tell a real node from a typo (NOT_FOUND) and knows each
 * node's attach limit. A per-node index of published volumes keeps counting that limit cheap.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import { isNotFoundErrno } from '../errors.js';
import { listDir, readJson, removeFile, writeFileAtomic } from './fsutil.js';
import { isVolumeId } from './ids.js';
import type { PoolLayout } from './layout.js';
import { type NodeRecord, parseNodeRecord } from './types.js';

/** How often a node plugin rewrites its heartbeat. */
export const HEARTBEAT_MS = 5_000;
/** How long a node's heartbeat must be seen unchanged before it counts as dead (--node-fence-seconds). */
export const FENCE_MS = 60_000;

/** A filesystem a node froze for good because its volume was taken from it while mounted. */
export interface FencedEntry {
  volumeId: string;
  device: string;
  bootId: string;
  at: string;
}

export class NodeRegistry {
  /** What this process saw of other nodes' heartbeats, and since when (its own monotonic clock). */
  private readonly sightings = new Map<string, { fingerprint: string; since: number }>();
  private seq = 0;

  constructor(
    private readonly layout: PoolLayout,
    readonly fenceMs = FENCE_MS,
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

  /** The filesystems `node` froze for good (this boot's; an entry of an earlier boot is gone with it). */
  async fenced(node: string, bootId: string): Promise<FencedEntry[]> {
    const raw = await readJson(this.layout.nodeFenced(node)).catch(() => undefined);
    const list = Array.isArray(raw) ? (raw as FencedEntry[]) : [];
    return list.filter((e) => typeof e.device === 'string' && e.bootId === bootId);
  }

  async setFenced(node: string, entries: readonly FencedEntry[]): Promise<void> {
    await writeFileAtomic(this.layout.nodeFenced(node), `${JSON.stringify(entries, null, 2)}\n`);
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
    await fs.mkdir(this.layout.nodeAttachedDir(node), { recursive: true });
    return record;
  }

  async get(node: string): Promise<NodeRecord | undefined> {
    return parseNodeRecord(await readJson(this.layout.node(node)));
  }

  /** Volumes the index says are published to `node`. */
  async attachedVolumes(node: string): Promise<string[]> {
    return (await listDir(this.layout.nodeAttachedDir(node))).filter(isVolumeId);
  }

  async addAttached(node: string, volumeId: string): Promise<void> {
    await fs.mkdir(this.layout.nodeAttachedDir(node), { recursive: true });
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
