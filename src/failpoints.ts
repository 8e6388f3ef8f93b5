/**
 * Crash points for tests: when LOOPVOL_FAILPOINT names a point, the process kills itself there with
 * SIGKILL, as a power cut or an OOM kill would, so tests can prove every step is recoverable. Unset in
 * production; the check is one string comparison.
 */
const armed = process.env.LOOPVOL_FAILPOINT;

export function failpoint(name: string): void {
  if (armed !== undefined && armed === name) {
    process.stderr.write(`loopvol: failpoint ${name}: killing this process\n`);
    process.kill(process.pid, 'SIGKILL');
  }
}
