/**
 * Turns: calls on one key handled in batches, one batch at a time, each in arrival order; what arrives
 * while a batch runs is the next batch. One item failing fails only that item.
 */
import { describe, expect, it } from 'vitest';
import { Turns } from '../../src/pool/turns.js';
import { codeOf } from '../helpers/node-world.js';

/**
 * Turns whose first batch is held until `release`, whose batch number `throwing` throws, and which
 * otherwise fail the negative items and answer the others with themselves.
 */
function heldFirstBatch(throwing: number) {
  let calls = 0;
  let release!: () => void;
  const gate = new Promise<void>((r) => (release = r));
  const turns = new Turns<number, number>(10_000, async (_key, items) => {
    calls++;
    if (calls === 1) await gate;
    if (calls === throwing) throw new Error('the lock was not had');
    return items.map((n): PromiseSettledResult<number> =>
      n < 0 ? { status: 'rejected', reason: new Error('negative') } : { status: 'fulfilled', value: n },
    );
  });
  return { turns, release };
}

describe('Turns', () => {
  it('runs one batch at a time per key, and what came meanwhile as the next batch, in order', async () => {
    const batches: string[][] = [];
    let inside = 0;
    let most = 0;
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const turns = new Turns<string, string>(10_000, async (_key, items) => {
      inside++;
      most = Math.max(most, inside);
      batches.push([...items]);
      if (batches.length === 1) await gate;
      inside--;
      return items.map((i) => ({ status: 'fulfilled', value: i.toUpperCase() }));
    });
    const first = turns.run('n1', 'n1', 'a');
    const later = ['b', 'c', 'd'].map((i) => turns.run('n1', 'n1', i));
    await new Promise((r) => setTimeout(r, 20));
    release();
    expect({ got: await Promise.all([first, ...later]), batches, most }).toEqual({
      got: ['A', 'B', 'C', 'D'],
      batches: [['a'], ['b', 'c', 'd']],
      most: 1,
    });
  });

  it('fails only the item its batch failed, and the whole batch when the handler throws', async () => {
    const { turns, release } = heldFirstBatch(3);
    const first = turns.run('k', 'k', 0); // a batch of its own, held until the next two queue behind it
    const both = Promise.allSettled([turns.run('k', 'k', 1), turns.run('k', 'k', -1)]);
    release();
    await first;
    const one = await both;
    const two = await Promise.allSettled([turns.run('k', 'k', 2), turns.run('k', 'k', 3)]);
    expect([...one, ...two].map((r) => (r.status === 'fulfilled' ? r.value : String(r.reason)))).toEqual([
      1,
      'Error: negative',
      'Error: the lock was not had', // 2 began a batch at once, alone (nothing was running)
      3, // the next batch is unharmed
    ]);
  });

  it('fails every item of a batch of several when the handler throws', async () => {
    const { turns, release } = heldFirstBatch(2);
    const first = turns.run('k', 'k', 0);
    const batch = Promise.allSettled([1, 2, 3].map((n) => turns.run('k', 'k', n)));
    release();
    await first;
    expect((await batch).map((r) => (r.status === 'fulfilled' ? r.value : String(r.reason)))).toEqual([
      'Error: the lock was not had',
      'Error: the lock was not had',
      'Error: the lock was not had',
    ]);
  });

  it('answers ABORTED to an item whose batch has not begun within its wait', async () => {
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const turns = new Turns<number, number>(50, async (_key, items) => {
      await gate;
      return items.map((n) => ({ status: 'fulfilled', value: n }));
    });
    const first = turns.run('k', 'Node k', 1);
    const second = turns.run('k', 'Node k', 2);
    const code = await codeOf(second);
    release();
    expect({ first: await first, code }).toEqual({ first: 1, code: 'ABORTED' });
  });
});
