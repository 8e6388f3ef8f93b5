/**
 * Records that cannot be read never let a volume go: `loopvol check`/`gc` plan nothing against a volume
 * whose fences.json is damaged, nor against any device of a node whose record of fences is damaged,
 * and a damaged list of revocations is reported and never rewritten (its entries would be lost). Against
 * the in-memory kernel and a real pool.
 */
import fs from 'node:fs/promises';
import { afterAll, describe, expect, it } from 'vitest';
import { type CheckOptions, recheckHost, runCheck } from '../../src/audit/check.js';
import { collectGarbage } from '../../src/audit/gc.js';
import { readRecord } from '../../src/pool/fsutil.js';
import { fakeContext, ScriptedRunner } from '../helpers/fake-runner.js';
import {
  codeOf,
  log,
  newVolume,
  NODE,
  publish,
  removeWorlds,
  stage,
  STAGING,
  TARGET,
  type World,
  world,
} from '../helpers/node-world.js';

afterAll(removeWorlds);

const opts: CheckOptions = {
  scope: 'all',
  staleSeconds: 60,
  kubeletDir: '/var/lib/kubelet',
  probeFrozen: false,
  trashAgeSeconds: 3600,
  lockStaleSeconds: 120,
};

/** A volume staged and published on NODE, then force-detached (its lease now lives only in fences.json). */
async function forceDetached(): Promise<{ w: World; id: string }> {
  const w = await world();
  const { id } = await newVolume(w);
  await stage(w, id);
  await publish(w, id);
  await w.d.nodes.heartbeat(NODE);
  await w.volumes.unpublish(id, NODE);
  return { w, id };
}

/** What gc would do and does: the steps it plans, and the commands it runs. */
async function gcOf(w: World) {
  const check = await runCheck(w.pool, log, w.host, w.x, opts);
  const runner = new ScriptedRunner([]);
  const outcomes = await collectGarbage(
    {
      pool: w.pool,
      host: w.host,
      x: fakeContext(runner),
      recheckHost: () => recheckHost(w.pool, log, w.host, w.x, opts),
      trashAgeSeconds: opts.trashAgeSeconds,
      graceMs: 0,
    },
    check.findings,
  );
  return {
    kinds: check.findings.map((f) => f.kind),
    planned: check.findings.filter((f) => f.gc !== undefined).map((f) => `${f.gc?.action} ${f.subject}`),
    removed: outcomes.filter((o) => o.result === 'removed'),
    commands: runner.calls.map((c) => `${c.command} ${c.args.join(' ')}`),
  };
}

const staysMounted = (w: World): void => {
  expect(w.host.table.map((m) => m.mountPoint).sort()).toEqual([STAGING, TARGET].sort());
  expect([...w.host.attached.keys()]).toEqual(['loop0']);
};

describe('a damaged record', () => {
  it("of a volume's fences: gc unmounts and detaches nothing of it", async () => {
    const { w, id } = await forceDetached();
    await fs.writeFile(w.pool.layout.volumeFences(id), '{ "attachments": {}, "leases": { torn');
    const gc = await gcOf(w);
    expect(gc.kinds).toContain('damaged-fences');
    expect(gc).toMatchObject({ planned: [], removed: [], commands: [] });
    staysMounted(w);
  });

  it("of a node's fences: gc unmounts and detaches nothing on its host, and says why", async () => {
    const { w, id } = await forceDetached();
    // The lease is gone too (say, removed by hand): only the unreadable record could tell a fence.
    await w.volumes.dropLease(id, NODE);
    await fs.writeFile(w.pool.layout.nodeFenced(NODE), '[{"volumeId": torn');
    const gc = await gcOf(w);
    expect(gc.kinds).toEqual(
      expect.arrayContaining(['damaged-node-record', 'leaked-mount', 'leaked-loop-device']),
    );
    expect(gc).toMatchObject({ planned: [], removed: [], commands: [] });
    staysMounted(w);
  });

  it("of a node's revocations: reported, never read as empty, never rewritten", async () => {
    const w = await world();
    const a = `vol-${'a'.repeat(32)}`;
    const b = `vol-${'b'.repeat(32)}`;
    await w.d.nodes.changeRevocation(w.pool, NODE, a, true);
    const file = w.pool.layout.nodeRevocations(NODE);
    await fs.writeFile(file, `["${a}"`);
    await expect(w.d.nodes.revocations(NODE)).rejects.toThrow(/cannot be read/);
    await expect(w.d.nodes.changeRevocation(w.pool, NODE, b, true)).rejects.toThrow(/cannot be read/);
    expect(await fs.readFile(file, 'utf8')).toBe(`["${a}"`);
    // A force-detach that cannot record its revocation says so (FAILED_PRECONDITION), as a damaged
    // fences.json does; the revoked lease it wrote first makes its retry record it once repaired.
    const { id } = await newVolume(w);
    await stage(w, id);
    expect(await codeOf(w.volumes.unpublish(id, NODE))).toBe('FAILED_PRECONDITION');
    expect((await w.volumes.leases(id)).find((l) => l.node === NODE)?.revokedAt).toBeDefined();
    const check = await runCheck(w.pool, log, w.host, w.x, { ...opts, scope: 'pool' });
    expect(check.findings).toContainEqual(
      expect.objectContaining({ kind: 'damaged-node-record', subject: file, node: NODE }),
    );
  });
});

describe('a record read torn by a network filesystem client', () => {
  const parse = (v: unknown) => (typeof v === 'object' && v !== null && 'id' in v ? v : undefined);
  it('is read again, and whole once the client sees it whole: never taken for damaged', async () => {
    const w = await world();
    const file = `${w.pool.root}/torn.json`;
    // What a client with the old file's size in its attribute cache reads of a file replaced by rename.
    await fs.writeFile(file, '{"id":"vol-1","st');
    setTimeout(() => void fs.writeFile(file, '{"id":"vol-1","state":"ready"}'), 200);
    expect(await readRecord(file, parse)).toEqual({ state: 'ok', value: { id: 'vol-1', state: 'ready' } });
  });
  it('is damaged when it stays unreadable', async () => {
    const w = await world();
    const file = `${w.pool.root}/damaged.json`;
    await fs.writeFile(file, '{"id":');
    expect(await readRecord(file, parse)).toEqual({
      state: 'damaged',
      reason: 'damaged.json is not valid JSON',
    });
  });
});
