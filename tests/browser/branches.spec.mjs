// Browser tests of branches, compaction and queued turns in the web UI: playwright-core driving
// Debian's Chromium, like run.mjs. Started by tests/tests/browser.rs after run.mjs, on the same
// stack (api with DEV_LOOPBACK_PRINCIPAL=true, a worker, the scripted mock model: "What is
// 12*7?" makes it call the calculator, a plain text is answered "You said: ...", and it answers
// summarisation requests by itself).
//
// Environment (as run.mjs):
//   API_URL   the api (required)
//   OUT_DIR   screenshots (default: <repo>/test-output/browser)
//   CHROMIUM  browser executable (default /usr/bin/chromium)
//   ONLY      run only tests whose name contains this text
//
// `tests` is exported so that a runner can import this file; run directly, it runs them and
// closes with "browser-branches: N passed, N failed" (exit status 0 only when all passed).

import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { runTests } from './harness.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const API = (process.env.API_URL || '').replace(/\/$/, '');
const OUT = resolve(process.env.OUT_DIR || join(HERE, '..', '..', 'test-output', 'browser'));
const EXE = process.env.CHROMIUM || '/usr/bin/chromium';
const T = 30_000;
const sel = id => `[data-testid="${id}"]`;
const sleep = ms => new Promise(r => setTimeout(r, ms));
const words = (n, tag) => Array.from({ length: n }, (_, i) => `${tag}${i + 1}`).join(' ');
const slow = (text, chunkDelayMs) => `MOCK: ${JSON.stringify({ steps: [{ text, chunkDelayMs }] })}`;
// Long text without digits or operators (the mock answers it "You said: ..."; it gives a
// compaction something to summarise).
const notes = tag => `${tag}: ` + 'alpha beta gamma delta epsilon zeta eta theta '.repeat(20).trim();

function assert(cond, message) {
  if (!cond) throw new Error('assertion failed: ' + message);
}

async function shot(page, name) {
  const path = join(OUT, name);
  await page.screenshot({ path, fullPage: false });
  console.log(`  screenshot ${path}`);
}

const opened = [];

async function open(browser, name, hash = '') {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  page.setDefaultTimeout(T);
  const log = [];
  page.on('console', m => log.push(`[${m.type()}] ${m.text()}`));
  page.on('pageerror', e => log.push(`[pageerror] ${e.message}`));
  const t = { context, page, log, name };
  opened.push(t);
  await page.goto(API + '/' + hash);
  await page.waitForSelector(`${sel('transport')}[data-transport="sse"]`, { timeout: 20_000 }).catch(() => {});
  return t;
}

async function newThread(page) {
  await page.click(sel('new-thread'));
  await page.waitForFunction(() => location.hash.length > 1);
  await page.waitForSelector(`${sel('transport')}[data-transport="sse"]`, { timeout: 20_000 });
  return page.evaluate(() => location.hash.slice(1));
}

async function send(page, text) {
  await page.fill(sel('composer'), text);
  await page.click(sel('send'));
}

/// The messages shown, in page order: {seq, role, text} (text of the bubble, else the node).
async function shown(page) {
  return page.$$eval(sel('message'), els => els.map(e => ({
    seq: Number(e.dataset.sequence), role: e.dataset.role,
    // A tool result sits in its (collapsed) call: its text content.
    text: e.dataset.role === 'tool' ? e.textContent.trim() : (e.querySelector('.bubble') || e).textContent.trim(),
  })));
}

async function until(what, fn, timeout = T) {
  const deadline = Date.now() + timeout;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > deadline) throw new Error('timed out waiting for ' + what);
    await sleep(100);
  }
}

/// Waits for a message of `role` with exactly `text` and a sequence above `after`; returns it.
async function waitMessage(page, role, text, after = 0) {
  return until(`${role} "${text.slice(0, 60)}" after #${after}`,
    async () => (await shown(page)).find(m => m.role === role && m.text === text && m.seq > after));
}

async function waitCompleted(page) {
  await page.waitForSelector(`${sel('run-status')}[data-status="completed"]`);
}

/// Clicks a message action (they show when the message is hovered).
async function act(page, seq, action) {
  const msg = page.locator(`${sel('message')}[data-sequence="${seq}"]`);
  await msg.hover();
  await msg.locator(`.acts ${sel(action)}`).click();
  if (action === 'delete') await page.locator(sel('confirm-ok')).click(); // delete asks to confirm
  return msg;
}

async function patchMetadata(page, thread, metadata) {
  const status = await page.evaluate(async ([id, metadata]) => (await fetch('/api/threads/' + id, {
    method: 'PATCH', headers: { 'content-type': 'application/json', 'X-Requested-With': 'agentloop' }, body: JSON.stringify({ metadata }),
  })).status, [thread, metadata]);
  assert(status === 200, `PATCH metadata: ${status}`);
}

export const tests = [
  {
    name: 'edit, regenerate and delete messages, then compact the thread',
    fn: async browser => {
      const a = await open(browser, 'branches');
      const page = a.page;
      const thread = await newThread(page);
      // Something worth summarising later, then the calculator question.
      const first = notes('Notes for later');
      await send(page, first);
      await waitMessage(page, 'assistant', 'You said: ' + first);
      await waitCompleted(page);
      await send(page, 'What is 12*7?');
      const old = await waitMessage(page, 'assistant', 'The result is 84.');
      await waitCompleted(page);
      const question = (await shown(page)).find(m => m.role === 'user' && m.text === 'What is 12*7?');
      assert(question, 'the question is shown');

      // Edit the question: the old branch (question, call, result, answer) is replaced.
      await act(page, question.seq, 'edit');
      const input = page.locator(sel('edit-input'));
      assert((await input.inputValue()) === 'What is 12*7?', 'the editor starts with the message text');
      await input.fill('What is 6*7?');
      await page.locator(sel('edit-save')).click();
      const answer = await waitMessage(page, 'assistant', 'The result is 42.', old.seq);
      await waitCompleted(page);
      let now = await shown(page);
      assert(!now.some(m => m.seq >= question.seq && m.seq <= old.seq), `the old branch is gone: ${JSON.stringify(now.map(m => m.seq))}`);
      assert(!now.some(m => m.text.includes('84') || m.text === 'What is 12*7?'), 'nothing of the old branch is shown');
      assert(now.filter(m => m.role === 'user' && m.text === 'What is 6*7?').length === 1, 'the edited question is shown once');
      assert(now.some(m => m.role === 'tool' && m.text.trim() === '42'), 'the new branch has its tool result');
      await page.locator(`${sel('message')}[data-sequence="${answer.seq}"]`).hover();
      await shot(page, '05-branches.png');

      // Regenerate the answer: a new message (higher sequence) replaces it.
      await act(page, answer.seq, 'regenerate');
      const again = await waitMessage(page, 'assistant', 'The result is 42.', answer.seq);
      await waitCompleted(page);
      now = await shown(page);
      assert(!now.some(m => m.seq === answer.seq), 'the regenerated answer left the view');
      assert(now.filter(m => m.role === 'assistant' && m.text === 'The result is 42.').length === 1, 'one answer is shown');

      // While a run is active, branch operations are refused: the 409 shows inline.
      const slowText = words(40, 's');
      await send(page, slow(slowText, 150));
      await page.waitForSelector(`${sel('run-status')}[data-status="running"]`);
      const refused = await act(page, again.seq, 'delete');
      const error = refused.locator(sel('action-error'));
      await error.waitFor();
      assert((await error.innerText()).includes('run_active'), `inline 409: ${await error.innerText()}`);
      await shot(page, '05-branch-refused.png');
      const slowAnswer = await waitMessage(page, 'assistant', slowText);
      await waitCompleted(page);

      // Delete a message; a second browser on the same thread sees it go too.
      const b = await open(browser, 'branches-second', '#' + thread);
      await b.page.waitForSelector(`${sel('message')}[data-sequence="${slowAnswer.seq}"]`);
      await act(page, slowAnswer.seq, 'delete');
      await page.waitForSelector(`${sel('message')}[data-sequence="${slowAnswer.seq}"]`, { state: 'detached' });
      await b.page.waitForSelector(`${sel('message')}[data-sequence="${slowAnswer.seq}"]`, { state: 'detached' });
      assert(await page.locator(`${sel('message')}[data-sequence="${again.seq}"]`).count() === 1, 'the other messages stay');
      assert(!(await page.locator(sel('action-error')).count()), 'the earlier inline error is gone after a successful action');
      await shot(b.page, '05-deleted-second-browser.png');

      // Compact: a child thread with the summary and the recent tail; the parent is untouched.
      await patchMetadata(page, thread, { compactRecentMessages: 4 });
      const before = await shown(page);
      const parentTitle = await page.innerText(sel('thread-title'));
      await page.click(sel('compact'));
      await page.waitForFunction(id => location.hash.length > 1 && location.hash !== '#' + id, thread);
      const child = await page.evaluate(() => location.hash.slice(1));
      const summary = await until('the summary in the child thread', async () =>
        (await shown(page)).find(m => m.role === 'system' && m.text.startsWith('Summary of the earlier conversation')));
      await waitCompleted(page);
      const kids = await shown(page);
      assert(summary.text.includes('Notes for later'), `the summary covers the notes: ${summary.text.slice(0, 120)}`);
      // compactRecentMessages 4: the tail starts at the calculator call (a tool group is never split).
      assert(kids.some(m => m.role === 'assistant' && m.text === 'The result is 42.') && kids.some(m => m.role === 'tool' && m.text === '42'),
        `the recent tail is kept verbatim: ${JSON.stringify(kids.map(m => [m.role, m.text.slice(0, 30)]))}`);
      assert(!kids.some(m => m.text === 'You said: ' + first || m.text === 'What is 6*7?'), 'the summarised messages are not copied');
      const link = page.locator(sel('parent-link'));
      const linkText = await link.innerText();
      assert(linkText.includes('compacted from') && linkText.includes(parentTitle.slice(0, 20)), `link to the parent: ${linkText}`);
      await page.click(sel('context'));
      const total = page.locator(`${sel('context-popover')} ${sel('context-total')}`);
      await total.waitFor();
      console.log(`  child context: ${(await total.innerText()).replace(/\s+/g, ' ')}`);
      await shot(page, '06-compacted.png');
      await page.keyboard.press('Escape');
      await link.click();
      await page.waitForFunction(id => location.hash === '#' + id, thread);
      await until('the parent thread', async () => (await shown(page)).length === before.length);
      assert(JSON.stringify(await shown(page)) === JSON.stringify(before), 'the parent thread is unchanged');
      assert(child !== thread, 'a new thread');
    },
  },
  {
    name: 'a queued turn waits greyed below the conversation, then automatic compaction shows progress',
    fn: async browser => {
      const a = await open(browser, 'queued');
      const page = a.page;
      const thread = await newThread(page);
      await patchMetadata(page, thread, { compactRecentMessages: 4 });
      const first = notes('Background');
      await send(page, first);
      await waitMessage(page, 'assistant', 'You said: ' + first);
      await waitCompleted(page);
      const slowText = words(40, 'q');
      await send(page, slow(slowText, 150));
      await page.locator(sel('streaming')).waitFor({ state: 'visible' }); // its context is counted already
      // The next model call (the queued turn's) is over the threshold: it compacts first.
      await patchMetadata(page, thread, { compactRecentMessages: 4, compactThreshold: 150 });
      const queued = 'Queued question: what happens next?';
      await page.fill(sel('composer'), queued);
      await page.keyboard.press('Enter');
      // Sending during a run offers the choice in plain words.
      await page.locator(sel('busy-choice')).waitFor();
      await page.click(sel('queue-send'));
      const turn = page.locator(sel('queued-turn'));
      await turn.waitFor();
      assert((await turn.locator('.bubble').innerText()).trim() === queued, 'the queued turn shows its text');
      assert((await turn.innerText()).includes('queued'), 'it is labelled queued');
      assert(await page.locator(sel('stop')).isVisible(), 'Send became Stop while the run is active');
      assert(!(await shown(page)).some(m => m.text === queued), 'not yet a message');
      await shot(page, '07-queued.png');
      await waitMessage(page, 'assistant', slowText);
      const promoted = await waitMessage(page, 'user', queued);
      await waitMessage(page, 'assistant', 'You said: ' + queued, promoted.seq);
      await page.waitForSelector(sel('queued-turn'), { state: 'detached' });
      await waitCompleted(page);
      assert((await shown(page)).filter(m => m.text === queued).length === 1, 'the promoted turn is shown once');
      const status = page.locator(`${sel('compaction-status')}[data-state="done"]`);
      await status.waitFor();
      const text = await status.innerText();
      assert(/context compacted \([\d,]+ → [\d,]+ tokens/.test(text), `compaction result in the status bar: ${text}`);
      await page.click(sel('context'));
      await page.locator(`${sel('context-popover')} ${sel('context-snapshot')}`).waitFor();
      await shot(page, '07-auto-compacted.png');
    },
  },
];

async function main() {
  await runTests({ label: 'browser-branches', tests, opened, api: API, out: OUT, exe: EXE });
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) await main();
