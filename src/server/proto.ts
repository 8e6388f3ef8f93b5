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

const isSecretField = (field: protobuf.Field): boolean => {
  const options = field.options ?? {};
  return options['(csi_secret)'] === true || options['(csi.v1.csi_secret)'] === true;
};

/** How a message is copied for a log line: its secret fields, and its fields holding messages that hold one. */
interface Plan {
  secrets: string[];
  nested: { name: string; how: 'one' | 'list' | 'map'; plan: Plan }[];
}

interface Redaction {
  /** By "package.Service.Method": the plan of its request. */
  plans: Map<string, Plan>;
  /** Every csi_secret field, as "csi.v1.Message.field". */
  secrets: string[];
}

let redaction: Redaction | undefined;

/**
 * Reads the proto's secret fields into plans, once. The protobufjs Root read for it (a second one beside
 * the one grpc-js serves from, ~1.4 MiB of memory) is let go once the plans are made: they hold none of
 * it, and they walk only the fields that lead to a secret.
 */
function redactionOfProto(): Redaction {
  if (redaction) return redaction;
  // Field names as the proto spells them, as requests come (LOADER_OPTIONS.keepCase): protobufjs would
  // otherwise camel-case them, and a secret named in two words would never match its request's field.
  const root = new protobuf.Root().loadSync(PROTO_PATH, { keepCase: true });
  root.resolveAll();
  const types: protobuf.Type[] = [];
  const services: protobuf.Service[] = [];
  const visit = (ns: protobuf.NamespaceBase): void => {
    for (const nested of ns.nestedArray) {
      if (nested instanceof protobuf.Type) types.push(nested);
      if (nested instanceof protobuf.Service) services.push(nested);
      if (nested instanceof protobuf.Namespace) visit(nested);
    }
  };
  visit(root);
  const subType = (f: protobuf.Field): protobuf.Type | undefined =>
    f.resolvedType instanceof protobuf.Type ? f.resolvedType : undefined;
  // The types that hold a secret at any depth: those with one of their own, then those holding those.
  const holding = new Set(types.filter((t) => t.fieldsArray.some(isSecretField)));
  for (let grew = true; grew;) {
    grew = false;
    for (const t of types) {
      if (holding.has(t)) continue;
      if (
        !t.fieldsArray.some((f) => {
          const sub = subType(f);
          return sub !== undefined && holding.has(sub);
        })
      )
        continue;
      holding.add(t);
      grew = true;
    }
  }
  const made = new Map<protobuf.Type, Plan>();
  const planOf = (t: protobuf.Type): Plan => {
    const known = made.get(t);
    if (known) return known;
    const plan: Plan = { secrets: [], nested: [] };
    made.set(t, plan);
    for (const f of t.fieldsArray) {
      const sub = subType(f);
      if (isSecretField(f)) plan.secrets.push(f.name);
      else if (sub && holding.has(sub)) {
        const how = f.repeated ? 'list' : f instanceof protobuf.MapField ? 'map' : 'one';
        plan.nested.push({ name: f.name, how, plan: planOf(sub) });
      }
    }
    return plan;
  };
  const plans = new Map<string, Plan>();
  for (const svc of services) {
    for (const m of svc.methodsArray) {
      m.resolve();
      if (m.resolvedRequestType)
        plans.set(`${svc.fullName.slice(1)}.${m.name}`, planOf(m.resolvedRequestType));
    }
  }
  const secrets = types.flatMap((t) =>
    t.fieldsArray.filter(isSecretField).map((f) => `${t.fullName.slice(1)}.${f.name}`),
  );
  return (redaction = { plans, secrets: secrets.sort() });
}

/** Names of all fields marked csi_secret, as "csi.v1.Message.field" (for tests and docs). */
export function secretFields(): string[] {
  return [...redactionOfProto().secrets];
}

function redactMessage(value: unknown, plan: Plan, depth: number): unknown {
  if (typeof value !== 'object' || value === null || depth > 16) return value;
  const src = value as Record<string, unknown>;
  const out: Record<string, unknown> = { ...src };
  for (const name of plan.secrets) {
    const v = src[name];
    if (v === undefined || v === null) continue;
    const empty = typeof v === 'object' ? Object.keys(v).length === 0 : v === '';
    out[name] = empty ? v : REDACTED;
  }
  for (const { name, how, plan: sub } of plan.nested) {
    const v = src[name];
    if (v === undefined || v === null) continue;
    if (how === 'list' && Array.isArray(v)) {
      out[name] = v.map((x: unknown) => redactMessage(x, sub, depth + 1));
    } else if (how === 'map' && typeof v === 'object') {
      out[name] = Object.fromEntries(
        Object.entries(v as Record<string, unknown>).map(([k, x]) => [k, redactMessage(x, sub, depth + 1)]),
      );
    } else {
      out[name] = redactMessage(v, sub, depth + 1);
    }
  }
  return out;
}

/** A function that copies a request of `service`.`method` with every secret field replaced. */
export function requestRedactor(service: string, method: string): (request: unknown) => unknown {
  const plan = redactionOfProto().plans.get(`csi.v1.${service}.${method}`);
  if (!plan) throw new Error(`no method ${service}.${method} in the CSI proto`);
  return (request) => redactMessage(request, plan, 0);
}
