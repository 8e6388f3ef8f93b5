/** Promise-returning CSI clients over a real @grpc/grpc-js channel. */
import * as grpc from '@grpc/grpc-js';
import { csiProto } from '../../src/server/proto.js';
import type { ControllerClient } from '../../src/gen/csi/v1/Controller.js';
import type { GroupControllerClient } from '../../src/gen/csi/v1/GroupController.js';
import type { IdentityClient } from '../../src/gen/csi/v1/Identity.js';
import type { NodeClient } from '../../src/gen/csi/v1/Node.js';
import { SLOW } from './host.js';

type Promisified<C> = {
  [K in keyof C as K extends string ? (K extends Capitalize<K> ? K : never) : never]: C[K] extends (
    argument: infer Req,
    callback: grpc.requestCallback<infer Res>,
  ) => grpc.ClientUnaryCall
    ? (request: Req, options?: { timeoutMs?: number }) => Promise<Res>
    : never;
};

function promisify<C extends grpc.Client>(client: C): Promisified<C> {
  return new Proxy({} as Promisified<C>, {
    get(_target, prop) {
      if (typeof prop !== 'string') return undefined;
      const fn = (client as unknown as Record<string, unknown>)[prop];
      if (typeof fn !== 'function') return undefined;
      return (request: unknown, options?: { timeoutMs?: number }) =>
        new Promise((resolve, reject) => {
          const deadline = new Date(Date.now() + (options?.timeoutMs ?? 120_000 * SLOW));
          (
            fn as (
              r: unknown,
              m: grpc.Metadata,
              o: grpc.CallOptions,
              cb: grpc.requestCallback<unknown>,
            ) => void
          ).call(client, request, new grpc.Metadata(), { deadline }, (err, res) => {
            if (err) reject(err);
            else resolve(res);
          });
        });
    },
  });
}

export interface CsiClients {
  identity: Promisified<IdentityClient>;
  controller: Promisified<ControllerClient>;
  node: Promisified<NodeClient>;
  group: Promisified<GroupControllerClient>;
  close(): void;
}

/**
 * A test's channel tries its socket again within a quarter second. grpc-js waits 1 s after a failed
 * connect, then 1.6 times longer each time: a driver that began to listen 12.6 s after a client
 * began polling was answered only at 19.9 s (12.8 s with these options), past the start helper's
 * 15 s deadline of the time.
 */
export const CHANNEL_OPTIONS: grpc.ChannelOptions = {
  'grpc.initial_reconnect_backoff_ms': 100,
  'grpc.max_reconnect_backoff_ms': 250,
};

export function csiClients(endpoint: string): CsiClients {
  const v1 = csiProto().csi.v1;
  const creds = grpc.credentials.createInsecure();
  const identity = new v1.Identity(endpoint, creds, CHANNEL_OPTIONS);
  const controller = new v1.Controller(endpoint, creds, CHANNEL_OPTIONS);
  const node = new v1.Node(endpoint, creds, CHANNEL_OPTIONS);
  const group = new v1.GroupController(endpoint, creds, CHANNEL_OPTIONS);
  return {
    identity: promisify(identity),
    controller: promisify(controller),
    node: promisify(node),
    group: promisify(group),
    close() {
      for (const c of [identity, controller, node, group]) c.close();
    },
  };
}

/** The gRPC status code name of a rejected call, or 'OK'. */
export async function codeOf(p: Promise<unknown>): Promise<string> {
  try {
    await p;
    return 'OK';
  } catch (err) {
    const code = (err as { code?: number }).code;
    return code === undefined ? `not a gRPC error: ${String(err)}` : (grpc.status[code] ?? String(code));
  }
}

/** The rejection of a call, asserting it was rejected. */
export async function errorOf(p: Promise<unknown>): Promise<{ code: string; details: string }> {
  try {
    await p;
  } catch (err) {
    const e = err as { code?: number; details?: string };
    return {
      code: e.code === undefined ? 'UNKNOWN' : (grpc.status[e.code] ?? String(e.code)),
      details: e.details ?? '',
    };
  }
  throw new Error('expected the call to fail, but it succeeded');
}
