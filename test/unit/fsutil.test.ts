/**
 * writeFilesAtomic: several records replaced side by side, appearing in the order given, with no temp
 * file left behind whatever fails; isTempName, to find the temp files of writers killed before that;
 * readText, and sideBySide. On real files in a temporary directory.
 */
import fs from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import {
  readText,
  isTempName,
  sideBySide,
  writeFileAtomic,
  writeFilesAtomic,
} from '../../src/pool/fsutil.js';

let dir: string;
beforeEach(async () => {
  dir = await fs.mkdtemp(path.join(os.tmpdir(), 'loopvol-fsutil-'));
  await fs.mkdir(path.join(dir, 'a'));
  await fs.mkdir(path.join(dir, 'b'));
});
afterEach(async () => {
  vi.restoreAllMocks();
  await fs.rm(dir, { recursive: true, force: true });
});

const everything = async (): Promise<string[]> =>
  (await fs.readdir(dir, { recursive: true })).map(String).sort();

describe('writeFilesAtomic', () => {
  it('replaces every file, renaming them in the order given, and leaves no temp file', async () => {
    const first = path.join(dir, 'a', 'copy.json');
    const second = path.join(dir, 'b', 'fences.json');
    await fs.writeFile(second, 'old\n');
    const renames: string[] = [];
    const rename = fs.rename.bind(fs);
    vi.spyOn(fs, 'rename').mockImplementation(async (from, to) => {
      renames.push(String(to));
      return rename(from, to);
    });
    await writeFilesAtomic([
      { file: first, data: '{"n":1}\n' },
      { file: second, data: '{"n":2}\n' },
    ]);
    expect(renames).toEqual([first, second]);
    expect(await fs.readFile(first, 'utf8')).toBe('{"n":1}\n');
    expect(await fs.readFile(second, 'utf8')).toBe('{"n":2}\n');
    expect(await everything()).toEqual(['a', 'a/copy.json', 'b', 'b/fences.json']);
  });

  it('renames nothing when one of the files cannot be written, and removes the temp files it wrote', async () => {
    const first = path.join(dir, 'a', 'copy.json');
    const second = path.join(dir, 'missing', 'fences.json');
    await fs.writeFile(first, 'old\n');
    await expect(
      writeFilesAtomic([
        { file: first, data: 'new\n' },
        { file: second, data: 'new\n' },
      ]),
    ).rejects.toThrow(/ENOENT/);
    expect(await fs.readFile(first, 'utf8')).toBe('old\n');
    expect(await everything()).toEqual(['a', 'a/copy.json', 'b']);
  });

  it('leaves a later file old when an earlier one could not be renamed, and no temp file', async () => {
    const first = path.join(dir, 'a', 'copy.json');
    const second = path.join(dir, 'b', 'fences.json');
    await fs.mkdir(first); // a directory where the first file goes: its rename fails
    await fs.writeFile(path.join(first, 'x'), '');
    await fs.writeFile(second, 'old\n');
    await expect(
      writeFilesAtomic([
        { file: first, data: 'new\n' },
        { file: second, data: 'new\n' },
      ]),
    ).rejects.toThrow();
    expect(await fs.readFile(second, 'utf8')).toBe('old\n');
    expect(await everything()).toEqual(['a', 'a/copy.json', 'a/copy.json/x', 'b', 'b/fences.json']);
  });
  it('renames nothing more once the check before a rename throws, and leaves no temp file', async () => {
    const first = path.join(dir, 'a', 'copy.json');
    const second = path.join(dir, 'b', 'fences.json');
    await fs.writeFile(second, 'old\n');
    let checks = 0;
    const write = writeFilesAtomic(
      [
        { file: first, data: 'new\n' },
        { file: second, data: 'new\n' },
      ],
      true,
      () => {
        if (++checks === 2) throw new Error('lock lost');
      },
    );
    await expect(write).rejects.toThrow(/lock lost/);
    expect(await fs.readFile(first, 'utf8')).toBe('new\n');
    expect(await fs.readFile(second, 'utf8')).toBe('old\n');
    expect(await everything()).toEqual(['a', 'a/copy.json', 'b', 'b/fences.json']);
  });
});

describe('isTempName', () => {
  it("tells the writer's own temporary files, and nothing else", async () => {
    // The name a writer gives its temp file, as a writer killed before its rename would leave it.
    const opened: string[] = [];
    const open = fs.open.bind(fs);
    vi.spyOn(fs, 'open').mockImplementation((file, ...rest) => {
      opened.push(String(file));
      return open(file, ...rest);
    });
    await writeFileAtomic(path.join(dir, 'a', 'meta.json'), '{}\n');
    vi.restoreAllMocks();
    const temp = opened.map((f) => path.basename(f)).find((f) => f.startsWith('.meta.json.'));
    if (!temp) throw new Error(`no temp file among ${opened.join(', ')}`);
    const names = [
      temp,
      'meta.json',
      '.meta.json.tmp-not-hex',
      `x${temp}`.replace(/^x\./, 'x'),
      `${temp}.bak`,
      '.meta.json.rsync-Xy12Ab',
      '.meta.json.tmp-0123456789abc',
    ];
    expect(names.map(isTempName)).toEqual([true, false, false, false, false, false, false]);
  });
});

describe('readText', () => {
  it('reads a record whole, an empty file, and a file larger than its first read', async () => {
    const small = path.join(dir, 'a', 'meta.json');
    await fs.writeFile(small, '{"n":1}\n');
    expect(await readText(small)).toBe('{"n":1}\n');
    const empty = path.join(dir, 'a', 'empty');
    await fs.writeFile(empty, '');
    expect(await readText(empty)).toBe('');
    // Multi-byte characters across the first read's end, and several reads after it.
    const large = `${'é'.repeat(50_000)}${'x'.repeat(7)}`;
    const big = path.join(dir, 'b', 'big.json');
    await fs.writeFile(big, large);
    expect(await readText(big)).toBe(large);
  });

  it('reads to the end a file whose size says otherwise (procfs says 0)', async () => {
    expect(await readText('/proc/version')).toBe(await fs.readFile('/proc/version', 'utf8'));
  });

  it('says ENOENT for a file that is not there, as fs.readFile does', async () => {
    await expect(readText(path.join(dir, 'a', 'absent'))).rejects.toMatchObject({ code: 'ENOENT' });
  });
});

describe('sideBySide', () => {
  it('throws the first failure in the order given, once every one has ended', async () => {
    const ended: string[] = [];
    const after = async <T>(ms: number, name: string, v: T | Error): Promise<T> => {
      await new Promise((r) => setTimeout(r, ms));
      ended.push(name);
      if (v instanceof Error) throw v;
      return v;
    };
    const first = after(40, 'first', new Error('first'));
    const second = after(5, 'second', new Error('second'));
    const third = after(60, 'third', 3);
    await expect(sideBySide(first, second, third)).rejects.toThrow('first');
    expect(ended).toEqual(['second', 'first', 'third']);
    expect(await sideBySide(after(5, 'a', 1), after(1, 'b', 'two'))).toEqual([1, 'two']);
  });
});
