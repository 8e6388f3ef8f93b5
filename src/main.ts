#!/usr/bin/env node
/** loopvol: parse flags, start the driver, drain and exit on SIGTERM/SIGINT. */
import { writeSync } from 'node:fs';
import { COMMANDS } from './cli.js';
import { ConfigError, helpText, parseConfig } from './config.js';
import { startDriver } from './driver.js';
import { CLEANUP_MS } from './exec/runner.js';
import { createLogger } from './log.js';
import { PoolError } from './pool/pool.js';
import { EndpointError } from './server/server.js';
import { driverVersion } from './version.js';

/** How long an exit waits for the log to be written out. */
const FLUSH_WAIT_MS = 2_000;
/** Beyond --shutdown-timeout and the undo time, what stopping may take before the process just exits. */
const STOP_MARGIN_MS = 10_000;

function fail(message: string, code: number): never {
  process.stderr.write(`loopvol: ${message}\n`);
  process.exit(code);
}

async function main(): Promise<void> {
  const [first, ...rest] = process.argv.slice(2);
  if (first !== undefined && !first.startsWith('-')) {
    const command = COMMANDS[first];
    if (!command)
      fail(`unknown command ${first}; the commands are ${Object.keys(COMMANDS).join(', ')} (see --help)`, 2);
    if (rest.includes('--help') || rest.includes('-h')) {
      process.stdout.write(command.usage);
      return;
    }
    try {
      process.exitCode = await command.run(rest);
    } catch (err) {
      fail(err instanceof Error ? err.message : String(err), err instanceof PoolError ? 1 : 2);
    }
    return;
  }
  let parsed;
  try {
    parsed = parseConfig(process.argv.slice(2));
  } catch (err) {
    if (err instanceof ConfigError) fail(err.message, 2);
    throw err;
  }
  if (parsed.kind === 'help') {
    process.stdout.write(helpText());
    return;
  }
  if (parsed.kind === 'version') {
    process.stdout.write(`loopvol ${driverVersion()}\n`);
    return;
  }
  const { config } = parsed;
  const log = createLogger(config.logLevel, {
    driver: config.driverName,
    mode: config.mode,
    node: config.nodeId,
  });

  let driver;
  try {
    driver = await startDriver(config, log);
  } catch (err) {
    if (err instanceof PoolError || err instanceof EndpointError) {
      log.fatal({ err: err.message }, 'cannot start');
      log.flush();
      fail(err.message, 1);
    }
    throw err;
  }

  // process.exit() waits for libuv's threads, and one blocked on a pool that hangs (a network
  // filesystem's server gone) never ends: then the log's flush, which needs those threads too, never
  // ends either, and the process ends by SIGKILL (said on stderr, which needs none of them).
  const exitNow = (why: string): void => {
    writeSync(2, `loopvol: ${why}; exiting now\n`);
    process.kill(process.pid, 'SIGKILL');
  };
  const exitFlushed = async (code: number): Promise<void> => {
    const clean = await driver.exitsCleanly();
    const blocked = 'a call or a look at the pool is blocked on it (does the pool hang?)';
    log.flush(() => {
      if (clean) process.exit(code);
      else exitNow(blocked);
    });
    setTimeout(() => {
      exitNow(clean ? 'the log could not be written out' : blocked);
    }, FLUSH_WAIT_MS);
  };
  let stopping = false;
  const onSignal = (signal: NodeJS.Signals): void => {
    if (stopping) exitNow(`second signal (${signal})`);
    stopping = true;
    setTimeout(
      () => {
        exitNow('stopping took longer than --shutdown-timeout and the undo time');
      },
      config.shutdownTimeoutMs + CLEANUP_MS + STOP_MARGIN_MS,
    );
    log.info({ signal }, 'stopping: no new calls, waiting for calls in flight');
    driver.stop().then(
      () => {
        log.info('stopped');
        void exitFlushed(0);
      },
      (err: unknown) => {
        log.error({ err }, 'error while stopping');
        void exitFlushed(1);
      },
    );
  };
  process.on('SIGTERM', onSignal);
  process.on('SIGINT', onSignal);
}

main().catch((err: unknown) => {
  process.stderr.write(
    `loopvol: unexpected error at startup: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`,
  );
  process.exit(1);
});
