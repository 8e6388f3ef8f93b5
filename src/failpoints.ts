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

/**
 * Pause points for tests: LOOPVOL_PAUSEPOINT="<name>:<ms>" makes the process wait there, so a test can
 * let a caller's deadline pass (or cancel the call) exactly between two steps. Unset in production.
 */
const pausing = /^([a-z:-]+):(\d+)$/.exec(process.env.LOOPVOL_PAUSEPOINT ?? '');

export async function pausepoint(name: string): Promise<void> {
  if (pausing?.[1] !== name) return;
  process.stderr.write(`loopvol: pausepoint ${name}: waiting ${pausing[2]} ms\n`);
  await new Promise((r) => setTimeout(r, Number(pausing[2])));
}
