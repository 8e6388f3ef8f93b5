/**
 * Run as `node --max-semi-space-size=1 collect-probe.mjs <path of dist/idle-gc.js>` (or its text with
 * `-e`, the path last): drops 48 MiB of objects held long enough to be promoted, collects them with
 * the driver's v8FullCollection, and prints what the heap and RSS were before and after. Node 20 gives
 * the freed pages back on a thread of its own, shortly after: RSS is read again until it fell or 5 s
 * passed. Used by test/unit/idle-gc.test.ts (the machine's Node.js) and the container run (the image's).
 */
const { v8FullCollection, heapUsed } = await import(process.argv.at(-1));
const rss = () => process.memoryUsage().rss;
const collect = v8FullCollection();
if (!collect) throw new Error('this Node.js gave no full collection');
const held = [];
for (let i = 0; i < 8; i++) held.push(Array.from({ length: 100_000 }, (_, j) => ({ i, j, s: `x${j}` })));
const garbage = heapUsed();
const rssBefore = rss();
held.length = 0;
collect();
const after = heapUsed();
const pause = new Int32Array(new SharedArrayBuffer(4));
for (const until = Date.now() + 5000; rss() > rssBefore - 16 * 2 ** 20 && Date.now() < until;)
  Atomics.wait(pause, 0, 0, 50);
process.stdout.write(
  JSON.stringify({ garbage, after, rssBefore, rssAfter: rss(), exposed: typeof globalThis.gc }),
);
