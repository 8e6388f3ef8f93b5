import { pino, type DestinationStream, type Logger } from 'pino';
import type { LogLevel } from './config.js';

export type { Logger };

/** JSON lines on stdout (or `stream` in tests), with the fields every line of this process shares. */
export function createLogger(
  level: LogLevel,
  base: Record<string, string | undefined>,
  stream?: DestinationStream,
): Logger {
  const options = {
    level,
    base: Object.fromEntries(Object.entries(base).filter(([, v]) => v !== undefined)),
    timestamp: pino.stdTimeFunctions.isoTime,
    formatters: { level: (label: string) => ({ level: label }) },
  };
  return stream ? pino(options, stream) : pino(options, pino.destination({ fd: 1, sync: false }));
}
