/**
 * A network filesystem for tests of a shared pool: a private sshd on 127.0.0.1 and sshfs (FUSE) client
 * mounts of one export, one mount per simulated host. The kernel has no NFS client; sshfs stands in.
 *
 * Caching is turned off as far as sshfs 3.7 allows, so that what one client writes is what the next
 * open, stat or readdir on another client sees (the driver relies on close-to-open freshness and on
 * new or removed names being seen promptly), see SSHFS_FRESH_OPTIONS.
 *
 * Every mount can be hung: its sftp-server process (sshd runs one per connection, for the "sftp"
 * subsystem) is found exactly, by a variable that mount's ssh sends, and SIGSTOPped; a
 * process that then touches the mount blocks in the kernel (uninterruptibly, not even SIGKILL ends it,
 * once sshfs has read the request) until SIGCONT. Cleanup therefore resumes every stopped server first.
 */
import { type ChildProcess, execFileSync, spawn } from 'node:child_process';
import { accessSync, constants, existsSync } from 'node:fs';
import fs from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { leaksUnder, SLOW } from './host.js';

export const SSHD = '/usr/sbin/sshd';
const SFTP_SERVERS = [
  '/usr/lib/openssh/sftp-server',
  '/usr/libexec/openssh/sftp-server',
  '/usr/libexec/sftp-server',
];
/**
 * sshd's privilege separation directory (compiled in); it refuses to start without it, and needs it at
 * every connection. Made when missing and left there (it is the openssh-server package's own, made at
 * every boot): test files side by side each run an sshd, and one removing it would break the others'.
 */
const PRIVSEP_DIR = '/run/sshd';
/** The variable that tells the sftp-server of one mount from another's. */
const MARKER_VAR = 'LOOPVOL_SSHFS_MOUNT';

/**
 * sshfs options that turn its caches off (sshfs 3.7.3, libfuse 3.14):
 *  - dir_cache=no: sshfs's own cache of names, attributes and directory listings (default on, 20 s)
 *    would keep serving a listing without a file another client created, and the attributes (even
 *    existence) of a file another client removed or replaced;
 *  - attr_timeout=0, entry_timeout=0: the kernel asks again for a file's attributes and for what a
 *    name refers to at every use (defaults 1 s);
 *  - negative_timeout=0: "no such file" is never remembered (already the default; stated so it stays);
 *  - no kernel_cache and no auto_cache (the defaults): the page cache of a file is dropped at each
 *    open, which is close-to-open consistency for data.
 * Not used: reconnect (a test that hangs the server wants calls to hang, not to fail over),
 * direct_io (not needed for freshness: pages are dropped at open; the loop devices use O_DIRECT).
 */
export const SSHFS_FRESH_OPTIONS = [
  'dir_cache=no',
  'attr_timeout=0',
  'entry_timeout=0',
  'negative_timeout=0',
];

function onPath(cmd: string): string | undefined {
  for (const dir of (process.env.PATH ?? '/usr/sbin:/usr/bin:/sbin:/bin').split(':')) {
    const p = path.join(dir, cmd);
    try {
      accessSync(p, constants.X_OK);
      return p;
    } catch {
      // not here
    }
  }
  return undefined;
}

const sftpServerPath = (): string | undefined => SFTP_SERVERS.find((p) => existsSync(p));

/** Why sshfs tests cannot run here, or undefined when they can. */
export function sshfsUnavailable(): string | undefined {
  const missing: string[] = [];
  if (!existsSync(SSHD)) missing.push(SSHD);
  if (!sftpServerPath()) missing.push('sftp-server');
  for (const cmd of ['sshfs', 'ssh', 'ssh-keygen']) if (!onPath(cmd)) missing.push(cmd);
  if (!onPath('fusermount3') && !onPath('fusermount')) missing.push('fusermount3');
  if (!existsSync('/dev/fuse')) missing.push('/dev/fuse');
  return missing.length > 0 ? `missing: ${missing.join(', ')}` : undefined;
}

function sh(cmd: string, args: string[]): string {
  return execFileSync(cmd, args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.once('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const addr = srv.address();
      srv.close(() => {
        if (addr && typeof addr === 'object') resolve(addr.port);
        else reject(new Error('no port'));
      });
    });
  });
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** Whether the child has exited (it may still be a zombie until Node reaps it, so look at exitCode). */
const exited = (p: ChildProcess): boolean => p.exitCode !== null || p.signalCode !== null;

async function waitExit(p: ChildProcess, ms: number): Promise<boolean> {
  for (const deadline = Date.now() + ms; Date.now() < deadline;) {
    if (exited(p)) return true;
    await sleep(20);
  }
  return exited(p);
}

async function waitGone(pid: number, ms: number): Promise<boolean> {
  for (const deadline = Date.now() + ms; Date.now() < deadline;) {
    if (!alive(pid)) return true;
    await sleep(20);
  }
  return !alive(pid);
}

function unescapeMount(s: string): string {
  return s.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
}

/** The filesystem type mounted at `mountPoint` (the top one), or undefined. */
async function mountedType(mountPoint: string): Promise<string | undefined> {
  let type: string | undefined;
  for (const line of (await fs.readFile('/proc/self/mountinfo', 'utf8')).split('\n')) {
    const fields = line.split(' ');
    if (unescapeMount(fields[4] ?? '') !== mountPoint) continue;
    const sep = fields.indexOf('-');
    type = fields[sep + 1];
  }
  return type;
}

/** The sftp-server process whose session the client marked with `marker` (SetEnv, accepted by our sshd). */
async function sftpServerMarked(marker: string): Promise<number | undefined> {
  for (const name of await fs.readdir('/proc')) {
    if (!/^\d+$/.test(name)) continue;
    const comm = await fs.readFile(`/proc/${name}/comm`, 'utf8').catch(() => '');
    if (comm.trim() !== 'sftp-server') continue;
    const env = await fs.readFile(`/proc/${name}/environ`, 'utf8').catch(() => '');
    if (env.split('\0').includes(marker)) return Number(name);
  }
  return undefined;
}

export interface MountOptions {
  /** Let users other than root use the mount (root always can use its own). */
  allowOther?: boolean;
  /**
   * 'off' (the default): SSHFS_FRESH_OPTIONS. 'sshfs-defaults': sshfs's own caching, to show what it
   * hides from other clients.
   */
  cache?: 'off' | 'sshfs-defaults';
  /** More -o options. */
  extra?: string[];
}

export interface SshfsMount {
  readonly exportDir: string;
  readonly mountPoint: string;
  /** The sshfs process (foreground, a child of this process). */
  readonly sshfsPid: number;
  /** The sftp-server process that serves this mount alone. */
  readonly serverPid: number;
  /** The -o options it was mounted with. */
  readonly options: readonly string[];
  readonly hung: boolean;
  /** Stops the server side of this mount (SIGSTOP): every call that reaches the server blocks. */
  hang(): void;
  /** Resumes it (SIGCONT); blocked calls complete. */
  resume(): void;
  /** Resumes the server, unmounts (fusermount3 -u, then umount, then umount -l) and waits for sshfs to exit. */
  unmount(): Promise<void>;
  /**
   * The filesystem goes away and comes back, as a network mount does after its connection is lost:
   * detached lazily (umount -l) and mounted again at the same point by a new sshfs connection, whose
   * files have other device and inode numbers. Files opened before (a loop device's backing file) keep
   * the old connection, which ends when the last of them is closed; this mount's unmount() then only
   * waits for it (killing it after 5 s). Returns the new mount.
   */
  reconnect(): Promise<SshfsMount>;
}

export interface SshServer {
  readonly dir: string;
  readonly port: number;
  readonly pid: number;
  readonly mounts: readonly SshfsMount[];
  /** Mounts `exportDir` (absolute, on this host) at `mountPoint` (created if missing) through sftp. */
  mountExport(exportDir: string, mountPoint: string, opts?: MountOptions): Promise<SshfsMount>;
  /** SIGCONT for every mount's server: call it first in a teardown, before killing anything that may be blocked. */
  resumeAll(): void;
  /**
   * Resumes, detaches loop devices backed by files on its mounts that are still attached (returned, as
   * leaks), unmounts what is still mounted, stops sshd, removes its directory (and /run/sshd if it made it).
   */
  stop(): Promise<string[]>;
}

export async function startSshServer(): Promise<SshServer> {
  const sftpServer = sftpServerPath();
  if (!sftpServer) throw new Error('no sftp-server found');
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-sshd-'));
  let sshd: ChildProcess | undefined;
  try {
    const hostKey = path.join(dir, 'host_key');
    const clientKey = path.join(dir, 'client_key');
    sh('ssh-keygen', ['-q', '-N', '', '-t', 'ed25519', '-C', 'loopvol-test-host', '-f', hostKey]);
    sh('ssh-keygen', ['-q', '-N', '', '-t', 'ed25519', '-C', 'loopvol-test-client', '-f', clientKey]);
    const authorized = path.join(dir, 'authorized_keys');
    await fs.copyFile(`${clientKey}.pub`, authorized);
    await fs.chmod(authorized, 0o600);
    await fs.mkdir(PRIVSEP_DIR, { recursive: true, mode: 0o755 });
    const config = path.join(dir, 'sshd_config');
    let port = 0;
    let log = '';
    for (let attempt = 0; attempt < 5 && !sshd; attempt++) {
      port = await freePort();
      await fs.writeFile(
        config,
        [
          'ListenAddress 127.0.0.1',
          `Port ${port}`,
          `HostKey ${hostKey}`,
          `PidFile ${path.join(dir, 'sshd.pid')}`,
          'PermitRootLogin prohibit-password',
          'PubkeyAuthentication yes',
          `AuthorizedKeysFile ${authorized}`,
          'PasswordAuthentication no',
          'KbdInteractiveAuthentication no',
          'StrictModes no',
          'UsePAM no',
          'X11Forwarding no',
          'AllowTcpForwarding no',
          'PrintMotd no',
          'LogLevel INFO',
          // A separate process per mount: a test can stop the server of one mount and no other.
          `Subsystem sftp ${sftpServer}`,
          `AcceptEnv ${MARKER_VAR}`,
          '',
        ].join('\n'),
      );
      const p = spawn(SSHD, ['-D', '-e', '-f', config], { stdio: ['ignore', 'ignore', 'pipe'] });
      log = '';
      p.stderr.on('data', (d: Buffer) => (log += d.toString()));
      const deadline = Date.now() + 10_000 * SLOW;
      while (
        Date.now() < deadline &&
        !exited(p) &&
        !log.includes(`Server listening on 127.0.0.1 port ${port}`)
      )
        await sleep(20);
      if (!exited(p) && log.includes('Server listening')) sshd = p;
      else {
        p.kill('SIGKILL');
        await waitExit(p, 5000);
        if (!/Bind to port|Address already in use/.test(log)) break;
      }
    }
    if (!sshd) throw new Error(`sshd did not start: ${log}`);
    return makeServer(dir, port, sshd, clientKey);
  } catch (err) {
    if (sshd && !exited(sshd)) {
      sshd.kill('SIGKILL');
      await waitExit(sshd, 5000);
    }
    await fs.rm(dir, { recursive: true, force: true });
    throw err;
  }
}

function makeServer(dir: string, port: number, sshd: ChildProcess, clientKey: string): SshServer {
  const mounts: SshfsMount[] = [];
  const sshdPid = sshd.pid ?? -1;
  let mountCount = 0;

  async function mountExport(
    exportDir: string,
    mountPoint: string,
    opts: MountOptions = {},
  ): Promise<SshfsMount> {
    await fs.mkdir(mountPoint, { recursive: true });
    // sshfs runs ssh detached (double fork), so the connection of this mount is told apart by a
    // variable its ssh sends (SetEnv) and sshd puts in the environment of its sftp-server.
    const marker = `${MARKER_VAR}=${sshdPid}-${++mountCount}`;
    const options = [
      `ssh_command=ssh -o SetEnv=${marker}`,
      `IdentityFile=${clientKey}`,
      'IdentitiesOnly=yes',
      'BatchMode=yes',
      'StrictHostKeyChecking=no',
      'UserKnownHostsFile=/dev/null',
      'LogLevel=ERROR',
      `port=${port}`,
      ...(opts.cache === 'sshfs-defaults' ? [] : SSHFS_FRESH_OPTIONS),
      ...(opts.allowOther ? ['allow_other'] : []),
      ...(opts.extra ?? []),
    ];
    const proc = spawn('sshfs', [`root@127.0.0.1:${exportDir}`, mountPoint, '-f', '-o', options.join(',')], {
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    let err = '';
    proc.stderr.on('data', (d: Buffer) => (err += d.toString()));
    const sshfsPid = proc.pid ?? -1;
    const fail = async (why: string): Promise<never> => {
      if (!exited(proc)) {
        if ((await mountedType(mountPoint)) === 'fuse.sshfs') await unmountPath(mountPoint);
        proc.kill('SIGKILL');
        await waitExit(proc, 5000);
      }
      throw new Error(`sshfs mount of ${exportDir} at ${mountPoint}: ${why}: ${err}`);
    };
    const deadline = Date.now() + 15_000 * SLOW;
    while ((await mountedType(mountPoint)) !== 'fuse.sshfs') {
      if (exited(proc)) return fail(`sshfs exited (${String(proc.exitCode ?? proc.signalCode)})`);
      if (Date.now() > deadline) return fail('not mounted within 15 s');
      await sleep(20);
    }
    // The serving process: the sftp-server whose environment carries this mount's marker.
    let serverPid: number | undefined;
    while (serverPid === undefined && Date.now() < deadline) {
      serverPid = await sftpServerMarked(marker);
      if (serverPid === undefined) await sleep(20);
    }
    if (serverPid === undefined) return fail('could not find the sftp-server serving it');
    const server = serverPid;
    let hung = false;
    let mounted = true;
    const m: SshfsMount = {
      exportDir,
      mountPoint,
      sshfsPid,
      serverPid: server,
      options,
      get hung() {
        return hung;
      },
      hang() {
        process.kill(server, 'SIGSTOP');
        hung = true;
      },
      resume() {
        if (!hung) return;
        try {
          process.kill(server, 'SIGCONT');
        } catch {
          // gone already
        }
        hung = false;
      },
      async reconnect() {
        m.resume();
        sh('umount', ['-l', mountPoint]);
        mounted = false;
        return mountExport(exportDir, mountPoint, opts);
      },
      async unmount() {
        m.resume();
        if (mounted && (await mountedType(mountPoint)) === 'fuse.sshfs') await unmountPath(mountPoint);
        mounted = false;
        if (!(await waitExit(proc, 5000))) {
          proc.kill('SIGKILL');
          await waitExit(proc, 5000);
        }
        // Its session ends with the connection; a server that lingers is ours to end.
        if (!(await waitGone(server, 5000))) {
          process.kill(server, 'SIGKILL');
          await waitGone(server, 5000);
        }
        const i = mounts.indexOf(m);
        if (i >= 0) mounts.splice(i, 1);
      },
    };
    mounts.push(m);
    return m;
  }

  return {
    dir,
    port,
    pid: sshdPid,
    mounts,
    mountExport,
    resumeAll() {
      for (const m of mounts) m.resume();
    },
    async stop() {
      for (const m of mounts) m.resume();
      const leaks: string[] = [];
      const errors: unknown[] = [];
      for (const m of [...mounts]) {
        try {
          for (const line of (await leaksUnder(m.mountPoint)).loops) {
            leaks.push(line);
            try {
              sh('losetup', ['-d', line.split(' ')[0] ?? '']);
            } catch {
              // still held by a mount: the lazy unmount below lets it go with it
            }
          }
          await m.unmount();
        } catch (err) {
          errors.push(err);
        }
      }
      if (!exited(sshd)) {
        sshd.kill('SIGTERM');
        if (!(await waitExit(sshd, 5000))) {
          sshd.kill('SIGKILL');
          await waitExit(sshd, 5000);
        }
      }
      await fs.rm(dir, { recursive: true, force: true });
      if (errors.length > 0) throw new AggregateError(errors, 'stopping the sshfs test server');
      return leaks;
    },
  };
}

/** fusermount3 -u, then umount, then umount -l (the last resort for a busy mount). */
async function unmountPath(mountPoint: string): Promise<void> {
  const attempts: [string, string[]][] = [
    ['fusermount3', ['-u', mountPoint]],
    ['umount', [mountPoint]],
    ['umount', ['-l', mountPoint]],
  ];
  const errors: string[] = [];
  for (const [cmd, args] of attempts) {
    try {
      sh(cmd, args);
    } catch (err) {
      errors.push(`${cmd}: ${(err as { stderr?: string }).stderr?.trim() ?? String(err)}`);
    }
    if ((await mountedType(mountPoint)) !== 'fuse.sshfs') return;
  }
  throw new Error(`could not unmount ${mountPoint}: ${errors.join('; ')}`);
}
