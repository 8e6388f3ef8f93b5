/**
 * Subcommands of the loopvol binary beside the server (`loopvol <command> [flags]`): operator tools
 * that read and change the same pool the server uses, through the same code.
 */
import { parseArgs } from 'node:util';
import { pino } from 'pino';
import { check, CHECK_USAGE, gc, GC_USAGE } from './cli/check.js';
import { snapshots, SNAPSHOTS_USAGE, volumes, VOLUMES_USAGE } from './cli/listings.js';
import { RELEASE_USAGE, releaseNode } from './cli/release.js';
import { status, STATUS_USAGE } from './cli/status.js';
import { Pool } from './pool/pool.js';

export const COMMANDS: Record<string, { usage: string; run: (argv: string[]) => Promise<number> }> = {
  'create-pool': {
    usage:
      'loopvol create-pool --pool-dir=DIR [--pool-name=NAME]\n' +
      '  Creates a pool in DIR (once, e.g. on a freshly mounted shared filesystem) and prints its id.\n' +
      '  A pool that is already there is left as it is. Servers started with --create-pool=false use it.\n',
    run: createPool,
  },
  status: { usage: STATUS_USAGE, run: status },
  volumes: { usage: VOLUMES_USAGE, run: volumes },
  snapshots: { usage: SNAPSHOTS_USAGE, run: snapshots },
  check: { usage: CHECK_USAGE, run: check },
  gc: { usage: GC_USAGE, run: gc },
  'release-node': { usage: RELEASE_USAGE, run: releaseNode },
};

async function createPool(argv: string[]): Promise<number> {
  const { values } = parseArgs({
    args: argv,
    options: { 'pool-dir': { type: 'string' }, 'pool-name': { type: 'string' } },
    strict: true,
  });
  const dir = values['pool-dir'];
  if (!dir?.startsWith('/')) {
    process.stderr.write('loopvol create-pool: --pool-dir=DIR (an absolute path) is required\n');
    return 2;
  }
  const pool = await Pool.open(dir, values['pool-name'] ?? 'default', pino({ level: 'warn' }), {
    create: true,
  });
  process.stdout.write(`pool ${pool.id} at ${pool.root}\n`);
  return 0;
}
