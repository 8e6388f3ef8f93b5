/** The CSI Identity service: who we are, what we offer, and whether we are ready. */
import type { Config } from '../config.js';
import { servesController } from '../config.js';
import { failedPrecondition } from '../errors.js';
import type { GetPluginCapabilitiesResponse } from '../gen/csi/v1/GetPluginCapabilitiesResponse.js';
import type { IdentityHandlers } from '../gen/csi/v1/Identity.js';
import type { PluginCapability } from '../gen/csi/v1/PluginCapability.js';
import { readinessProblem } from '../health.js';
import type { Pool } from '../pool/pool.js';
import { method, type Methods } from '../server/call.js';

export interface IdentityDeps {
  config: Pick<Config, 'driverName' | 'mode'>;
  pool: Pool;
  version: string;
}

export function pluginCapabilities(config: Pick<Config, 'mode'>): GetPluginCapabilitiesResponse {
  const caps: PluginCapability[] = [];
  if (servesController(config)) {
    caps.push({ service: { type: 'CONTROLLER_SERVICE' } });
    caps.push({ service: { type: 'GROUP_CONTROLLER_SERVICE' } });
  }
  caps.push({ service: { type: 'VOLUME_ACCESSIBILITY_CONSTRAINTS' } });
  caps.push({ volume_expansion: { type: 'ONLINE' } });
  return { capabilities: caps };
}

export function identityService({ config, pool, version }: IdentityDeps): Methods<IdentityHandlers> {
  const none = (): null => null;
  return {
    GetPluginInfo: method({
      validate: none,
      quiet: true,
      run: () => Promise.resolve({ name: config.driverName, vendor_version: version, manifest: {} }),
    }),
    GetPluginCapabilities: method({
      validate: none,
      quiet: true,
      run: () => Promise.resolve(pluginCapabilities(config)),
    }),
    Probe: method({
      validate: none,
      quiet: true,
      run: async () => {
        const problem = await readinessProblem(pool, config.mode);
        if (problem) throw failedPrecondition(problem);
        return { ready: { value: true } };
      },
    }),
  };
}
