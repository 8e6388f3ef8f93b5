// A load generator thread for bench/rpc.mjs: keeps `concurrency` calls of one method in flight on its
// own channel until `ops` calls have been answered, for each job it is sent.
import { parentPort, workerData } from 'node:worker_threads';
import { client } from './lib.mjs';

const c = client(workerData.endpoint);
const calls = {
  Probe: () => c.identity.Probe({}),
  NodeGetCapabilities: () => c.node.NodeGetCapabilities({}),
};
parentPort.on('message', async ({ method, concurrency, ops }) => {
  if (method === 'close') {
    c.close();
    parentPort.close();
    return;
  }
  const f = calls[method];
  let next = 0;
  await Promise.all(
    Array.from({ length: concurrency }, async () => {
      while (next++ < ops) await f();
    }),
  );
  parentPort.postMessage('done');
});
