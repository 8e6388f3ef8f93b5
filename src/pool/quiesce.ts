/**
 * Freeze requests through the pool: how a controller (on any host) asks the node plugin that has a
 * volume staged to freeze its filesystem for the instant of a copy, and how the node answers.
 *
 * Two small files per node, both always present once the node registered, because a file that exists
 * is re-read fresh at every open on NFS (close-to-open), while a new name can hide behind a client's
 * cache of "no such file" for half a minute:
 *
 *   nodes/<node>.quiesce        requests, written by controllers under the pool lock quiesce-<node>:
 *                               {"requests": {"<volume id>": {requestId, ttlMs, by, purpose}}}
 *   nodes/<node>.frozen         answers, written by the node alone:
 *                               {"answers": {"<request id>": {volumeId, state, message}}}
 *
 * The node freezes, answers "frozen", and thaws when the request is withdrawn, or when `ttlMs` has
 * passed on its own clock since it froze (then it answers "expired" first), so a controller that dies
 * never leaves a pod frozen. A controller that sees "expired" after its copy knows the copy was not
 * made under the freeze and discards it.
 */
import { randomBytes } from 'node:crypto';
import { busy } from '../errors.js';
import { isRecord, readJson, writeFileAtomic } from './fsutil.js';
import { isVolumeId } from './ids.js';
import type { Pool } from './pool.js';

export interface QuiesceRequest {
  volumeId: string;
  requestId: string;
  /** How long the node may keep the filesystem frozen, by its own clock, before it thaws on its own. */
  ttlMs: number;
  by: string;
  purpose: string;
}

export type AnswerState =
  /** Frozen, and stays so until withdrawn or expired. */
  | 'frozen'
  /** Not staged writable on this node (or no longer): nothing here writes it. */
  | 'not-staged'
  /** Staged as a raw block device: there is no filesystem to freeze. */
  | 'not-freezable'
  /** The freeze failed; `message` says why. */
  | 'failed'
  /** It was frozen, and the node thawed it when its time was up. */
  | 'expired'
  /** Thawed after the request was withdrawn. */
  | 'thawed';

export interface QuiesceAnswer {
  volumeId: string;
  state: AnswerState;
  message: string;
}

const ANSWER_STATES: readonly string[] = [
  'frozen',
  'not-staged',
  'not-freezable',
  'failed',
  'expired',
  'thawed',
];

function parseRequests(v: unknown): Map<string, QuiesceRequest> {
  const out = new Map<string, QuiesceRequest>();
  const requests = isRecord(v) && isRecord(v.requests) ? v.requests : {};
  for (const [volumeId, r] of Object.entries(requests)) {
    if (!isVolumeId(volumeId) || !isRecord(r)) continue;
    const { requestId, ttlMs, by, purpose } = r;
    if (typeof requestId !== 'string' || typeof ttlMs !== 'number' || !(ttlMs > 0)) continue;
    out.set(volumeId, {
      volumeId,
      requestId,
      ttlMs,
      by: typeof by === 'string' ? by : '',
      purpose: typeof purpose === 'string' ? purpose : '',
    });
  }
  return out;
}

function parseAnswers(v: unknown): Map<string, QuiesceAnswer> {
  const out = new Map<string, QuiesceAnswer>();
  const answers = isRecord(v) && isRecord(v.answers) ? v.answers : {};
  for (const [requestId, a] of Object.entries(answers)) {
    if (!isRecord(a)) continue;
    const { volumeId, state, message } = a;
    if (typeof volumeId !== 'string' || typeof state !== 'string' || !ANSWER_STATES.includes(state)) continue;
    out.set(requestId, {
      volumeId,
      state: state as AnswerState,
      message: typeof message === 'string' ? message : '',
    });
  }
  return out;
}

async function readOrEmpty(file: string): Promise<unknown> {
  try {
    return await readJson(file);
  } catch {
    return undefined; // a torn or foreign file reads as empty; the writer replaces it whole
  }
}

export class QuiesceBoard {
  constructor(private readonly pool: Pool) {}

  private get layout() {
    return this.pool.layout;
  }

  // --- the node's side

  /** Makes sure this node's requests file exists, so that every later read is of a file that exists. */
  async prepare(node: string): Promise<void> {
    await this.pool.withLock(`quiesce-${node}`, 'prepare freeze requests', async () => {
      const current = parseRequests(await readOrEmpty(this.layout.nodeQuiesceRequests(node)));
      await this.writeRequests(node, current);
    });
  }

  /** The requests standing for this node now. */
  async requests(node: string): Promise<Map<string, QuiesceRequest>> {
    return parseRequests(await readOrEmpty(this.layout.nodeQuiesceRequests(node)));
  }

  /** Replaces this node's answers (the node is their only writer). */
  async writeAnswers(node: string, answers: ReadonlyMap<string, QuiesceAnswer>): Promise<void> {
    await writeFileAtomic(
      this.layout.nodeQuiesceAnswers(node),
      `${JSON.stringify({ answers: Object.fromEntries(answers) }, null, 2)}\n`,
    );
  }

  // --- the controller's side

  /** Posts a request to `node` to freeze `volumeId`; the caller holds the volume's lock. */
  async post(
    node: string,
    volumeId: string,
    ttlMs: number,
    by: string,
    purpose: string,
  ): Promise<QuiesceRequest> {
    const request: QuiesceRequest = {
      volumeId,
      requestId: randomBytes(8).toString('hex'),
      ttlMs,
      by,
      purpose,
    };
    await this.pool.withLock(`quiesce-${node}`, 'post a freeze request', async () => {
      const current = await this.requests(node);
      const standing = current.get(volumeId);
      if (standing) {
        // Only one copy of a volume runs at a time (its lock): a request left standing is a dead
        // controller's. Replacing it makes the node thaw that one and freeze for this one.
        this.pool.log.warn(
          { node, volumeId, previous: standing.requestId },
          'replacing a freeze request left standing',
        );
      }
      current.set(volumeId, request);
      await this.writeRequests(node, current);
    });
    return request;
  }

  /** The node's answer to `request`, if it answered yet. */
  async answer(node: string, request: QuiesceRequest): Promise<QuiesceAnswer | undefined> {
    return parseAnswers(await readOrEmpty(this.layout.nodeQuiesceAnswers(node))).get(request.requestId);
  }

  /** The node's answers, all of them (for the node itself, at start). */
  async answers(node: string): Promise<Map<string, QuiesceAnswer>> {
    return parseAnswers(await readOrEmpty(this.layout.nodeQuiesceAnswers(node)));
  }

  /** Withdraws `request` (the node thaws). Best effort: an expiring request thaws anyway. */
  async withdraw(node: string, request: QuiesceRequest): Promise<void> {
    try {
      await this.pool.withLock(
        `quiesce-${node}`,
        'withdraw a freeze request',
        async () => {
          const current = await this.requests(node);
          if (current.get(request.volumeId)?.requestId !== request.requestId) return;
          current.delete(request.volumeId);
          await this.writeRequests(node, current);
        },
        10_000,
      );
    } catch (err) {
      this.pool.log.error(
        { node, request, err },
        'could not withdraw a freeze request; the node thaws when it expires',
      );
      throw busy(
        `Could not withdraw the freeze request on node ${node}; it thaws within ${Math.ceil(request.ttlMs / 1000)} s.`,
        err,
      );
    }
  }

  private async writeRequests(node: string, requests: ReadonlyMap<string, QuiesceRequest>): Promise<void> {
    const out: Record<string, Omit<QuiesceRequest, 'volumeId'>> = {};
    for (const [volumeId, { requestId, ttlMs, by, purpose }] of requests)
      out[volumeId] = { requestId, ttlMs, by, purpose };
    await writeFileAtomic(
      this.layout.nodeQuiesceRequests(node),
      `${JSON.stringify({ requests: out }, null, 2)}\n`,
    );
  }
}
