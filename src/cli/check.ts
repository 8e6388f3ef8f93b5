/** `loopvol check` and `loopvol gc`: what is not as it should be, and removing what is safe to remove. */
import { type CheckOptions, DEFAULT_STALE_SECONDS, recheckHost, runCheck } from '../audit/check.js';
import { type Finding, isProblem } from '../audit/findings.js';
import { collectGarbage } from '../audit/gc.js';
import { DEFAULT_KUBELET_DIR } from '../audit/host-check.js';
import { DEFAULT_LOCK_STALE_SECONDS, DEFAULT_TRASH_AGE_SECONDS } from '../audit/pool-check.js';
import { kernelHost } from '../host/host.js';
import { isNodeId } from '../pool/ids.js';
import {
  cliExec,
  cliLogger,
  COMMON_HELP,
  COMMON_OPTIONS,
  EXIT,
  openPool,
  parse,
  positiveNumber,
  printJson,
  runCommand,
  UsageError,
} from './common.js';

const CHECK_OPTIONS = {
  ...COMMON_OPTIONS,
  'kubelet-dir': { type: 'string', default: DEFAULT_KUBELET_DIR },
  nodeid: { type: 'string', multiple: true },
  only: { type: 'string' },
  'stale-seconds': { type: 'string' },
  'trash-age': { type: 'string' },
  'probe-frozen': { type: 'boolean', default: false },
} as const;

const CHECK_FLAGS_HELP =
  COMMON_HELP +
  `  --kubelet-dir DIR     the kubelet's root directory; a mount of a pool device outside it is reported (default ${DEFAULT_KUBELET_DIR})\n` +
  '  --nodeid NODE         a node that runs on this host (repeatable); by default the nodes whose registration\n' +
  '                        names this host\n' +
  '  --only pool|host      look only at the pool, or only at this host (default both)\n' +
  `  --stale-seconds N     a node whose heartbeat is older is stale (default ${DEFAULT_STALE_SECONDS})\n` +
  `  --trash-age N         trash older than N seconds is reported and removed (default ${DEFAULT_TRASH_AGE_SECONDS})\n` +
  '  --probe-frozen        also find frozen xfs and btrfs filesystems, by trying to freeze each (and thawing it\n' +
  '                        at once); ext4 is always checked without touching it\n';

export const CHECK_USAGE =
  'loopvol check [--pool-dir DIR] [--kubelet-dir DIR] [--only pool|host] [--json] [...]\n' +
  '  Everything that is not as it should be, each with what to do. In the pool: images without a record,\n' +
  '  records without an image, unreadable records, unfinished creations, quarantined records, leases\n' +
  '  (revoked ones too) and attachments of nodes whose heartbeat is missing or stale, locks whose holder\n' +
  '  is gone or that are not renewed, old trash. On this host: loop devices of pool images that no lease\n' +
  '  explains, their mounts, mounts of staged volumes outside the kubelet directory, frozen filesystems.\n' +
  '  Filesystems a node fenced on purpose, and freezes of a copy in progress, are notices.\n' +
  '  Reads only (except --probe-frozen). Safe while the driver runs.\n' +
  CHECK_FLAGS_HELP +
  'Exit status: 0 nothing but notices, 1 problems found, 2 bad flags, 3 the pool could not be read,\n' +
  '  130 interrupted while probing (each filesystem it froze was thawed first), 4 stopped at once by a third\n' +
  '  signal (a filesystem it was probing may be left frozen).\n';

export const GC_USAGE =
  'loopvol gc [--yes] [--pool-dir DIR] [--kubelet-dir DIR] [--only pool|host] [--json] [...]\n' +
  '  Removes what check proves safe to remove, and nothing else: leaked mounts and loop devices on this host\n' +
  '  that no lease explains and nothing uses, locks whose holder is provably gone, old trash. Never an image\n' +
  '  or a record, never anything quarantined, never a fenced or frozen filesystem, never a lease. It takes\n' +
  "  the volumes' pool locks (as the driver does) and looks again before acting. Safe while the driver runs.\n" +
  '  Without --yes it only says what it would do.\n' +
  '  --yes                 do it\n' +
  CHECK_FLAGS_HELP +
  'Exit status: 0 done (or, without --yes, planned), 1 something could not be removed, 2 bad flags,\n' +
  '  3 the pool could not be read, 130 interrupted with --probe-frozen (a probe under way thaws first;\n' +
  '  the planned removals are still tried, each looked at again first, though the interrupt may cut one\n' +
  '  short), 4 stopped at once by a third signal (a filesystem it was probing may be left frozen).\n';

type Values = ReturnType<typeof parse<typeof CHECK_OPTIONS>>['values'];

function checkOptions(values: Values): CheckOptions {
  const only = values.only ?? 'all';
  if (only !== 'all' && only !== 'pool' && only !== 'host')
    throw new UsageError(`--only ${only}: must be pool or host`);
  const kubeletDir = values['kubelet-dir'];
  if (!kubeletDir.startsWith('/'))
    throw new UsageError(`--kubelet-dir ${kubeletDir}: must be an absolute path`);
  const nodeIds = values.nodeid;
  for (const n of nodeIds ?? []) if (!isNodeId(n)) throw new UsageError(`--nodeid ${n}: not a node name`);
  return {
    scope: only,
    kubeletDir: kubeletDir.replace(/\/+$/, '') || '/',
    ...(nodeIds ? { nodeIds } : {}),
    probeFrozen: values['probe-frozen'],
    staleSeconds: positiveNumber('stale-seconds', values['stale-seconds'], DEFAULT_STALE_SECONDS),
    trashAgeSeconds: positiveNumber('trash-age', values['trash-age'], DEFAULT_TRASH_AGE_SECONDS),
    lockStaleSeconds: DEFAULT_LOCK_STALE_SECONDS,
  };
}

function printFindings(findings: readonly Finding[], notes: readonly string[]): void {
  const out: string[] = [];
  for (const f of findings) {
    out.push(`${f.severity === 'problem' ? 'PROBLEM' : 'NOTICE '}  ${f.kind}  ${f.subject}`);
    out.push(`         ${f.detail}`);
    out.push(`         -> ${f.action}`);
  }
  for (const n of notes) out.push(`note: ${n}`);
  const problems = findings.filter(isProblem);
  const removable = problems.filter((f) => f.gc !== undefined).length;
  const notices = findings.length - problems.length;
  out.push(
    problems.length === 0
      ? `clean: no problems${notices ? `, ${notices} notice(s)` : ''}`
      : `${problems.length} problem(s), ${removable} of which loopvol gc removes${notices ? `; ${notices} notice(s)` : ''}`,
  );
  process.stdout.write(`${out.join('\n')}\n`);
}

export async function check(argv: string[]): Promise<number> {
  return runCommand('check', async () => {
    const { values } = parse(argv, CHECK_OPTIONS);
    const opts = checkOptions(values);
    const log = cliLogger('silent');
    const pool = await openPool(values['pool-dir'], log);
    const stop = interruptible('check', opts);
    const report = await runCheck(pool, log, kernelHost, cliExec(cliLogger()), stop.opts).finally(stop.done);
    if (stop.stopped()) return EXIT.interrupted;
    const code = report.findings.some(isProblem) ? EXIT.problems : EXIT.ok;
    if (values.json) {
      printJson({
        pool: { id: pool.id, path: pool.root },
        findings: report.findings,
        notes: report.notes,
        problems: report.findings.filter(isProblem).length,
        exitCode: code,
      });
    } else {
      printFindings(report.findings, report.notes);
    }
    return code;
  });
}

export async function gc(argv: string[]): Promise<number> {
  return runCommand('gc', async () => {
    const { values } = parse(argv, { ...CHECK_OPTIONS, yes: { type: 'boolean', default: false } });
    const opts = checkOptions(values);
    const log = cliLogger('silent');
    const x = cliExec(cliLogger());
    const pool = await openPool(values['pool-dir'], log);
    const stop = interruptible('gc', opts);
    try {
      const report = await runCheck(pool, log, kernelHost, x, stop.opts);
      if (stop.stopped()) return EXIT.interrupted;
      const planned = report.findings.filter((f) => f.gc !== undefined);
      if (!values.yes) {
        if (values.json) {
          printJson({ dryRun: true, planned, left: report.findings.filter((f) => isProblem(f) && !f.gc) });
        } else {
          for (const f of planned)
            process.stdout.write(`would ${f.gc?.action ?? '?'} ${f.subject}  (${f.kind}: ${f.detail})\n`);
          const left = report.findings.filter((f) => isProblem(f) && !f.gc).length;
          process.stdout.write(
            `${planned.length === 0 ? 'nothing to remove' : `dry run: ${planned.length} thing(s) to remove; run loopvol gc --yes to remove them`}${left ? `; ${left} problem(s) need an operator (loopvol check)` : ''}\n`,
          );
        }
        return EXIT.ok;
      }
      const outcomes = await collectGarbage(
        {
          pool,
          host: kernelHost,
          x,
          recheckHost: () => recheckHost(pool, log, kernelHost, x, stop.opts),
          trashAgeSeconds: opts.trashAgeSeconds,
        },
        planned,
      );
      const failed = outcomes.filter((o) => o.result === 'failed');
      if (values.json) {
        printJson({
          dryRun: false,
          outcomes: outcomes.map((o) => ({
            kind: o.finding.kind,
            subject: o.finding.subject,
            step: o.finding.gc,
            result: o.result,
            message: o.message,
          })),
        });
      } else {
        for (const o of outcomes)
          process.stdout.write(`${o.result.padEnd(7)}  ${o.message}  (${o.finding.kind})\n`);
        const removed = outcomes.filter((o) => o.result === 'removed').length;
        process.stdout.write(`${removed} removed, ${failed.length} could not be removed\n`);
      }
      // Interrupted while removing: the planned removals were still tried (each looked at again first).
      if (stop.stopped()) return EXIT.interrupted;
      return failed.length > 0 ? EXIT.problems : EXIT.ok;
    } finally {
      stop.done();
    }
  });
}

/**
 * A probe freezes a filesystem before it thaws it. With --probe-frozen, SIGINT (a Ctrl-C reaches
 * fsfreeze too), SIGTERM and SIGHUP end the probing instead of the process: the command returns
 * EXIT.interrupted once the probe under way has thawed what it froze, never before.
 */
function interruptible(
  name: string,
  opts: CheckOptions,
): { opts: CheckOptions; stopped: () => boolean; done: () => void } {
  if (!opts.probeFrozen) return { opts, stopped: () => false, done: () => undefined };
  const stop = new AbortController();
  const signals = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const;
  let received = 0;
  let said = false;
  const handler = (signal: NodeJS.Signals): void => {
    received++;
    if (received === 1)
      process.stderr.write(
        `loopvol ${name}: ${signal}: ending the freeze probe under way (it thaws what it froze); a third signal exits at once\n`,
      );
    if (received >= 3) {
      process.stderr.write(
        `loopvol ${name}: exiting at once: a filesystem it was probing may be left frozen (loopvol check --probe-frozen finds it)\n`,
      );
      process.exit(EXIT.leftFrozen);
    }
    stop.abort();
  };
  for (const s of signals) process.on(s, handler);
  return {
    opts: { ...opts, stopProbing: stop.signal },
    stopped: () => {
      if (stop.signal.aborted && !said) {
        said = true;
        process.stderr.write(`loopvol ${name}: interrupted; every filesystem it froze to probe was thawed\n`);
      }
      return stop.signal.aborted;
    },
    done: () => {
      for (const s of signals) process.off(s, handler);
    },
  };
}
