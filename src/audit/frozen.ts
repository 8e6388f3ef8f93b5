/**
 * Whether a mounted filesystem is frozen (fsfreeze), found without thawing it.
 *
 * The kernel shows a freeze nowhere in /proc or /sys, so:
 *  - ext4 (with a journal, mounted read-write) says it in its superblock, read without touching the
 *    filesystem: a mounted ext4 keeps the RECOVER feature flag set (its journal may need replaying),
 *    and ext4_freeze clears it when it has flushed the journal, until the thaw sets it again. The
 *    superblock is read through the device (the block device's page cache holds ext4's own copy).
 *  - xfs and btrfs keep nothing of the kind. The one way to ask is to try: FIFREEZE on a frozen
 *    filesystem fails with EBUSY, and on one that is not frozen freezes it, which must then be undone
 *    at once. That is done only when the operator asks for it (`--probe-frozen`), and never for a
 *    filesystem frozen on purpose (fenced, or frozen for a copy that is running).
 */
import fs from 'node:fs/promises';
import { CommandError, detached, type Exec } from '../exec/runner.js';

export type FreezeState = 'frozen' | 'not-frozen' | 'unknown';

const EXT4_MAGIC = 0xef53;
const COMPAT_HAS_JOURNAL = 0x4;
const INCOMPAT_RECOVER = 0x4;

/** Reads an ext4 superblock (1024 bytes at offset 1024) and says whether it is frozen. */
export function ext4SuperblockState(sb: Buffer): FreezeState {
  if (sb.length < 0x64 || sb.readUInt16LE(0x38) !== EXT4_MAGIC) return 'unknown';
  if ((sb.readUInt32LE(0x5c) & COMPAT_HAS_JOURNAL) === 0) return 'unknown'; // no journal, no flag
  return (sb.readUInt32LE(0x60) & INCOMPAT_RECOVER) === 0 ? 'frozen' : 'not-frozen';
}

/** Whether the ext4 filesystem on `device`, mounted read-write, is frozen (read only). */
export async function ext4Frozen(device: string): Promise<FreezeState> {
  let handle;
  try {
    handle = await fs.open(device, 'r');
  } catch {
    return 'unknown';
  }
  try {
    const sb = Buffer.alloc(1024);
    const { bytesRead } = await handle.read(sb, 0, 1024, 1024);
    return ext4SuperblockState(sb.subarray(0, bytesRead));
  } catch {
    return 'unknown';
  } finally {
    await handle.close();
  }
}

/**
 * Asks by trying (see above): freezes the filesystem at `mountPoint` and thaws it at once, or learns
 * from EBUSY that it was frozen already. Only on the operator's request.
 */
export async function probeFrozen(x: Exec, mountPoint: string): Promise<FreezeState> {
  try {
    await x.run('fsfreeze', ['--freeze', mountPoint], { timeoutMs: 60_000, quiet: true });
  } catch (err) {
    if (err instanceof CommandError && err.reason === 'exit' && /busy/i.test(err.stderr)) return 'frozen';
    // Timed out or killed (also by the caller's deadline), fsfreeze may have frozen it before it ended:
    // thawed, as the node's own freezes are (a thaw of a filesystem that is not frozen changes nothing).
    await thaw(x, mountPoint, true).catch(() => undefined);
    return 'unknown';
  }
  // It was not frozen, and now is: thaw it, whatever the caller's deadline.
  await thaw(x, mountPoint, false);
  return 'not-frozen';
}

/**
 * Thaws the filesystem at `mountPoint`, free of the caller's deadline. A thaw killed by a signal is run
 * again: the operator's Ctrl-C reaches every process of the command's group, fsfreeze too, and the
 * command itself stays to let this thaw finish (src/cli/check.ts).
 */
async function thaw(x: Exec, mountPoint: string, quiet: boolean): Promise<void> {
  for (let attempt = 1; ; attempt++) {
    try {
      await detached(x, 60_000).run('fsfreeze', ['--unfreeze', mountPoint], { timeoutMs: 60_000, quiet });
      return;
    } catch (err) {
      // A thaw killed during its ioctl may have thawed all the same: the next one then finds nothing frozen.
      if (attempt > 1 && err instanceof CommandError && /Invalid argument/i.test(err.stderr)) return;
      const signalled = err instanceof CommandError && err.reason === 'spawn' && /^SIG/.test(err.why ?? '');
      if (!signalled || attempt >= 5) throw err;
    }
  }
}
