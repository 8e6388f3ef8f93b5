/**
 * The vendored CSI proto, loaded once: gRPC service definitions for the server and clients, and the
 * descriptors that say which fields carry secrets (option csi_secret), so logs can redact them
 * without a hand-kept list.
 */
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';
import type { ProtoGrpcType } from '../gen/csi.js';

export const PROTO_PATH = path.resolve(
  path.dirname(fileURLToPath(import.meta.url)),
  '..',
  '..',
  'proto',
  'csi.proto',
);

export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

let loaded: ProtoGrpcType | undefined;

/** The csi.v1 package: service constructors (clients) and their .service definitions (server). */
export function csiProto(): ProtoGrpcType {
  if (!loaded) {
    const def = protoLoader.loadSync(PROTO_PATH, LOADER_OPTIONS);
    loaded = grpc.loadPackageDefinition(def) as unknown as ProtoGrpcType;
  }
  return loaded;
}

export const REDACTED = '[REDACTED]';

let root: protobuf.Root | undefined;
function protoRoot(): protobuf.Root {
  if (!root) {
    root = protobuf.loadSync(PROTO_PATH);
    root.resolveAll();
  }
  return root;
}

const isSecretField = (field: protobuf.Field): boolean => {
  const options = field.options ?? {};
  return options['(csi_secret)'] === true || options['(csi.v1.csi_secret)'] === true;
};

/** Names of all fields marked csi_secret, as "Message.field" (for tests and docs). */
export function secretFields(): string[] {
  const out: string[] = [];
  const visit = (ns: protobuf.NamespaceBase): void => {
    for (const nested of ns.nestedArray) {
      if (nested instanceof protobuf.Type) {
        for (const f of nested.fieldsArray)
          if (isSecretField(f)) out.push(`${nested.fullName.slice(1)}.${f.name}`);
      }
      if (nested instanceof protobuf.Namespace) visit(nested);
    }
  };
  visit(protoRoot());
  return out.sort();
}

function redactMessage(value: unknown, type: protobuf.Type, depth: number): unknown {
  if (typeof value !== 'object' || value === null || depth > 16) return value;
  const src = value as Record<string, unknown>;
  const out: Record<string, unknown> = { ...src };
  for (const field of type.fieldsArray) {
    const v = src[field.name];
    if (v === undefined || v === null) continue;
    if (isSecretField(field)) {
      const empty = typeof v === 'object' ? Object.keys(v).length === 0 : v === '';
      out[field.name] = empty ? v : REDACTED;
      continue;
    }
    const sub = field.resolvedType;
    if (!(sub instanceof protobuf.Type)) continue;
    if (field.repeated && Array.isArray(v)) {
      out[field.name] = v.map((x: unknown) => redactMessage(x, sub, depth + 1));
    } else if (field instanceof protobuf.MapField && typeof v === 'object') {
      out[field.name] = Object.fromEntries(
        Object.entries(v as Record<string, unknown>).map(([k, x]) => [k, redactMessage(x, sub, depth + 1)]),
      );
    } else {
      out[field.name] = redactMessage(v, sub, depth + 1);
    }
  }
  return out;
}

/** A function that copies a request of `service`.`method` with every secret field replaced. */
export function requestRedactor(service: string, method: string): (request: unknown) => unknown {
  const svc = protoRoot().lookupService(`csi.v1.${service}`);
  const m = svc.methods[method];
  if (!m) throw new Error(`no method ${service}.${method} in the CSI proto`);
  m.resolve();
  const type = m.resolvedRequestType;
  if (!type) throw new Error(`unresolved request type for ${service}.${method}`);
  return (request) => redactMessage(request, type, 0);
}
