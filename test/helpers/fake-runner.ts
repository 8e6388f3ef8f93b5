/** A scripted Runner for unit tests: an ordered list of expected commands and their canned results. */
import { pino } from 'pino';
import {
  CommandError,
  type RunOptions,
  type RunResult,
  type Runner,
  type RunScope,
} from '../../src/exec/runner.js';
import type { CallContext } from '../../src/server/call.js';

export interface Step {
  command: string;
  /** Expected arguments; a RegExp matches the arguments joined by spaces. */
  args?: readonly string[] | RegExp;
  exitCode?: number;
  stdout?: string;
  stderr?: string;
}

export class ScriptedRunner implements Runner {
  readonly calls: { command: string; args: readonly string[]; options: RunOptions }[] = [];
  private next = 0;

  constructor(private readonly steps: readonly Step[]) {}

  run(
    _scope: RunScope,
    command: string,
    args: readonly string[],
    options: RunOptions = {},
  ): Promise<RunResult> {
    this.calls.push({ command, args, options });
    const step = this.steps[this.next++];
    if (!step) throw new Error(`unexpected command: ${command} ${args.join(' ')}`);
    if (step.command !== command)
      throw new Error(`expected ${step.command}, got ${command} ${args.join(' ')}`);
    if (step.args instanceof RegExp) {
      if (!step.args.test(args.join(' ')))
        throw new Error(`${command} ${args.join(' ')} does not match ${String(step.args)}`);
    } else if (step.args && step.args.join('\0') !== args.join('\0')) {
      throw new Error(`expected ${command} ${step.args.join(' ')}, got ${args.join(' ')}`);
    }
    const exitCode = step.exitCode ?? 0;
    const ok = options.okCodes ?? [0];
    if (!ok.includes(exitCode)) {
      return Promise.reject(
        new CommandError(
          command,
          args,
          exitCode,
          step.stderr ?? '',
          'exit',
          `${command} exited with status ${exitCode}`,
        ),
      );
    }
    return Promise.resolve({ exitCode, stdout: step.stdout ?? '', stderr: step.stderr ?? '' });
  }

  /** True when every scripted step ran. */
  get done(): boolean {
    return this.next === this.steps.length;
  }
}

export function fakeContext(runner: Runner): CallContext {
  const ctx: CallContext = {
    reqId: 'test',
    method: 'test',
    log: pino({ level: 'silent' }),
    signal: new AbortController().signal,
    deadline: Number.POSITIVE_INFINITY,
    runner,
    run: (command, args, options) => runner.run(ctx, command, args, options),
  };
  return ctx;
}
