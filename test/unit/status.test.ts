import { status } from '@grpc/grpc-js';
import { describe, expect, it } from 'vitest';
import { CsiError, type ErrorKind } from '../../src/errors.js';
import { CommandError } from '../../src/exec/runner.js';
import { toStatus } from '../../src/server/status.js';

describe('toStatus', () => {
  it.each<[ErrorKind, status]>([
    ['invalid_argument', status.INVALID_ARGUMENT],
    ['not_found', status.NOT_FOUND],
    ['already_exists', status.ALREADY_EXISTS],
    ['failed_precondition', status.FAILED_PRECONDITION],
    ['out_of_range', status.OUT_OF_RANGE],
    ['resource_exhausted', status.RESOURCE_EXHAUSTED],
    ['aborted', status.ABORTED],
    ['unimplemented', status.UNIMPLEMENTED],
  ])('maps %s to its code and keeps the message', (kind, code) => {
    const s = toStatus(new CsiError(kind, 'Volume x does not exist.'));
    expect(s).toEqual({ code, message: 'Volume x does not exist.', unexpected: false });
  });

  it('maps out-of-space errors from the filesystem to RESOURCE_EXHAUSTED', () => {
    for (const code of ['ENOSPC', 'EDQUOT']) {
      const err = Object.assign(new Error(`${code}: no space left`), { code });
      expect(toStatus(err).code).toBe(status.RESOURCE_EXHAUSTED);
    }
  });

  it('maps a pool filesystem that does not answer (a FUSE or NFS client cut off) to UNAVAILABLE', () => {
    for (const code of ['ENOTCONN', 'ESTALE', 'EHOSTDOWN', 'EHOSTUNREACH', 'ENETUNREACH', 'ETIMEDOUT']) {
      const err = Object.assign(new Error(`${code}: lstat '/pool/volumes/x/disk.img'`), {
        code,
        path: '/pool/volumes/x/disk.img',
      });
      expect(toStatus(err)).toMatchObject({ code: status.UNAVAILABLE, unexpected: true });
      expect(toStatus(err).message).toContain(`(${code} at /pool/volumes/x/disk.img)`);
    }
    const other = Object.assign(new Error('EACCES: permission denied'), { code: 'EACCES' });
    expect(toStatus(other).code).toBe(status.INTERNAL);
  });

  it('maps a command that ran out of space to RESOURCE_EXHAUSTED', () => {
    const err = new CommandError(
      'cp',
      ['a', 'b'],
      1,
      "cp: error writing 'b': No space left on device",
      'exit',
      'cp failed',
    );
    expect(toStatus(err).code).toBe(status.RESOURCE_EXHAUSTED);
  });

  it('hides unexpected errors behind a generic INTERNAL message', () => {
    const s = toStatus(
      new TypeError('cannot read properties of undefined (reading "x") at /src/secret/path.ts:12'),
    );
    expect(s.code).toBe(status.INTERNAL);
    expect(s.unexpected).toBe(true);
    expect(s.message).not.toContain('/src/');
    const cmd = toStatus(
      new CommandError(
        'mkfs.ext4',
        ['/dev/loop0'],
        1,
        'stderr details',
        'exit',
        'mkfs.ext4 exited with status 1',
      ),
    );
    expect(cmd.code).toBe(status.INTERNAL);
    expect(cmd.message).not.toContain('stderr details');
  });

  it('maps a command that ran out of time to DEADLINE_EXCEEDED', () => {
    const s = toStatus(new CommandError('mkfs.xfs', [], undefined, '', 'timeout', 'timed out'));
    expect(s.code).toBe(status.DEADLINE_EXCEEDED);
  });
});
