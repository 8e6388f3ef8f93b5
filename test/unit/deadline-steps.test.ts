/**
 * A caller's deadline can stop a node call at any host step: the runner starts no command the deadline
 * leaves no time for (CallStopped, while the deadline itself is still ahead), and a command cut short
 * by it is the deadline's too. Whichever step, and whichever time that step comes in the call, the
 * answer is DEADLINE_EXCEEDED (never a failed step's INTERNAL), and a retry ends exactly where an
 * undisturbed call ends: the mounts with their options, the devices, this node's lease, the volume's
 * initialization, and one format. Injected at every occurrence of every step of stage, publish,
 * unpublish and unstage, for new, formatted, read-only, xfs (grown once mounted) and raw block volumes,
 * and a publish whose bind loses its flags.
 */
import { afterAll, describe, expect, it } from 'vitest';
import { CallStopped } from '../../src/exec/runner.js';
import type { Capability } from '../../src/pool/types.js';
import {
  codeOf,
  newVolume,
  NODE,
  publish,
  removeWorlds,
  SIZE,
  stage,
  unpublish,
  unstage,
  type World,
  world,
} from '../helpers/node-world.js';

afterAll(removeWorlds);

type Step = 'stage' | 'publish' | 'unpublish' | 'unstage';
const before: Record<Step, Step[]> = {
  stage: [],
  publish: ['stage'],
  unpublish: ['stage', 'publish'],
  unstage: ['stage', 'publish', 'unpublish'],
};
const call = (w: World, id: string, s: Step, over: Partial<Capability>) =>
  s === 'stage'
    ? stage(w, id, over)
    : s === 'publish'
      ? publish(w, id, over)
      : s === 'unpublish'
        ? unpublish(w, id)
        : unstage(w, id);

interface Case {
  name: string;
  over: Partial<Capability>;
  setup: (w: World) => Promise<string>;
  dropsFlags?: boolean;
}
const cases: Case[] = [
  {
    name: 'a new filesystem (formatted by its stage)',
    over: {},
    setup: async (w) => (await newVolume(w)).id,
  },
  {
    name: 'a formatted ext4 (checked and grown by its stage)',
    over: {},
    setup: async (w) => {
      const { id, image } = await newVolume(w, { initialized: true });
      w.host.content.set(image, { kind: 'filesystem', type: 'ext4', size: SIZE / 2 });
      return id;
    },
  },
  {
    name: 'a raw block volume',
    over: { accessType: 'block', fsType: '' },
    setup: async (w) => (await newVolume(w)).id,
  },
  {
    name: 'a first stage read-only (formats through a read-write device, then re-attaches)',
    over: { mode: 'MULTI_NODE_READER_ONLY' },
    setup: async (w) => (await newVolume(w)).id,
  },
  {
    name: 'an xfs smaller than its device (grown once mounted)',
    over: { fsType: 'xfs' },
    setup: async (w) => {
      const { id, image } = await newVolume(w, { fsType: 'xfs', initialized: true });
      w.host.content.set(image, { kind: 'filesystem', type: 'xfs', size: SIZE / 2 });
      return id;
    },
  },
  {
    name: 'a publish whose bind loses its flags (remounted)',
    over: { mountFlags: ['nosuid', 'nodev'] },
    setup: async (w) => (await newVolume(w)).id,
    dropsFlags: true,
  },
];

async function snapshot(w: World, id: string) {
  const lease = await w.volumes.lease(id, NODE);
  return {
    mounts: w.host.table.map((m) => `${m.mountPoint} ${m.source} ${m.options.join(',')}`).sort(),
    devices: [...w.host.attached.values()].map((l) => `${l.name} ${l.readOnly ? 'ro' : 'rw'}`).sort(),
    lease: lease ? { ...lease, since: undefined } : undefined,
    initialized: (await w.volumes.initialization(id)) !== undefined,
    formats: w.host.ops.filter((o) => o.startsWith('format') && !o.endsWith('(failed)')).length,
  };
}

const KINDS_NOT_LOGGED = ['superblock'];

describe('a node call stopped by its deadline at every occurrence of every host step', () => {
  for (const c of cases) {
    for (const s of ['stage', 'publish', 'unpublish', 'unstage'] as Step[]) {
      it(`${c.name}: ${s}`, async () => {
        const clean = await world();
        clean.host.bindDropsFlags = c.dropsFlags ?? false;
        const first = await c.setup(clean);
        for (const b of before[s]) expect(await codeOf(call(clean, first, b, c.over))).toBe('OK');
        let seen: string[] = [];
        const kindsSeen = new Map<string, number>();
        // Count every op the call asks for, logged or not (a fault that never fires sees them all).
        clean.host.failWhen((op) => {
          seen.push(op);
          return false;
        }, new Error('never'));
        expect(await codeOf(call(clean, first, s, c.over))).toBe('OK');
        for (const op of seen) {
          const k = op.split(' ')[0] ?? op;
          if (clean.host.ops.includes(op) || KINDS_NOT_LOGGED.includes(k))
            kindsSeen.set(k, (kindsSeen.get(k) ?? 0) + 1);
        }
        const end = await snapshot(clean, first);
        seen = [];
        const results: unknown[] = [];
        const wanted: unknown[] = [];
        for (const [kind, count] of kindsSeen) {
          for (let nth = 1; nth <= count; nth++) {
            const w = await world();
            w.host.bindDropsFlags = c.dropsFlags ?? false;
            const id = await c.setup(w);
            for (const b of before[s]) await call(w, id, b, c.over);
            let n = 0;
            w.host.failWhen(
              (op) => (op.split(' ')[0] ?? op) === kind && ++n === nth,
              new CallStopped('deadline'),
            );
            const stopped = await codeOf(call(w, id, s, c.over));
            const retry = await codeOf(call(w, id, s, c.over));
            results.push({
              at: `${kind} #${nth}`,
              reached: n >= nth,
              stopped,
              retry,
              end: await snapshot(w, id),
            });
            wanted.push({
              at: `${kind} #${nth}`,
              reached: true,
              stopped: 'DEADLINE_EXCEEDED',
              retry: 'OK',
              end,
            });
          }
        }
        expect(kindsSeen.size).toBeGreaterThan(0);
        expect(results).toEqual(wanted);
      });
    }
  }
});
