/**
 * Subcommands of the loopvol binary beside the server (`loopvol <command> [flags]`): operator tools
 * that read and change the same pool the server uses, through the same code.
 */
import { parseArgs } from 'node:util';
import { pino } from 'pino';
import { Pool } from './pool/pool.js';

export const COMMANDS: Record<string, { usage: string; run: (argv: string[]) => Promise<number> }> = {
  'create-pool': {
    usage:
      'loopvol create-pool --pool-dir=DIR [--pool-name=NAME]\n' +
      '  Creates a pool in DIR (once, e.g. on a freshly mounted shared filesystem) and prints its id.\n' +
      '  A pool that is already there is left as it is. Servers started with --create-pool=false use it.\n',
    run: createPool,
  },
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
