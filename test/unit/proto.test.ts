import { execFileSync } from 'node:child_process';
import fs from 'node:fs/promises';
import path from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { REDACTED, requestRedactor, secretFields } from '../../src/server/proto.js';
import { REPO, tempDir } from '../helpers/driver.js';

const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await fs.rm(d, { recursive: true, force: true });
});

async function listFiles(dir: string, prefix = ''): Promise<string[]> {
  const out: string[] = [];
  for (const e of await fs.readdir(dir, { withFileTypes: true })) {
    const rel = path.join(prefix, e.name);
    if (e.isDirectory()) out.push(...(await listFiles(path.join(dir, e.name), rel)));
    else out.push(rel);
  }
  return out.sort();
}

describe('the vendored proto', () => {
  it('is csi.proto v1.12.0 unchanged', async () => {
    const ours = await fs.readFile(path.join(REPO, 'proto', 'csi.proto'), 'utf8');
    expect(ours).toContain('package csi.v1;');
    const shared = path.join(REPO, '..', 'shared', 'csi-spec', 'csi.proto');
    const theirs = await fs.readFile(shared, 'utf8').catch(() => undefined);
    if (theirs !== undefined) expect(ours).toBe(theirs);
  });

  it('matches the checked-in generated types (npm run gen)', async () => {
    const dir = await tempDir('gen');
    dirs.push(dir);
    const pkg = JSON.parse(await fs.readFile(path.join(REPO, 'package.json'), 'utf8')) as {
      scripts: { gen: string };
    };
    const args = pkg.scripts.gen
      .split(' ')
      .slice(1)
      .map((a) => (a.startsWith('--outDir=') ? `--outDir=${dir}` : a));
    execFileSync(path.join(REPO, 'node_modules', '.bin', 'proto-loader-gen-types'), args, { cwd: REPO });
    const generated = await listFiles(dir);
    const committed = await listFiles(path.join(REPO, 'src', 'gen'));
    expect(committed).toEqual(generated);
    for (const f of generated) {
      expect(await fs.readFile(path.join(REPO, 'src', 'gen', f), 'utf8'), f).toBe(
        await fs.readFile(path.join(dir, f), 'utf8'),
      );
    }
  });
});

describe('secret redaction', () => {
  it('finds the csi_secret fields in the proto itself', async () => {
    const fields = secretFields();
    const text = await fs.readFile(path.join(REPO, 'proto', 'csi.proto'), 'utf8');
    expect(fields).toHaveLength(text.match(/\(csi_secret\) = true/g)?.length ?? -1);
    expect(fields).toContain('csi.v1.CreateVolumeRequest.secrets');
    expect(fields).toContain('csi.v1.NodeStageVolumeRequest.secrets');
    expect(fields).toContain('csi.v1.ControllerModifyVolumeRequest.secrets');
    for (const f of fields) expect(f).toMatch(/\.secrets$/);
  });

  it('redacts secrets and keeps everything else', () => {
    const redact = requestRedactor('Controller', 'CreateVolume');
    const out = redact({
      name: 'pvc-1',
      secrets: { password: 'hunter2' },
      parameters: { allocation: 'sparse' },
    }) as Record<string, unknown>;
    expect(out).toEqual({ name: 'pvc-1', secrets: REDACTED, parameters: { allocation: 'sparse' } });
    expect(JSON.stringify(out)).not.toContain('hunter2');
    const empty = redact({ name: 'x', secrets: {} }) as Record<string, unknown>;
    expect(empty.secrets).toEqual({});
  });

  it('redacts the secrets of every request that has them, by the names the proto gives them', async () => {
    const services = ['Identity', 'Controller', 'Node', 'GroupController', 'SnapshotMetadata'];
    // Read from the proto's text, not from the parser that made the plans: a field as requests name it.
    const text = await fs.readFile(path.join(REPO, 'proto', 'csi.proto'), 'utf8');
    const marked: string[] = [];
    let message = '';
    // A field's options may continue on the next line.
    for (const line of text.replace(/\n\s+\[/g, ' [').split('\n')) {
      message = /^message (\w+)/.exec(line)?.[1] ?? message;
      const field = /(\w+) = \d+ \[[^\]]*\(csi_secret\) = true/.exec(line)?.[1];
      if (field) marked.push(`csi.v1.${message}.${field}`);
    }
    expect(marked.sort()).toEqual(secretFields());
    for (const field of marked) {
      const [, , message = '', name = ''] = field.split('.');
      const method = message.replace(/Request$/, '');
      const found = services.flatMap((s) => {
        try {
          return [requestRedactor(s, method)];
        } catch {
          return [];
        }
      });
      expect(found, field).toHaveLength(1);
      const out = found[0]?.({ [name]: { token: 'hunter2' }, volume_id: 'v' });
      expect(out, field).toEqual({ [name]: REDACTED, volume_id: 'v' });
    }
  });
});
