// Bundles the UI (src/main.js + its CSS and npm dependencies) into api/static/ui/app.{js,css},
// which the api embeds (api/src/routes/ui.rs). Offline and deterministic: the same lockfile
// gives the same bytes. `--check` builds in memory and exits 1 if the committed files differ
// (.ci/run runs it after `npm ci`).
import { build } from 'esbuild';
import { readFileSync, writeFileSync, mkdirSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const OUT = join(HERE, '..', 'api', 'static', 'ui');
const check = process.argv.includes('--check');

const result = await build({
  absWorkingDir: HERE,
  entryPoints: [join(HERE, 'src', 'main.js')],
  bundle: true,
  format: 'esm',
  target: ['es2020', 'chrome100', 'firefox100', 'safari15'],
  minify: true,
  legalComments: 'eof',
  charset: 'utf8',
  outdir: OUT,
  entryNames: 'app',
  write: false,
  logLevel: 'warning',
});

let stale = 0;
mkdirSync(OUT, { recursive: true });
for (const file of result.outputFiles) {
  const name = file.path.split('/').pop();
  const path = join(OUT, name);
  let old = null;
  try { old = readFileSync(path); } catch (_) { old = null; }
  const same = old && Buffer.compare(old, Buffer.from(file.contents)) === 0;
  if (check) {
    if (!same) { stale += 1; console.error(`api/static/ui/${name} differs from a fresh build: run (cd ui && npm ci && npm run build) and commit it`); }
  } else if (!same) {
    writeFileSync(path, file.contents);
    console.log(`wrote api/static/ui/${name} (${file.contents.length} bytes)`);
  } else {
    console.log(`api/static/ui/${name} unchanged (${file.contents.length} bytes)`);
  }
}
if (check) console.log(stale ? `${stale} stale file(s)` : 'api/static/ui matches a fresh build');
process.exit(stale ? 1 : 0);
