/**
 * The node attach limit (ControllerPublishVolume's RESOURCE_EXHAUSTED), kept exact across processes
 * and fast for a burst. This process's publishes to a node are admitted in batches (turns.ts): each
 * batch in order under one taking of the node's pool lock, its records then written side by side
 * before the lock is let go, so the next count sees them.
 *
 * The node's index (nodes/<node>.attached/) holds every attachment: an entry is added before its
 * attachment is written, and removed after it is gone. So fewer entries than the limit is the answer at
 * once. Only at the limit is each entry checked against its volume's attachments (reading every
 * volume's records), dropping those left by a publish killed half-way or by an old release. Releases
 * before this scheme could lose entries of live attachments (their count raced the attachment's
 * write): a controller adds back what is missing when it starts (`repairIndex`), and admits nothing
 * before that is done.
 */
import { failpoint } from '../failpoints.js';
import { listDir } from './fsutil.js';
import { isNodeId, isVolumeId } from './ids.js';
import { busy, noSpace } from '../errors.js';
import { mapLimit, orAfter } from '../limit.js';
import type { NodeRegistry } from './nodes.js';
import type { Pool } from './pool.js';
import { Turns } from './turns.js';
import type { Attachment } from './types.js';

/** A publish waiting for its node: admitted against the node's limit, then `commit` writes its records. */
/** How long a publish waits for the controller's start-up check of the node index. */
const REPAIR_WAIT_MS = 10_000;

export interface NodePublish {
  id: string;
  maxVolumes: number;
  /** Runs under the node's lock, once the volume is in the node's index. */
  commit: () => Promise<void>;
}

export class NodeAdmission {
  /** A publish waits up to 10 s for its batch (a burst of pods scheduled at once). */
  private readonly turns = new Turns<NodePublish, void>(10_000, (node, batch) =>
    this.admitBatch(node, batch),
  );

  constructor(
    private readonly pool: Pool,
    private readonly nodes: NodeRegistry,
    private readonly attachments: (id: string) => Promise<Attachment[]>,
  ) {}

  /** Until the index is known whole (see repairIndex), admissions wait for it. */
  private repaired: Promise<void> = Promise.resolve();

  /** Admits `p` to `node` and writes its records; RESOURCE_EXHAUSTED at the node's limit. */
  admit(node: string, p: NodePublish): Promise<void> {
    return this.turns.run(node, `Node ${node}`, p);
  }

  /**
   * Resolves once the node index is known whole (see repairIndex); ABORTED after `waitMs`. A publish
   * waits here before it takes its volume's lock, which other processes' calls need meanwhile.
   */
  async whenRepaired(waitMs = REPAIR_WAIT_MS): Promise<void> {
    const done = await orAfter(
      this.repaired.then(() => true),
      waitMs,
      () => false,
    );
    if (!done) throw busy('The controller is still checking the node index against the attachments; retry.');
  }

  /**
   * Adds to each node's index the volumes attached to it that it lacks (left by an older release), and
   * makes admissions wait until that is done. An entry added for an attachment removed meanwhile is
   * harmless: it is dropped when its node reaches its limit. A volume whose records cannot be read is
   * skipped (reported in `unreadable`), the others are still checked. Volumes are read 16 at a time.
   */
  repairIndex(): Promise<{ added: number; unreadable: string[] }> {
    const work = (async () => {
      let added = 0;
      const unreadable: string[] = [];
      const indexes = new Map<string, Promise<Set<string>>>();
      const indexOf = (node: string): Promise<Set<string>> => {
        let index = indexes.get(node);
        if (!index) {
          index = this.nodes.attachedVolumes(node).then((vids) => new Set(vids));
          indexes.set(node, index);
        }
        return index;
      };
      const ids = (await listDir(this.pool.layout.volumesDir)).filter(isVolumeId);
      await mapLimit(ids, 16, async (id) => {
        try {
          for (const { node } of await this.attachments(id)) {
            if (!isNodeId(node)) continue;
            const index = await indexOf(node);
            if (index.has(id)) continue;
            index.add(id);
            await this.nodes.addAttached(node, id);
            added++;
          }
        } catch {
          unreadable.push(id);
        }
      });
      return { added, unreadable };
    })();
    this.repaired = work.then(
      () => undefined,
      () => undefined, // a repair that could not list the volumes (logged by the caller) stops no publish
    );
    return work;
  }

  private async admitBatch(
    node: string,
    batch: readonly NodePublish[],
  ): Promise<PromiseSettledResult<void>[]> {
    return this.pool.withLock(`node-${node}`, 'ControllerPublishVolume', async () => {
      const results = new Array<PromiseSettledResult<void>>(batch.length);
      // Those refused are judged again when one admitted before them failed: the slot it took is free
      // (its index entry, if written, has no attachment and is dropped at the limit).
      let pending = batch.map((_, i) => i);
      for (let round = 0; pending.length > 0; round++) {
        let refused: (Error | undefined)[];
        try {
          refused = await this.decide(
            node,
            pending.map((i) => batch[i] as NodePublish),
          );
        } catch (err) {
          if (round === 0) throw err;
          // A later round that cannot count fails only those still waiting, not those already done.
          for (const i of pending) results[i] = { status: 'rejected', reason: err };
          break;
        }
        const admitted = pending.filter((_, k) => refused[k] === undefined);
        const settled = await Promise.allSettled(
          admitted.map(async (i) => {
            const p = batch[i] as NodePublish;
            await this.nodes.addAttached(node, p.id);
            failpoint('publish:indexed');
            await p.commit();
          }),
        );
        for (const [k, i] of admitted.entries()) results[i] = settled[k] as PromiseSettledResult<void>;
        const refusedNow = pending.filter((_, k) => refused[k] !== undefined);
        for (const [k, i] of pending.entries()) {
          const err = refused[k];
          if (err) results[i] = { status: 'rejected', reason: err };
        }
        pending = settled.some((r) => r.status === 'rejected') ? refusedNow : [];
      }
      return results;
    });
  }

  /** Admits `batch` in order against the node's index; each refusal (RESOURCE_EXHAUSTED) at its place. */
  private async decide(node: string, batch: readonly NodePublish[]): Promise<(Error | undefined)[]> {
    const index = new Set(await this.nodes.attachedVolumes(node));
    const admitted = new Set<string>();
    let checked = false;
    const refusals: (Error | undefined)[] = [];
    for (const p of batch) {
      const others = (): number => index.size - (index.has(p.id) ? 1 : 0);
      if (others() >= p.maxVolumes && !checked) {
        checked = true;
        await this.dropStaleEntries(node, index, admitted);
      }
      const count = others();
      if (count >= p.maxVolumes) {
        refusals.push(
          noSpace(
            `Node ${node} already has ${count} volumes published, its limit of ${p.maxVolumes}; unpublish one first.`,
          ),
        );
      } else {
        refusals.push(undefined);
        index.add(p.id);
        admitted.add(p.id);
      }
    }
    return refusals;
  }

  /** Drops from `index` (and from the node's index on disk) the volumes, other than `keep`, with no attachment to `node`. */
  private async dropStaleEntries(node: string, index: Set<string>, keep: ReadonlySet<string>): Promise<void> {
    const vids = [...index].filter((vid) => !keep.has(vid));
    // Read side by side, not one after another: this runs under the node's lock.
    const held = await Promise.all(
      vids.map(async (vid) => (await this.attachments(vid)).some((a) => a.node === node)),
    );
    for (const [i, vid] of vids.entries()) {
      if (held[i]) continue;
      index.delete(vid);
      await this.nodes.removeAttached(node, vid);
    }
  }
}
