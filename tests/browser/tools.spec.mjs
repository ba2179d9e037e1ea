// Browser tests of tool approvals and blocked runs in the web UI (issue 6): playwright-core
// driving Debian's Chromium, like run.mjs. Started by tests/tests/tools.rs
// (`tools_web_ui_approvals_and_blocked_runs`), which brings up a stack whose worker asks for
// approval before `calculator` runs, and seeds a thread whose run is `blocked` on an uncertain
// operation.
//
// Environment (as run.mjs):
//   API_URL            the api (required; DEV_LOOPBACK_PRINCIPAL=true)
//   BLOCKED_THREAD_ID  the seeded thread with a blocked run (its test fails without it)
//   OUT_DIR            screenshots (default: <repo>/test-output/browser)
//   CHROMIUM           browser executable (default /usr/bin/chromium)
//   ONLY               run only tests whose name contains this text
//
// `tests` is exported so that a runner can import this file; run directly, it runs them and
// closes with "browser-tools: N passed, N failed" (exit status 0 only when all passed).

import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { runTests } from './harness.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const API = (process.env.API_URL || '').replace(/\/$/, '');
const OUT = resolve(process.env.OUT_DIR || join(HERE, '..', '..', 'test-output', 'browser'));
const BLOCKED = process.env.BLOCKED_THREAD_ID || '';
const EXE = process.env.CHROMIUM || '/usr/bin/chromium';
const T = 30_000;
const sel = id => `[data-testid="${id}"]`;
const mock = steps => `MOCK: ${JSON.stringify({ steps })}`;

function assert(cond, message) {
  if (!cond) throw new Error('assertion failed: ' + message);
}

async function shot(page, name) {
  const path = join(OUT, name);
  await page.screenshot({ path, fullPage: false });
  console.log(`  screenshot ${path}`);
}

const opened = [];

async function open(browser, name) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  page.setDefaultTimeout(T);
  const log = [];
  page.on('console', m => log.push(`[${m.type()}] ${m.text()}`));
  page.on('pageerror', e => log.push(`[pageerror] ${e.message}`));
  const t = { context, page, log, name };
  opened.push(t);
  await page.goto(API + '/');
  return t;
}

async function newThread(page) {
  await page.click(sel('new-thread'));
  await page.waitForFunction(() => location.hash.length > 1);
}

async function send(page, text) {
  await page.fill(sel('composer'), text);
  await page.click(sel('send'));
}

const lastOf = (page, role) => page.locator(`${sel('message')}[data-role="${role}"] > .bubble`).last().innerText();

export const tests = [
  {
    name: 'approve a tool call with edited arguments, and reject another with a reason',
    fn: async browser => {
      const t = await open(browser, 'tools-approvals');
      await newThread(t.page);
      await send(t.page, mock([{ toolCalls: [{ name: 'calculator', arguments: { expression: '6*7' } }] }, { text: 'Result: {{tool_result}}' }]));
      await t.page.waitForSelector(`${sel('run-status')}[data-status="waiting_approval"]`);
      const card = t.page.locator(sel('approval'));
      await card.waitFor();
      assert((await card.getAttribute('data-tool-name')) === 'calculator', 'the approval names the tool');
      const args = card.locator(sel('approval-arguments'));
      assert(JSON.parse(await args.inputValue()).expression === '6*7', 'the proposed arguments are shown');
      await args.fill('{"expression": "2*3"}');
      await shot(t.page, 'tools-01-approval-edited.png');
      await card.locator(sel('approve')).click();
      await t.page.waitForSelector(`${sel('run-status')}[data-status="completed"]`);
      await t.page.waitForSelector(sel('gate'), { state: 'hidden' });
      await t.page.waitForFunction(() => [...document.querySelectorAll('[data-testid="message"][data-role="assistant"]')]
        .some(e => e.innerText.includes('Result:')));
      const answer = (await lastOf(t.page, 'assistant')).trim();
      assert(answer.startsWith('Result: ') && answer.endsWith('6'), `the edited call ran: ${answer}`);
      // The result sits in the (collapsed) tool-call details: read its text content.
      const result = await t.page.locator(`${sel('message')}[data-role="tool"]`).last().textContent();
      assert(result.includes('edited the arguments'), `the result records the edit: ${result}`);
      await shot(t.page, 'tools-02-approved.png');

      await newThread(t.page);
      await send(t.page, mock([{ toolCalls: [{ name: 'calculator', arguments: { expression: '1+1' } }] }, { text: 'Model saw: {{tool_result}}' }]));
      const second = t.page.locator(sel('approval'));
      await second.waitFor();
      await second.locator(sel('reject-reason')).fill('not today');
      await second.locator(sel('reject')).click();
      await t.page.waitForSelector(`${sel('run-status')}[data-status="completed"]`);
      await t.page.waitForFunction(() => [...document.querySelectorAll('[data-testid="message"][data-role="assistant"]')]
        .some(e => e.innerText.includes('Model saw')));
      const seen = (await lastOf(t.page, 'assistant')).trim();
      assert(seen === 'Model saw: Tool call declined by the user. Reason: not today', `the model saw the rejection: ${seen}`);
      await shot(t.page, 'tools-03-rejected.png');
    },
  },
  {
    name: 'a blocked run shows its uncertain operation and continues when resolved',
    fn: async browser => {
      if (!BLOCKED) throw new Error('BLOCKED_THREAD_ID is not set');
      const t = await open(browser, 'tools-blocked');
      await t.page.goto(`${API}/#${BLOCKED}`);
      await t.page.waitForSelector(`${sel('run-status')}[data-status="blocked"]`);
      const op = t.page.locator(sel('operation'));
      await op.waitFor();
      assert((await op.getAttribute('data-tool-name')) === 'record_effect', 'the operation names the tool');
      const blocker = await t.page.locator(sel('blocker')).innerText();
      assert(blocker.includes('unknown'), `the blocker is explained: ${blocker}`);
      // Waited for: the approvals panel is drawn again when the live stream connects, and on a
      // loaded machine the check fell between two draws (CI at f7dba6f).
      for (const outcome of ['completed', 'failed', 'retry']) {
        await op.locator(sel('resolve-' + outcome)).waitFor({ state: 'visible', timeout: 10_000 });
      }
      await shot(t.page, 'tools-04-blocked.png');
      await op.locator(sel('resolve-result')).fill('ticket 7 exists');
      await op.locator(sel('resolve-completed')).click();
      await t.page.waitForSelector(`${sel('run-status')}[data-status="completed"]`);
      await t.page.waitForSelector(sel('gate'), { state: 'hidden' });
      await t.page.waitForFunction(() => [...document.querySelectorAll('[data-testid="message"][data-role="assistant"]')]
        .some(e => e.innerText.includes('final:')));
      const answer = (await lastOf(t.page, 'assistant')).trim();
      assert(answer === 'final: ticket 7 exists', `the run continued with the resolved result: ${answer}`);
      await shot(t.page, 'tools-05-resolved.png');
      // Editing the turn whose answer made the call asks first: the call took effect (the server
      // answers 409 effects_in_branch; the dialog names the tool; Cancel replaces nothing).
      const turn = t.page.locator(`${sel('message')}[data-role="user"]`).first();
      const before = await t.page.locator(sel('message')).count();
      await turn.hover();
      await turn.locator(`.acts ${sel('edit')}`).click();
      await t.page.locator(sel('edit-input')).fill('the same, with a typo fixed');
      await t.page.locator(sel('edit-save')).click();
      const dialog = t.page.locator(sel('confirm-dialog'));
      await dialog.waitFor();
      const asked = await dialog.innerText();
      assert(asked.includes('record_effect'), `the dialog names the tool: ${asked}`);
      await shot(t.page, 'tools-06-effects-confirm.png');
      await t.page.click(sel('confirm-cancel'));
      await dialog.waitFor({ state: 'hidden' });
      assert(await t.page.locator(sel('message')).count() === before, 'cancel replaced nothing');
    },
  },
];

async function main() {
  await runTests({ label: 'browser-tools', tests, opened, api: API, out: OUT, exe: EXE });
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) await main();
