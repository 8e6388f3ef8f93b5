/** The CSI Identity service: who we are, what we offer, and whether we are ready. */
import type { Config } from '../config.js';
import { servesController } from '../config.js';
import { failedPrecondition } from '../errors.js';
import type { GetPluginCapabilitiesResponse } from '../gen/csi/v1/GetPluginCapabilitiesResponse.js';
import type { IdentityHandlers } from '../gen/csi/v1/Identity.js';
import type { PluginCapability } from '../gen/csi/v1/PluginCapability.js';
import { PROBE_REUSE_MS, READINESS_TIMEOUT_MS, type Readiness } from '../health.js';
import { method, type Methods } from '../server/call.js';

export interface IdentityDeps {
  config: Pick<Config, 'driverName' | 'mode'>;
  readiness: Readiness;
  version: string;
}

export function pluginCapabilities(config: Pick<Config, 'mode'>): GetPluginCapabilitiesResponse {
  const caps: PluginCapability[] = [];
  if (servesController(config)) {
    caps.push({ service: { type: 'CONTROLLER_SERVICE' } });
    caps.push({ service: { type: 'GROUP_CONTROLLER_SERVICE' } });
    caps.push({ service: { type: 'SNAPSHOT_METADATA_SERVICE' } });
  }
  caps.push({ service: { type: 'VOLUME_ACCESSIBILITY_CONSTRAINTS' } });
  caps.push({ volume_expansion: { type: 'ONLINE' } });
  return { capabilities: caps };
}

export function identityService({ config, readiness, version }: IdentityDeps): Methods<IdentityHandlers> {
  const none = (): null => null;
  // Constant for the life of the process: built once, not per call.
  const info = { name: config.driverName, vendor_version: version, manifest: {} };
  const capabilities = pluginCapabilities(config);
  return {
    GetPluginInfo: method({
      validate: none,
      quiet: true,
      run: () => Promise.resolve(info),
    }),
    GetPluginCapabilities: method({
      validate: none,
      quiet: true,
      run: () => Promise.resolve(capabilities),
    }),
    Probe: method({
      validate: none,
      quiet: true,
      run: async (_v, ctx) => {
        // Answer within the caller's deadline, whatever the pool's filesystem does.
        const wait = Math.max(100, Math.min(READINESS_TIMEOUT_MS, ctx.deadline - Date.now() - 200));
        const problem = await readiness.problem(wait, PROBE_REUSE_MS);
        if (problem) throw failedPrecondition(problem);
        return { ready: { value: true } };
      },
    }),
  };
}
