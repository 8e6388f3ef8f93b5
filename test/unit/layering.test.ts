/**
 * The layers of src/, as the import statements show them. The kernel (host/), the pool (pool/) and
 * the command runner (exec/) know nothing of the node algorithms (node/), the CSI services (csi/) or
 * the gRPC server (server/); the node algorithms know nothing of CSI or gRPC; the server knows nothing
 * of the services it serves. Directories import each other without a cycle. A file over 400 lines says
 * why in its first comment ("long: <reason>"), or is split.
 *
 * A directory of src/ is one unit; a file directly in src/ (errors.ts, config.ts, driver.ts...) is a
 * unit of its own, since those files are not one layer (driver.ts wires everything, errors.ts is used
 * by everything). Generated code (src/gen/) is not read: it imports nothing of ours.
 */
import fs from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import ts from 'typescript';
import { describe, expect, it } from 'vitest';

const SRC = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', 'src');
const MAX_LINES = 400;

interface Source {
  /** Relative to the repository: "src/node/stage.ts". */
  file: string;
  text: string;
  /** The files of ours it imports (type-only imports and re-exports too), as "src/..." paths. */
  imports: string[];
}

async function sources(dir = SRC): Promise<Source[]> {
  const out: Source[] = [];
  for (const entry of await fs.readdir(dir, { withFileTypes: true })) {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) {
      if (full !== path.join(SRC, 'gen')) out.push(...(await sources(full)));
    } else if (entry.name.endsWith('.ts')) {
      const text = await fs.readFile(full, 'utf8');
      out.push({ file: path.relative(path.dirname(SRC), full), text, imports: importsOf(full, text) });
    }
  }
  return out;
}

/** TypeScript's own reading of a file's imports (static, dynamic, `export ... from`), comments excluded. */
function importsOf(full: string, text: string): string[] {
  return ts
    .preProcessFile(text, true, true)
    .importedFiles.map((f) => f.fileName)
    .filter((spec) => spec.startsWith('.'))
    .map((spec) => path.relative(path.dirname(SRC), path.resolve(path.dirname(full), spec)))
    .map((p) => p.replace(/\.js$/, '.ts'));
}

/** "src/node" for src/node/stage.ts; the file itself for one directly in src/. */
function unitOf(file: string): string {
  const parts = file.split('/');
  return parts.length > 2 ? parts.slice(0, 2).join('/') : file;
}

/** Directed edges between units, each with one import that makes it (for the message). */
function unitGraph(all: readonly Source[]): Map<string, Map<string, string>> {
  const graph = new Map<string, Map<string, string>>();
  for (const s of all) {
    for (const imported of s.imports) {
      const [from, to] = [unitOf(s.file), unitOf(imported)];
      if (from === to) continue;
      const edges = graph.get(from) ?? new Map<string, string>();
      if (!edges.has(to)) edges.set(to, `${s.file} → ${imported}`);
      graph.set(from, edges);
    }
  }
  return graph;
}

/** A cycle in `graph` as the units along it (first repeated last), or [] when there is none. */
function findCycle(graph: ReadonlyMap<string, ReadonlyMap<string, unknown>>): string[] {
  const done = new Set<string>();
  const stack: string[] = [];
  const visit = (u: string): string[] => {
    const at = stack.indexOf(u);
    if (at >= 0) return [...stack.slice(at), u];
    if (done.has(u)) return [];
    stack.push(u);
    for (const v of graph.get(u)?.keys() ?? []) {
      const cycle = visit(v);
      if (cycle.length > 0) return cycle;
    }
    stack.pop();
    done.add(u);
    return [];
  };
  for (const u of [...graph.keys()].sort()) {
    const cycle = visit(u);
    if (cycle.length > 0) return cycle;
  }
  return [];
}

const all = await sources();

describe('the import graph of src/', () => {
  it('is read from every source file outside src/gen', () => {
    expect(all.length).toBeGreaterThan(30);
    expect(all.some((s) => s.file.startsWith('src/gen/'))).toBe(false);
    const node = all.find((s) => s.file === 'src/csi/node.ts');
    // Multi-line, type-only and value imports are all seen.
    expect(node?.imports).toEqual(
      expect.arrayContaining(['src/node/stage.ts', 'src/node/on-host.ts', 'src/gen/csi/v1/Node.ts']),
    );
  });

  it.each<[string[], string[]]>([
    [
      ['src/host', 'src/pool', 'src/exec'],
      ['src/node', 'src/csi', 'src/server'],
    ],
    [['src/node'], ['src/csi', 'src/server']],
    [['src/server'], ['src/csi']],
  ])('%j import nothing from %j', (lower, upper) => {
    const violations = all.flatMap((s) =>
      lower.includes(unitOf(s.file))
        ? s.imports.filter((i) => upper.includes(unitOf(i))).map((i) => `${s.file} → ${i}`)
        : [],
    );
    expect(violations).toEqual([]);
  });

  it('has no cycle between directories', () => {
    const graph = unitGraph(all);
    const cycle = findCycle(graph);
    const through = cycle.slice(1).map((to, i) => graph.get(cycle[i] ?? '')?.get(to));
    expect({ cycle, through }).toEqual({ cycle: [], through: [] });
  });

  it('finds a cycle when there is one (the check above can fail)', () => {
    const graph = new Map([
      ['a', new Map([['b', '']])],
      ['b', new Map([['c', '']])],
      ['c', new Map([['a', '']])],
    ]);
    expect(findCycle(graph)).toEqual(['a', 'b', 'c', 'a']);
    expect(findCycle(new Map([['a', new Map([['b', '']])]]))).toEqual([]);
  });
});

describe('file length', () => {
  /** The file's first comment: a /** block, or the // lines it starts with. */
  const firstComment = (text: string): string => /^\s*(\/\*[\s\S]*?\*\/|(?:\/\/.*\n)+)/.exec(text)?.[1] ?? '';

  it(`keeps every file of src/ within ${MAX_LINES} lines, unless its first comment says "long:" why`, () => {
    const linesOf = (text: string): number => text.split('\n').length - (text.endsWith('\n') ? 1 : 0);
    const over = all
      .filter((s) => linesOf(s.text) > MAX_LINES && !firstComment(s.text).includes('long:'))
      .map((s) => `${s.file}: ${linesOf(s.text)} lines`);
    expect(over).toEqual([]);
  });
});
