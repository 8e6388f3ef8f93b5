#!/usr/bin/env node
// The floor for per-call cost: a bare grpc-js server on the same vendored proto, loaded with the same
// options, serving Identity and Node with constant answers (no validation, no logging, no metrics, no
// readiness check). What a Node.js CSI server cannot go below.
//
//   node bench/bare-server.mjs unix:///path/to.sock
//
// Prints "ready" on stdout once it listens; stops on SIGTERM.
import * as grpc from '@grpc/grpc-js';
import { csiProto } from '../dist/server/proto.js';

const endpoint = process.argv[2];
if (!endpoint) {
  process.stderr.write('usage: bare-server.mjs unix:///path.sock\n');
  process.exit(2);
}
const v1 = csiProto().csi.v1;
const constant = (value) => (_call, callback) => callback(null, value);
const unimplemented = (_call, callback) => callback({ code: grpc.status.UNIMPLEMENTED, details: 'no' });
const serve = (definition, answers) =>
  Object.fromEntries(Object.keys(definition).map((m) => [m, answers[m] ?? unimplemented]));

const server = new grpc.Server({ 'grpc.max_receive_message_length': 4 * 1024 * 1024 });
server.addService(
  v1.Identity.service,
  serve(v1.Identity.service, {
    GetPluginInfo: constant({ name: 'loopvol.csi.io', vendor_version: 'bare', manifest: {} }),
    GetPluginCapabilities: constant({ capabilities: [] }),
    Probe: constant({ ready: { value: true } }),
  }),
);
server.addService(
  v1.Node.service,
  serve(v1.Node.service, {
    NodeGetCapabilities: constant({
      capabilities: [
        'STAGE_UNSTAGE_VOLUME',
        'GET_VOLUME_STATS',
        'VOLUME_CONDITION',
        'SINGLE_NODE_MULTI_WRITER',
        'EXPAND_VOLUME',
      ].map((type) => ({ rpc: { type } })),
    }),
    NodeGetInfo: constant({ node_id: 'bench-node', max_volumes_per_node: '128' }),
  }),
);
server.bindAsync(endpoint, grpc.ServerCredentials.createInsecure(), (err) => {
  if (err) {
    process.stderr.write(`${err.message}\n`);
    process.exit(1);
  }
  process.stdout.write('ready\n');
});
process.on('SIGTERM', () => server.tryShutdown(() => process.exit(0)));
