/** Readiness as Probe uses it: one check shared by concurrent callers, reused for PROBE_REUSE_MS at most. */
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { PROBE_REUSE_MS, Readiness } from '../../src/health.js';
import type { Pool } from '../../src/pool/pool.js';
import { tempDir } from '../helpers/driver.js';

const savedPath = process.env.PATH;
const dirs: string[] = [];
afterAll(async () => {
  process.env.PATH = savedPath;
  for (const d of dirs) await fs.rm(d, { recursive: true, force: true });
});

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('Readiness', () => {
  it('shares one check among concurrent callers and notices a lost tool or pool within the reuse time', async () => {
    const bin = await tempDir('health');
    dirs.push(bin);
    const tool = `loopvol-test-tool-${process.pid}`;
    await fs.writeFile(path.join(bin, tool), '#!/bin/sh\n', { mode: 0o755 });
    process.env.PATH = `${bin}${path.delimiter}${savedPath ?? ''}`;
    let checks = 0;
    let poolProblem: string | undefined;
    const pool = {
      root: '/pool',
      checkUsable: async () => {
        checks++;
        await sleep(20);
        return poolProblem;
      },
    } as unknown as Pool;
    const readiness = new Readiness(() => pool, 'node', [tool]);

    const answers = await Promise.all(
      Array.from({ length: 32 }, () => readiness.problem(2000, PROBE_REUSE_MS)),
    );
    expect(answers.every((a) => a === undefined)).toBe(true);
    expect(checks).toBe(1);

    await fs.rm(path.join(bin, tool));
    await sleep(PROBE_REUSE_MS + 50);
    expect(await readiness.problem(2000, PROBE_REUSE_MS)).toContain(`missing tools: ${tool}`);

    await fs.writeFile(path.join(bin, tool), '#!/bin/sh\n', { mode: 0o755 });
    poolProblem = 'the pool directory /pool is not usable (ENOENT)';
    await sleep(PROBE_REUSE_MS + 50);
    const problem = await readiness.problem(2000, PROBE_REUSE_MS);
    expect(problem).toContain('/pool is not usable');
    expect(problem).not.toContain('missing tools');

    // Never reused when asked not to (/healthz).
    poolProblem = undefined;
    expect(await readiness.problem(2000, 0)).toBeUndefined();
  });
});
