/**
 * Two node plugins of one node on one host, at different endpoints in one plugin directory (a second
 * DaemonSet, or a rollout that renamed the socket), each in its own PID namespace as containers are.
 * Both serving, each took the other's devices for its own leftovers and its locks for a dead
 * predecessor's: two loop devices of one image mounted at once, a filesystem checked while the other
 * mounted it (a hostile tester's find). The second now does not start while the first serves, and
 * starts once the first has stopped.
 */
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { runMain } from '../helpers/driver.js';
import { TestEnv } from '../helpers/env.js';
import { SLOW } from '../helpers/host.js';

const env = new TestEnv();
afterAll(async () => {
  expect(await env.teardown()).toEqual([]);
});

describe('two node plugins of one node at different endpoints of one directory', () => {
  it('the second does not start while the first serves, and starts once it has stopped', async () => {
    const base = await env.dir('twins');
    const first = await env.driver({ dir: base, socket: path.join(base, 'first.sock') });
    const twinArgs = [
      `--endpoint=unix://${path.join(base, 'twin.sock')}`,
      `--pool-dir=${first.poolDir}`,
      '--mode=node',
      '--nodeid=node-1',
    ];
    // Bounded: one that started serving (as before this was fixed) would never exit by itself.
    const bound = ['timeout', '-s', 'KILL', String(20 * SLOW)];
    const twin = await runMain(twinArgs, [...bound, 'unshare', '--pid', '--fork', '--kill-child']);
    expect({ code: twin.code, said: twin.stderr.trim() }).toEqual({
      code: 1,
      said: expect.stringMatching(
        /another plugin of node node-1 is serving .*first\.sock on this host; two would stage the same volumes side by side/,
      ) as unknown,
    });
    // A rollout that renamed the socket: the new one starts once the old one is gone.
    await first.stop();
    const next = await env.driver({
      dir: base,
      socket: path.join(base, 'twin.sock'),
      mode: 'node',
      wrap: ['unshare', '--pid', '--fork', '--kill-child'],
    });
    expect((await next.clients.identity.Probe({})).ready?.value).toBe(true);
  });
});
