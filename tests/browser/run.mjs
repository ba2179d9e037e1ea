// Browser tests of the agentloop web UI (api/static/index.html): playwright-core driving
// Debian's Chromium. Started by tests/tests/browser.rs, which brings up a stack (api with
// DEV_LOOPBACK_PRINCIPAL=true, a worker, the scripted mock model) and seeds a 10,000-message
// thread with SQL.
//
// Environment:
//   API_URL        the api, e.g. http://127.0.0.1:8080 (required)
//   BIG_THREAD_ID  id of the seeded 10,000-message thread (the last test is skipped without it)
//   DATABASE_URL   the stack's database (informational)
//   OUT_DIR        screenshots and logs (default: <repo>/test-output/browser)
//   CHROMIUM       browser executable (default /usr/bin/chromium)
//   ONLY           run only tests whose name contains this text
//
// Prints one line per test and closes with "N passed, N failed"; exit status 0 only when all
// passed.

import { mkdirSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { runTests } from './harness.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const API = (process.env.API_URL || '').replace(/\/$/, '');
const OUT = resolve(process.env.OUT_DIR || join(HERE, '..', '..', 'test-output', 'browser'));
const BIG = process.env.BIG_THREAD_ID || '';
const EXE = process.env.CHROMIUM || '/usr/bin/chromium';

if (!API) {
  console.error('API_URL is required');
  process.exit(2);
}
mkdirSync(OUT, { recursive: true });

const T = 30_000;
const sel = id => `[data-testid="${id}"]`;
const words = (n, tag) => Array.from({ length: n }, (_, i) => `${tag}${i + 1}`).join(' ');
const mock = (text, chunkDelayMs) => `MOCK: ${JSON.stringify({ steps: [{ text, chunkDelayMs }] })}`;

function assert(cond, message) {
  if (!cond) throw new Error('assertion failed: ' + message);
}

async function shot(page, name) {
  const path = join(OUT, name);
  await page.screenshot({ path, fullPage: false });
  console.log(`  screenshot ${path}`);
}

/// A fresh page on the UI, with console errors collected.
const opened = []; // pages of the running test, for failure screenshots

async function open(browser, name, setup) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  page.setDefaultTimeout(T);
  const log = [];
  page.on('console', m => log.push(`[${m.type()}] ${m.text()}`));
  page.on('pageerror', e => log.push(`[pageerror] ${e.message}`));
  const t = { context, page, log, name };
  opened.push(t);
  if (setup) await setup(page);
  await page.goto(API + '/');
  return t;
}

async function newThread(page) {
  await page.click(sel('new-thread'));
  await page.waitForFunction(() => location.hash.length > 1);
  return page.evaluate(() => location.hash.slice(1));
}

async function send(page, text) {
  await page.fill(sel('composer'), text);
  await page.click(sel('send'));
}

async function transport(page, mode) {
  await page.waitForSelector(`${sel('transport')}[data-transport="${mode}"]`, { timeout: 20_000 });
}

/// The partial answer shown while streaming ('' when the streaming bubble is hidden).
async function streamText(page) {
  return page.evaluate(() => {
    const box = document.querySelector('[data-testid="streaming"]');
    return box && !box.hidden ? box.querySelector('.bubble').innerText.trim() : '';
  });
}

async function lastAssistant(page) {
  return page.locator(`${sel('message')}[data-role="assistant"] > .bubble`).last().innerText();
}

async function runOf(page, id) {
  return page.evaluate(async id => (await fetch('/api/runs/' + id)).json(), id);
}

const tests = [];
const test = (name, fn) => tests.push({ name, fn });

test('send a message and see the streamed answer', async browser => {
  const t = await open(browser, 'stream');
  await newThread(t.page);
  await transport(t.page, 'sse');
  const answer = words(60, 'w');
  await send(t.page, mock(answer, 150));
  // The partial answer is visible while it streams, growing, before the final message lands.
  const stream = t.page.locator(sel('streaming'));
  await stream.waitFor({ state: 'visible' });
  const partials = new Set();
  const deadline = Date.now() + T;
  while (partials.size < 3 && Date.now() < deadline) {
    const text = await streamText(t.page);
    if (text && text !== answer) partials.add(text);
    if (await t.page.locator(`${sel('message')}[data-role="assistant"]`).count()) break;
    await t.page.waitForTimeout(100);
  }
  assert(partials.size >= 2, `saw the answer grow while streaming (${partials.size} distinct partials)`);
  for (const p of partials) assert(answer.startsWith(p), `partial is a prefix: ${p.slice(0, 60)}`);
  await shot(t.page, '01-streaming.png');
  await t.page.waitForSelector(`${sel('message')}[data-role="assistant"]`);
  assert((await lastAssistant(t.page)).trim() === answer, 'final answer text');
  await t.page.waitForSelector(`${sel('run-status')}[data-status="completed"]`);
  assert(await stream.isHidden(), 'the streaming bubble is gone once the message is committed');
  assert(await t.page.locator(`${sel('message')}[data-role="assistant"]`).count() === 1, 'the answer is shown once');
  await shot(t.page, '01-streamed-answer.png');
});

test('reload mid-run and see the same run continue to completion', async browser => {
  const t = await open(browser, 'reload');
  const thread = await newThread(t.page);
  await transport(t.page, 'sse');
  const answer = words(120, 'r');
  await send(t.page, mock(answer, 250)); // ~10 s of streaming
  await t.page.waitForSelector(`${sel('run-status')}[data-status="running"]`);
  const runId = await t.page.getAttribute(sel('run-status'), 'data-run-id');
  const stream = t.page.locator(sel('streaming'));
  await stream.waitFor({ state: 'visible' });
  while ((await streamText(t.page)).split(' ').length < 9) await t.page.waitForTimeout(50);
  const before = await streamText(t.page);
  await t.page.reload();
  // Same thread, same run, the partial answer is there at once and keeps growing.
  await t.page.waitForFunction(id => location.hash === '#' + id, thread);
  await transport(t.page, 'sse');
  await t.page.waitForSelector(`${sel('run-status')}[data-run-id="${runId}"]`);
  assert((await t.page.getAttribute(sel('run-status'), 'data-status')) === 'running', 'still running after the reload');
  await stream.waitFor({ state: 'visible' });
  const resumed = await streamText(t.page);
  assert(resumed.startsWith(before) && answer.startsWith(resumed),
    `after reload the partial answer is shown at once and continues (${resumed.length} vs ${before.length} chars)`);
  while ((await streamText(t.page)).length <= resumed.length) await t.page.waitForTimeout(50);
  console.log(`  before reload ${before.split(' ').length} words shown, at once after it ${resumed.split(' ').length}`);
  await shot(t.page, '02-reloaded-mid-run.png');
  await t.page.waitForSelector(`${sel('message')}[data-role="assistant"]`);
  assert((await lastAssistant(t.page)).trim() === answer, 'final answer after reload');
  await t.page.waitForSelector(`${sel('run-status')}[data-status="completed"][data-run-id="${runId}"]`);
  const run = await runOf(t.page, runId);
  assert(run.status === 'completed' && run.attempts === 1 && run.steps.length === 1, `the same run finished once: ${JSON.stringify(run).slice(0, 200)}`);
  assert(await t.page.locator(`${sel('message')}[data-role="assistant"]`).count() === 1, 'the answer is shown once');
  await shot(t.page, '02-reload-completed.png');
});

test('a URL fragment that is not a thread id never reaches an API path', async browser => {
  const seen = [];
  const t = await open(browser, 'fragment', page => page.on('request', r => seen.push(new URL(r.url()).pathname)));
  await t.page.waitForSelector(sel('new-thread'));
  for (const fragment of ['../session', '../webhooks', '..%2Fsession', 'not-a-thread']) {
    seen.length = 0;
    await t.page.evaluate(f => { location.hash = f; }, fragment);
    await t.page.waitForFunction(() => location.hash === '');
    await t.page.waitForTimeout(200);
    const stray = seen.filter(p => p.startsWith('/api/') && !['/api/threads', '/api/models', '/api/readyz'].includes(p));
    assert(stray.length === 0, `#${fragment} requested ${stray.join(', ')}`);
  }
  assert(!t.log.some(l => l.startsWith('[pageerror]')), `no uncaught error: ${t.log.join(' | ')}`);
});

test('SSE blocked: the page falls back to long-poll and still updates', async browser => {
  let blocked = 0;
  const t = await open(browser, 'fallback', page => page.route('**/updates/stream*', r => { blocked += 1; return r.abort(); }));
  await newThread(t.page);
  const t0 = Date.now();
  await transport(t.page, 'long-poll');
  const fellBack = Date.now() - t0;
  assert(blocked >= 1, 'the page tried SSE first');
  console.log(`  fell back to long-poll after ${fellBack} ms (${blocked} SSE attempt(s) blocked)`);
  const answer = words(24, 'p');
  await send(t.page, mock(answer, 100));
  await t.page.waitForSelector(`${sel('message')}[data-role="assistant"]`);
  assert((await lastAssistant(t.page)).trim() === answer, 'answer delivered over long-poll');
  await t.page.waitForSelector(`${sel('run-status')}[data-status="completed"]`);
  assert((await t.page.getAttribute(sel('transport'), 'data-transport')) === 'long-poll', 'still on long-poll');
  await shot(t.page, '03-long-poll-fallback.png');
});

test('open a 10,000-message thread at the newest message; older ones load on scrolling up', async browser => {
  if (!BIG) throw new Error('BIG_THREAD_ID is not set');
  const t = await open(browser, 'big');
  const t0 = Date.now();
  await t.page.goto(`${API}/#${BIG}`);
  await t.page.waitForSelector(`${sel('message')}[data-sequence="10000"]`);
  await t.page.waitForSelector(sel('load-earlier'));
  const loadMs = Date.now() - t0;
  const seqs = async () => t.page.$$eval(sel('message'), els => els.map(e => Number(e.dataset.sequence)));
  // The window may still be re-rendered once (a live update landing as it opens): read it when
  // it holds its page (a read in between once saw 0 messages).
  await t.page.waitForFunction(() => document.querySelectorAll('[data-testid="message"]').length >= 100, null, { timeout: 5000 }).catch(() => {});
  let shown = await seqs();
  console.log(`  10,000-message thread: ${shown.length} messages shown ${loadMs} ms after navigation`);
  assert(loadMs < 5000, `opens in under 5 s (${loadMs} ms)`);
  assert(shown.length <= 120 && shown.length >= 100, `a bounded window is rendered (${shown.length})`);
  const label = await t.page.innerText(sel('load-earlier'));
  assert(/9,?880/.test(label), `the gap names the omitted messages: ${label}`);
  // The window opens at the newest message: the log is scrolled to the bottom.
  const atBottom = await t.page.$eval('#log', l => l.scrollHeight - l.scrollTop - l.clientHeight < 4);
  assert(atBottom, 'the newest messages are in view');
  assert(await t.page.locator(`${sel('message')}[data-sequence="10000"]`).isVisible(), 'message 10,000 is visible');
  await shot(t.page, '04-big-thread.png');
  for (let round = 1; round <= 2; round++) {
    const n = shown.length;
    const t1 = Date.now();
    // Scroll up to the gap: the page before it loads by itself (no button to click).
    await t.page.locator(sel('load-earlier')).first().scrollIntoViewIfNeeded();
    await t.page.$eval('#log', l => l.dispatchEvent(new Event('scroll')));
    await t.page.waitForFunction(n => document.querySelectorAll('[data-testid="message"]').length > n, n);
    shown = await seqs();
    console.log(`  scroll up #${round}: ${shown.length - n} more in ${Date.now() - t1} ms`);
    assert(shown.length - n >= 100, `a page of 100 (${shown.length - n})`);
  }
  const sorted = [...shown].sort((a, b) => a - b);
  assert(JSON.stringify(shown) === JSON.stringify(sorted), 'messages stay in sequence order');
  for (let s = 9701; s <= 10000; s++) assert(shown.includes(s), `message ${s} is shown`);
  assert(new Set(shown).size === shown.length, 'no message twice');
  await shot(t.page, '04-big-thread-scrolled-up.png');
});

await runTests({ label: 'browser', tests, opened, api: API, out: OUT, exe: EXE });
