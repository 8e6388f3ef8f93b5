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

export class NodeRegistry {
  constructor(private readonly layout: PoolLayout) {}

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
