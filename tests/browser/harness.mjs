// Shared runner of the browser spec files (run.mjs, branches.spec.mjs, tools.spec.mjs):
// launches Debian's Chromium through playwright-core and runs a list of `{name, fn}` tests,
// printing `ok`/`FAIL` lines and closing with "<label>: N passed, N failed"; exit status 0 only
// when all passed. A failing test leaves a screenshot and the console log of every page it
// opened (the spec file pushes `{name, page, context, log}` onto `opened`).

import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import { chromium } from 'playwright-core';

/** Chromium flags that work in this sandbox (no GPU, no network beyond loopback). */
export const ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
  '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-quic'];

/** Runs `tests` (filtered by the ONLY environment variable) and exits the process. */
export async function runTests({ label, tests, opened, api, out, exe }) {
  if (!api) {
    console.error('API_URL is required');
    process.exit(2);
  }
  mkdirSync(out, { recursive: true });
  const browser = await chromium.launch({ executablePath: exe, args: ARGS, headless: true });
  console.log(`chromium ${browser.version()} · api ${api} · screenshots in ${out}`);
  let passed = 0, failed = 0;
  for (const { name, fn } of tests) {
    if (process.env.ONLY && !name.includes(process.env.ONLY)) continue;
    const started = Date.now();
    opened.length = 0;
    try {
      await fn(browser);
      passed += 1;
      console.log(`ok   ${name} (${Date.now() - started} ms)`);
    } catch (e) {
      failed += 1;
      console.log(`FAIL ${name} (${Date.now() - started} ms)\n  ${e && e.stack ? e.stack : e}`);
      for (const t of opened) {
        await t.page.screenshot({ path: join(out, `FAILED-${t.name}.png`) }).catch(() => {});
        console.log(t.log.map(l => `  console(${t.name}) ${l}`).join('\n'));
      }
    } finally {
      for (const t of opened) await t.context.close().catch(() => {});
    }
  }
  await browser.close();
  console.log(`${label}: ${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}
