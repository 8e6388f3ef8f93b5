/**
 * `loopvol check --probe-frozen` asks a filesystem whether it is frozen by freezing it and thawing it
 * at once. A freeze that did not end on its own (timed out, killed) may have frozen it all the same:
 * it is thawed, never left frozen under its pod; one that found the filesystem frozen already (EBUSY)
 * is someone else's freeze, never thawed.
 */
import { pino } from 'pino';
import { describe, expect, it } from 'vitest';
import { probeFrozen } from '../../src/audit/frozen.js';
import { bindExec, CommandError, type Runner } from '../../src/exec/runner.js';

const log = pino({ level: 'silent' });

/** A runner whose `fsfreeze --freeze` fails with `err` (or succeeds), recording every command. */
function host(err?: CommandError): { runner: Runner; ran: string[] } {
  const ran: string[] = [];
  return {
    ran,
    runner: {
      run: (_scope, command, args) => {
        ran.push([command, ...args].join(' '));
        if (err && args.includes('--freeze')) return Promise.reject(err);
        return Promise.resolve({ exitCode: 0, stdout: '', stderr: '' });
      },
    },
  };
}
const failed = (reason: CommandError['reason'], stderr = '') =>
  new CommandError(
    'fsfreeze',
    ['--freeze', '/m'],
    reason === 'exit' ? 1 : undefined,
    stderr,
    reason,
    'fsfreeze failed',
  );

describe('probing whether a filesystem is frozen', () => {
  it('thaws what it froze', async () => {
    const h = host();
    expect(await probeFrozen(bindExec(h.runner, { log }), '/m')).toBe('not-frozen');
    expect(h.ran).toEqual(['fsfreeze --freeze /m', 'fsfreeze --unfreeze /m']);
  });

  it.each(['timeout', 'cancelled'] as const)(
    'thaws after a freeze that %s, which may have taken effect',
    async (reason) => {
      const h = host(failed(reason));
      expect(await probeFrozen(bindExec(h.runner, { log }), '/m')).toBe('unknown');
      expect(h.ran).toEqual(['fsfreeze --freeze /m', 'fsfreeze --unfreeze /m']);
    },
  );

  it('never thaws a filesystem someone else froze (EBUSY)', async () => {
    const h = host(failed('exit', 'fsfreeze: /m: freeze failed: Device or resource busy'));
    expect(await probeFrozen(bindExec(h.runner, { log }), '/m')).toBe('frozen');
    expect(h.ran).toEqual(['fsfreeze --freeze /m']);
  });

  it('runs a thaw a signal killed again, and takes "nothing frozen" then for done (the killed one thawed)', async () => {
    const ran: string[] = [];
    const answers = [
      new CommandError('fsfreeze', [], undefined, '', 'spawn', 'fsfreeze was killed by SIGINT', 'SIGINT'),
      new CommandError(
        'fsfreeze',
        [],
        1,
        'fsfreeze: /m: unfreeze failed: Invalid argument',
        'exit',
        'exit 1',
      ),
    ];
    const runner: Runner = {
      run: (_scope, command, args) => {
        ran.push([command, ...args].join(' '));
        const next = args.includes('--unfreeze') ? answers.shift() : undefined;
        return next ? Promise.reject(next) : Promise.resolve({ exitCode: 0, stdout: '', stderr: '' });
      },
    };
    expect(await probeFrozen(bindExec(runner, { log }), '/m')).toBe('not-frozen');
    expect(ran).toEqual(['fsfreeze --freeze /m', 'fsfreeze --unfreeze /m', 'fsfreeze --unfreeze /m']);
  });

  it('does not take a first thaw\'s "nothing frozen" for done', async () => {
    const runner: Runner = {
      run: (_scope, _command, args) =>
        args.includes('--unfreeze')
          ? Promise.reject(
              new CommandError('fsfreeze', [], 1, 'unfreeze failed: Invalid argument', 'exit', 'exit 1'),
            )
          : Promise.resolve({ exitCode: 0, stdout: '', stderr: '' }),
    };
    await expect(probeFrozen(bindExec(runner, { log }), '/m')).rejects.toThrow(/exit 1/);
  });
});
