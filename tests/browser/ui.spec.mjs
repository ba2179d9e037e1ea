// Browser tests of the web UI as a product (issue 11), one per numbered point that has a UI:
// playwright-core driving Debian's Chromium. Started by tests/tests/browser.rs on a stack of its
// own: the api WITHOUT the development loopback principal (so the page must sign in), its
// database connections through a TCP proxy, short leases (6 s, renewed every 1 s), one worker,
// a 4,096-token model context, and a small control server that cuts the database, stops or
// continues the worker and makes or revokes API keys.
//
// Environment:
//   API_URL      the api (required)
//   CONTROL_URL  the control server (required): POST /db/down, /db/up, /worker/stop,
//                /worker/cont, /key/new?principal=NAME (-> a new key as text),
//                /key/revoke?principal=NAME, /thread/retire-model?id=THREAD
//   OUT_DIR, CHROMIUM, ONLY  as in run.mjs
//
// Screenshots at 1280x800 and 390x844 go to OUT_DIR as ui-<point>-<what>-<size>.png.

import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { runTests } from './harness.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const API = (process.env.API_URL || '').replace(/\/$/, '');
const CONTROL = (process.env.CONTROL_URL || '').replace(/\/$/, '');
const OUT = resolve(process.env.OUT_DIR || join(HERE, '..', '..', 'test-output', 'browser'));
const EXE = process.env.CHROMIUM || '/usr/bin/chromium';
const T = 30_000;
const DESKTOP = { width: 1280, height: 800 };
const PHONE = { width: 390, height: 844 };
const sel = id => `[data-testid="${id}"]`;
const sleep = ms => new Promise(r => setTimeout(r, ms));
const mock = steps => `MOCK: ${JSON.stringify({ steps })}`;
const words = (n, tag) => Array.from({ length: n }, (_, i) => `${tag}${i + 1}`).join(' ');

function assert(cond, message) {
  if (!cond) throw new Error('assertion failed: ' + message);
}

async function control(path) {
  const r = await fetch(CONTROL + path, { method: 'POST' });
  const text = await r.text();
  if (!r.ok) throw new Error(`control ${path}: ${r.status} ${text}`);
  return text.trim();
}

const opened = [];
let KEY = '';

async function open(browser, name, viewport = DESKTOP, { signIn = true } = {}) {
  const context = await browser.newContext({ viewport, deviceScaleFactor: 1, isMobile: viewport === PHONE, hasTouch: viewport === PHONE });
  await context.grantPermissions(['clipboard-read', 'clipboard-write'], { origin: API });
  const page = await context.newPage();
  page.setDefaultTimeout(T);
  const log = [];
  page.on('console', m => log.push(`[${m.type()}] ${m.text()}`));
  page.on('pageerror', e => log.push(`[pageerror] ${e.message}`));
  const t = { context, page, log, name };
  opened.push(t);
  await page.goto(API + '/');
  if (signIn) await signInWith(page, KEY);
  return t;
}

async function signInWith(page, key) {
  await page.locator(sel('signin-key')).fill(key);
  await page.click(sel('signin-submit'));
  await page.locator(sel('signin')).waitFor({ state: 'hidden' });
  await page.locator(sel('composer')).waitFor();
}

async function shot(page, name) {
  const size = page.viewportSize();
  const path = join(OUT, `${name}-${size.width}x${size.height}.png`);
  await page.screenshot({ path, fullPage: false });
  console.log(`  screenshot ${path}`);
}

/// Screenshots at both sizes of what `page` shows now (the page is resized and back).
async function shots(page, name) {
  const size = page.viewportSize();
  await shot(page, name);
  const other = size.width === DESKTOP.width ? PHONE : DESKTOP;
  await page.setViewportSize(other);
  await sleep(350); // the drawer's slide (0.2 s) has ended
  await shot(page, name);
  await page.setViewportSize(size);
  await sleep(100);
}

async function newThread(page) {
  const before = await page.evaluate(() => location.hash);
  if (await page.locator(sel('open-sidebar')).isVisible()) await page.click(sel('open-sidebar'));
  await page.click(sel('new-thread'));
  await page.waitForFunction(b => location.hash.length > 1 && location.hash !== b, before);
  return page.evaluate(() => location.hash.slice(1));
}

async function send(page, text) {
  await page.fill(sel('composer'), text);
  await page.click(sel('send'));
}

const bubbles = (page, role) => page.locator(`${sel('message')}[data-role="${role}"] > .bubble`);
async function lastText(page, role) { return (await bubbles(page, role).last().innerText()).trim(); }
async function waitStatus(page, status) { await page.waitForSelector(`${sel('run-status')}[data-status="${status}"]`); }
async function apiJson(page, method, path, body) {
  return page.evaluate(async ([method, path, body]) => {
    const headers = { 'X-Requested-With': 'agentloop', 'Content-Type': 'application/json' };
    const key = sessionStorage.getItem('agentloop.bearer');
    if (key) headers.Authorization = 'Bearer ' + key;
    const r = await fetch(path, { method, headers, body: body ? JSON.stringify(body) : undefined });
    return { status: r.status, body: await r.json().catch(() => null) };
  }, [method, path, body]);
}

/// Whether the element's box lies inside the viewport (reachable without scrolling the page).
async function inViewport(page, selector) {
  const box = await page.locator(selector).boundingBox();
  const v = page.viewportSize();
  return !!box && box.x >= 0 && box.y >= 0 && box.x + box.width <= v.width + 0.5 && box.y + box.height <= v.height + 0.5;
}

export const tests = [
  {
    name: '10 sign-in: a key once, a session, sign out, a revoked key returns to sign-in',
    fn: async browser => {
      const t = await open(browser, 'signin', DESKTOP, { signIn: false });
      const page = t.page;
      await page.locator(sel('signin')).waitFor();
      assert(await page.evaluate(() => localStorage.length === 0 || !Object.keys(localStorage).some(k => /key|bearer/i.test(k))), 'no key in localStorage');
      await shots(page, 'ui-10-signin');
      await page.locator(sel('signin-key')).fill('al_not_a_real_key');
      await page.click(sel('signin-submit'));
      await page.locator(`${sel('signin-error')}:not([hidden])`).waitFor();
      assert((await page.innerText(sel('signin-error'))).includes('not valid'), 'a wrong key is refused in plain words');
      const visitor = await control('/key/new?principal=visitor');
      await signInWith(page, visitor);
      assert(!(await page.evaluate(() => JSON.stringify(localStorage))).includes(visitor), 'the key is never in localStorage');
      assert((await page.innerText(sel('principal'))).length > 0, 'who is signed in is shown');
      await page.click(sel('sign-out'));
      await page.locator(sel('signin')).waitFor();
      assert((await page.innerText(sel('signin-error'))).includes('Signed out'), 'signed out');
      await signInWith(page, visitor);
      await newThread(page);
      await control('/key/revoke?principal=visitor');
      // The page's next request (its periodic refresh, or the user's next action) is refused:
      // back to sign-in, saying why.
      const t0 = Date.now();
      await page.locator(sel('signin')).waitFor();
      console.log(`  back at sign-in ${Date.now() - t0} ms after the key was revoked`);
      const notice = await page.innerText(sel('signin-error'));
      assert(/revoked|expired/.test(notice), `the user learns the key ended: ${notice}`);
      await shot(page, 'ui-10-session-ended');
    },
  },
  {
    name: '1 Markdown, highlighted code, copy buttons and tool cards, sanitised',
    fn: async browser => {
      const t = await open(browser, 'markdown');
      const page = t.page;
      await newThread(page);
      const md = [
        '## Plan', '', 'This is **bold** and `inline code`.', '',
        '| step | tool |', '| --- | --- |', '| 1 | calculator |', '| 2 | none |', '',
        '```rust', 'fn main() { let x = 6 * 7; println!("{x}"); }', '```', '',
        '<img src=x onerror="window.__xss=1"> <script>window.__xss=2</script> [link](https://example.org)',
      ].join('\n');
      await send(page, 'Show me. ' + mock([
        { toolCalls: [{ name: 'calculator', arguments: { expression: '6*7' } }] },
        { text: md + '\n\nThe tool said {{tool_result}}.' }]));
      await waitStatus(page, 'completed');
      const answer = bubbles(page, 'assistant').last();
      await answer.locator('h2').waitFor();
      assert((await answer.locator('h2').innerText()) === 'Plan', 'heading rendered');
      assert(await answer.locator('strong').count() === 1 && await answer.locator('table tr').count() === 3, 'bold and a GFM table');
      assert(await answer.locator('code .hljs-keyword').count() > 0, 'code highlighted');
      assert(await page.evaluate(() => window.__xss === undefined), 'no script ran');
      assert(await answer.locator('img[onerror], script').count() === 0, 'sanitised');
      assert((await answer.locator('a').getAttribute('rel')).includes('noopener'), 'links open safely');
      const card = page.locator(sel('tool-call')).last();
      assert((await card.getAttribute('data-status')) === 'done', 'the tool card shows the call done');
      await card.locator('summary').click();
      assert((await card.locator(`${sel('message')}[data-role="tool"]`).innerText()).trim() === '42', 'the result in the card');
      await answer.locator(sel('copy-code')).click();
      const copied = await page.evaluate(() => navigator.clipboard.readText());
      assert(copied.includes('let x = 6 * 7;'), `code copied: ${copied}`);
      await page.locator(`${sel('message')}[data-role="assistant"]`).last().hover();
      await page.locator(`${sel('message')}[data-role="assistant"]`).last().locator(sel('copy')).click();
      const all = await page.evaluate(() => navigator.clipboard.readText());
      assert(all.includes('## Plan') && all.includes('The tool said 42.'), 'the whole message copied as Markdown');
      assert(await page.locator(sel('timestamp')).count() >= 2, 'messages show their time');
      // An answer the provider cut at its length limit says so.
      await send(page, mock([{ text: 'The three steps are: one, two, th', finishReason: 'length' }]));
      await waitStatus(page, 'completed');
      const cut = page.locator(`${sel('message')}[data-role="assistant"]`).last();
      await cut.locator(sel('cut')).waitFor();
      assert((await cut.locator(sel('cut')).innerText()).includes('length limit'), 'the cut answer is marked');
      assert(await bubbles(page, 'assistant').first().locator(sel('cut')).count() === 0, 'a finished answer is not');
      await shots(page, 'ui-01-markdown');
      await page.click(sel('theme'));
      await shots(page, 'ui-01-markdown-dark');
      await page.click(sel('theme'));
    },
  },
  {
    name: '1b content cannot take the page; a lost answer to Send does not send the turn twice',
    fn: async browser => {
      const t = await open(browser, 'hostile');
      const page = t.page;
      const thread = await newThread(page);
      // Acceptance probe K, K-1 / K-2: an answer whose ids, classes and layers are the page's own.
      const evil = 'Here. <button id="composer" value="EVIL TURN" hidden>x</button><span id="send">s</span>' +
        '<div class="modal" data-testid="fake-modal">Your session expired</div><dialog open>fake dialog</dialog>' +
        '<div popover>layer</div>';
      await send(page, 'Show. ' + mock([{ text: evil }]));
      const answer = bubbles(page, 'assistant').filter({ hasText: 'Here.' }).first();
      await answer.waitFor();
      assert(await answer.locator('[id="composer"], [id="send"], .modal, dialog, [popover], [data-testid="fake-modal"]').count() === 0,
        'the content has none of the page\'s ids, classes, dialogs or layers: ' + await answer.innerHTML());
      assert(await answer.locator('[id="user-content-composer"]').count() === 1, 'content ids are prefixed');
      await send(page, 'my own words');
      await bubbles(page, 'assistant').filter({ hasText: 'my own words' }).first().waitFor();
      let w = await apiJson(page, 'GET', '/api/threads/' + thread);
      const users = w.body.messages.filter(m => m.role === 'user').map(m => m.content);
      assert(users[users.length - 1] === 'my own words', 'the turn sent is what the user typed: ' + JSON.stringify(users));
      // K-5: the turn reaches the server, its answer is lost; the user sends again.
      let chats = 0;
      await page.route('**/chat', async route => {
        chats += 1;
        if (chats === 1) { await route.fetch(); await route.abort('connectionreset'); } else await route.continue();
      });
      // Its run is still answering when the user sends again: the same turn, not a queued one
      // (verification probe L, L-7: the busy choice sent it again under a new key).
      const once = 'only once please ' + mock([{ text: 'slow once', delayMs: 4000 }]);
      await send(page, once);
      await page.locator(sel('error')).waitFor();
      assert((await page.inputValue(sel('composer'))) === once, 'the text is kept to send again');
      await sleep(1000);
      await page.click(sel('send'));
      await sleep(300);
      assert(!(await page.locator(sel('busy-choice')).isVisible()), 'no queue / interrupt choice for a resend');
      await bubbles(page, 'assistant').filter({ hasText: 'slow once' }).first().waitFor();
      await page.unroute('**/chat');
      assert(chats === 2, `two requests: ${chats}`);
      await sleep(1500);
      w = await apiJson(page, 'GET', '/api/threads/' + thread);
      const sent = w.body.messages.filter(m => m.role === 'user' && m.content === once).length;
      const answers = w.body.messages.filter(m => m.role === 'assistant' && m.content === 'slow once').length;
      assert(sent === 1 && answers === 1, `the resend was taken as the same turn: ${sent} turns, ${answers} answers`);
      // Probe K, K-10 / K-11: Back and Forward move between chats; the composer has a label.
      const second = await newThread(page);
      await page.goBack();
      await page.waitForFunction(id => location.hash === '#' + id, thread);
      await bubbles(page, 'assistant').filter({ hasText: 'slow once' }).first().waitFor();
      await page.goForward();
      await page.waitForFunction(id => location.hash === '#' + id, second);
      await page.locator(sel('welcome')).or(page.locator(sel('composer'))).first().waitFor();
      assert(await bubbles(page, 'assistant').filter({ hasText: 'slow once' }).count() === 0, 'Forward shows the other chat');
      assert((await page.getAttribute(sel('composer'), 'aria-label')) === 'Message', 'the composer is labelled');
      await shot(page, 'ui-01b-hostile');
    },
  },
  {
    name: '1c a long answer, slow to parse as Markdown, is shown whole and leaves the page responsive',
    fn: async browser => {
      const t = await open(browser, 'slow-markdown');
      const page = t.page;
      await newThread(page);
      // Acceptance probe K, K-12: emphasis delimiters on one long line. marked parsed 48,000 `_a`
      // in ~11 s (quadratic in the run's length; node, this machine), markdown-it in ~0.1 s.
      await send(page, 'Go. ' + mock([{ text: '_a', repeat: 48000, delayMs: 500 }]));
      // A live update carries the answer's head; the page reads it whole and shows that. The
      // page answers throughout (each probe is one animation frame).
      const answer = bubbles(page, 'assistant').filter({ hasText: '_a_a_a' }).first();
      let worst = 0, shown = '';
      // Each probe (an animation frame, then a look at the answer) is timed whole: a look waits
      // for a busy page as much as a frame does.
      for (const until = Date.now() + 60_000; Date.now() < until; await sleep(100)) {
        const started = Date.now();
        await page.evaluate(() => new Promise(r => requestAnimationFrame(() => r(0))));
        if (await answer.isVisible()) shown = (await answer.innerText()).trim();
        worst = Math.max(worst, Date.now() - started);
        if (shown.length === 96000) break;
      }
      assert(shown.length === 96000, 'the whole answer is shown: ' + shown.length + ' ' + shown.slice(-80));
      assert(worst < 3000, `the page answered within 3 s throughout (worst ${worst} ms)`);
      assert(await page.locator(sel('shortened')).count() === 0, 'not marked shortened');

      // Acceptance probe N, N-6 / N-7: a code block highlight.js takes minutes on (60,000 `$` as
      // Java: 57 s frozen), and one letter under 70,000 combining marks (Chromium's layout of one
      // grapheme: 12 s). Each in a chat of its own.
      for (const [step, shown] of [
        [{ prefix: '```java\n', text: '$', repeat: 60000, suffix: '\n```\n\ncode end' }, 'code end'],
        [{ prefix: 'z', text: '\u0301', repeat: 70000, suffix: ' marks end' }, 'marks end'],
        // Verifier P, P-5: skin-tone modifiers extend a cluster as marks do (10,000: 32 s frozen).
        [{ prefix: 'a', text: '\u{1F3FB}', repeat: 10000, suffix: ' modifiers end' }, 'modifiers end'],
        // P-7: the highlight bound was per block; 24 blocks under it blocked the tab 7 s.
        [{ text: '```java\n' + '$'.repeat(3990) + '\n```\n\n', repeat: 24, suffix: 'blocks end' }, 'blocks end'],
        // P-11: raw HTML nests without bound (10,000 nested <q>: 35.6 s).
        [{ text: '<q>', repeat: 10000, suffix: ' nested end' }, 'nested end'],
      ]) {
        await newThread(page);
        await send(page, 'Heavy. ' + mock([step]));
        const heavy = bubbles(page, 'assistant').filter({ hasText: shown }).first();
        worst = 0;
        let visible = false;
        for (const until = Date.now() + 90_000; Date.now() < until && !visible; await sleep(100)) {
          const started = Date.now();
          await page.evaluate(() => new Promise(r => requestAnimationFrame(() => r(0))));
          visible = await heavy.isVisible();
          worst = Math.max(worst, Date.now() - started);
        }
        assert(visible, `the answer ending "${shown}" is shown`);
        assert(worst < 3000, `the page answered within 3 s while "${shown}" was drawn (worst ${worst} ms)`);
        if (shown === 'code end') assert((await heavy.locator('code').first().innerText()).length >= 60000, 'the whole code block is shown');
      }

      // One streamed piece larger than a live event's share of a member (8 KiB of 64 KiB) comes
      // cut; the page reads the partial answer whole (before: the first 8 KiB and "…[N bytes
      // omitted]" until the finished message arrived). The next piece comes 8 s later.
      await newThread(page);
      await send(page, 'Big piece. ' + mock([{ prefix: 'a b ', text: 'y', repeat: 70000, suffix: ' c d e f g h', chunkDelayMs: 8000 }]));
      const stream = page.locator(sel('streaming'));
      let partial = '';
      for (const until = Date.now() + 20_000; Date.now() < until; await sleep(200)) {
        partial = (await stream.isVisible()) ? (await stream.innerText()).trim() : '';
        if (partial.includes('y'.repeat(70000)) || partial.includes('omitted')) break;
      }
      assert(partial.includes('y'.repeat(70000)) && !partial.includes('omitted'),
        'the streamed partial answer is whole: ' + partial.length + ' ' + partial.slice(-60));
    },
  },
  {
    name: '2+3 phone layout: drawer, composer and Stop reachable; Stop keeps the partial answer; queue / interrupt',
    fn: async browser => {
      const t = await open(browser, 'phone', PHONE);
      const page = t.page;
      assert(!(await inViewport(page, sel('sidebar'))), 'the sidebar is a closed drawer at 390 px');
      await page.click(sel('open-sidebar'));
      await sleep(300);
      assert(await inViewport(page, sel('new-thread')), 'the drawer opens');
      await shot(page, 'ui-02-drawer');
      await page.click(sel('new-thread'));
      await page.waitForFunction(() => location.hash.length > 1);
      await sleep(300);
      assert(!(await inViewport(page, sel('sidebar'))), 'the drawer closes after choosing');
      const composer = await page.locator(sel('composer')).boundingBox();
      assert(composer.width > 250 && composer.height >= 24, `a usable composer: ${JSON.stringify(composer)}`);
      assert(await inViewport(page, sel('send')), 'Send is on screen');
      const long = words(80, 's');
      await send(page, mock([{ text: long, chunkDelayMs: 150 }]));
      await page.locator(sel('streaming')).waitFor({ state: 'visible' });
      await page.locator(sel('stop')).waitFor({ state: 'visible' });
      assert(await page.locator(sel('send')).isHidden(), 'Send became Stop');
      assert(await inViewport(page, sel('stop')), 'Stop is on screen and clickable');
      while ((await page.locator(`${sel('streaming')} .bubble`).innerText()).split(' ').length < 8) await sleep(100);
      await shot(page, 'ui-03-streaming-stop');
      await page.click(sel('stop'));
      await waitStatus(page, 'cancelled');
      const stopped = page.locator(`${sel('message')}[data-role="assistant"]`).last();
      await stopped.locator(sel('stopped')).waitFor();
      const kept = (await stopped.locator('.bubble').innerText()).trim();
      assert(kept.startsWith('s1 s2 s3') && kept.length < long.length, `the partial answer is kept: ${kept.slice(0, 40)}`);
      assert(await page.locator(sel('send')).isVisible(), 'Stop became Send again');
      await shot(page, 'ui-03-stopped');

      // Sending while the agent works: the choice in plain words; interrupt.
      await send(page, mock([{ text: words(60, 'i'), chunkDelayMs: 150 }]));
      await page.locator(sel('streaming')).waitFor({ state: 'visible' });
      await page.fill(sel('composer'), 'Actually, just say hi');
      await page.keyboard.press('Enter');
      await page.locator(sel('busy-choice')).waitFor();
      const choice = await page.innerText(sel('busy-choice'));
      assert(choice.includes('Send after it finishes') && choice.includes('Stop it and send now') && !/multitask|enqueue/.test(choice), `plain words: ${choice}`);
      await shot(page, 'ui-03-queue-or-interrupt');
      await page.click(sel('interrupt-send'));
      await page.waitForFunction(() => [...document.querySelectorAll('[data-testid="message"][data-role="assistant"] > .bubble')]
        .some(b => b.innerText.trim() === 'You said: Actually, just say hi'));
      await waitStatus(page, 'completed');
      const users = await bubbles(page, 'user').allInnerTexts();
      assert(users[users.length - 1].trim() === 'Actually, just say hi', 'the new turn went in');
      await shot(page, 'ui-03-interrupted');
    },
  },
  {
    name: '4 threads: automatic title, rename, delete with confirm and undo, search, export, timestamps',
    fn: async browser => {
      const t = await open(browser, 'threads');
      const page = t.page;
      const id = await newThread(page);
      await send(page, 'Compare sourdough and yeast bread for beginners');
      await waitStatus(page, 'completed');
      await page.waitForFunction(() => document.querySelector('[data-testid="thread-title"]').textContent === 'Chat: Compare sourdough and yeast');
      const item = page.locator(`${sel('thread-item')}[data-thread-id="${id}"]`);
      await item.locator(sel('thread-item-title')).filter({ hasText: 'Chat: Compare sourdough' }).waitFor();
      // Rename from the header.
      await page.click(sel('thread-title'));
      await page.locator(sel('rename-input')).fill('Bread notes');
      await page.keyboard.press('Enter');
      await item.locator(sel('thread-item-title')).filter({ hasText: 'Bread notes' }).waitFor();
      assert((await apiJson(page, 'GET', '/api/threads/' + id)).body.thread.title === 'Bread notes', 'renamed on the server');
      // Search finds message text (prefix) and titles.
      await page.fill(sel('search'), 'sourd');
      await page.locator(`${sel('search-message-hit')}[data-thread-id="${id}"]`).first().waitFor();
      assert((await page.locator(sel('search-message-hit')).first().locator('mark').innerText()).toLowerCase().startsWith('sourd'), 'the match is marked');
      await shots(page, 'ui-04-search');
      await page.fill(sel('search'), 'bread notes');
      await page.locator(sel('search-title-hit')).first().waitFor();
      await page.fill(sel('search'), 'zzzqqq');
      await page.locator(sel('search-empty')).waitFor();
      await page.fill(sel('search'), '');
      // Export: Markdown and JSON files.
      await page.click(sel('export'));
      const [md] = await Promise.all([page.waitForEvent('download'), page.click(sel('export-markdown'))]);
      assert(md.suggestedFilename() === 'bread-notes.md', md.suggestedFilename());
      await page.click(sel('export'));
      const [js] = await Promise.all([page.waitForEvent('download'), page.click(sel('export-json'))]);
      const doc = JSON.parse(await (await import('node:fs/promises')).readFile(await js.path(), 'utf8'));
      assert(doc.format === 'agentloop.thread.v1' && doc.messages.length === 2, 'a JSON export of the thread');
      // Delete asks first; Undo brings it back.
      await item.hover();
      await item.locator(sel('thread-menu')).click();
      await page.click(sel('menu-delete'));
      await page.locator(sel('confirm-dialog')).waitFor();
      await shot(page, 'ui-04-delete-confirm');
      await page.click(sel('confirm-cancel'));
      assert(await item.count() === 1, 'cancel keeps it');
      await item.hover();
      await item.locator(sel('thread-menu')).click();
      await page.click(sel('menu-delete'));
      await page.click(sel('confirm-ok'));
      await item.waitFor({ state: 'detached' });
      await page.locator(sel('toast-action')).waitFor();
      await shots(page, 'ui-04-deleted-undo');
      await page.click(sel('toast-action'));
      await page.locator(`${sel('thread-item')}[data-thread-id="${id}"]`).waitFor();
      await page.waitForFunction(i => location.hash === '#' + i, id);
      await bubbles(page, 'assistant').first().waitFor();
      assert((await page.locator(sel('timestamp')).count()) >= 2, 'timestamps are shown');
      await shots(page, 'ui-04-restored');
    },
  },
  {
    name: '5+6 model picker, generation settings, a retired model, the input limit up front',
    fn: async browser => {
      const t = await open(browser, 'models');
      const page = t.page;
      const id = await newThread(page);
      const options = await page.locator(`${sel('model-picker')} option`).allInnerTexts();
      assert(options.some(o => o.startsWith('mock')), `the picker lists the models: ${options}`);
      await page.click(sel('settings'));
      const max = page.locator(sel('setting-max-tokens'));
      assert((await max.getAttribute('placeholder')).includes('1,024'), 'the default max tokens comes from the model\'s limit');
      await max.fill('321');
      await page.locator(sel('setting-temperature')).fill('0.4');
      await shots(page, 'ui-05-settings');
      await page.click(sel('settings-save'));
      await page.locator(sel('toast')).filter({ hasText: 'Settings saved' }).waitFor();
      const meta = (await apiJson(page, 'GET', '/api/threads/' + id)).body.thread.metadata;
      assert(meta.maxTokens === 321 && meta.temperature === 0.4, JSON.stringify(meta));
      // A model the server no longer has: the page says so, the send is refused with the list.
      await control('/thread/retire-model?id=' + id);
      await page.reload();
      await page.locator(sel('model-banner')).waitFor({ state: 'visible' });
      await send(page, 'still there?');
      await page.locator(`${sel('error')}:not([hidden])`).waitFor();
      const err = await page.innerText(sel('error'));
      assert(err.includes('configured: mock') && err.includes('model_not_configured'), err);
      await shots(page, 'ui-05-model-retired');
      await page.selectOption(sel('model-picker'), 'mock');
      await page.locator(sel('model-banner')).waitFor({ state: 'hidden' });
      await page.click(sel('send'));
      await waitStatus(page, 'completed');
      // Too large for the model: refused before sending, in plain words.
      await page.fill(sel('composer'), 'lorem ipsum dolor '.repeat(800));
      await page.locator(`${sel('input-limit')}.over`).waitFor();
      const count = await page.locator(sel('message')).count();
      await page.click(sel('send'));
      await page.locator(`${sel('error')}:not([hidden])`).waitFor();
      assert((await page.innerText(sel('error'))).includes('accepts at most'), 'the limit is explained');
      assert(await page.locator(sel('message')).count() === count, 'nothing was sent');
      await shots(page, 'ui-06-input-limit');
    },
  },
  {
    name: '7 branches: edit makes ‹ 1/2 ›, the switcher shows the other branch; delete asks to confirm',
    fn: async browser => {
      const t = await open(browser, 'branches');
      const page = t.page;
      await newThread(page);
      await send(page, 'first version');
      await waitStatus(page, 'completed');
      const user = page.locator(`${sel('message')}[data-role="user"]`).last();
      await user.hover();
      await user.locator(sel('edit')).click();
      await page.locator(sel('edit-input')).fill('second version');
      await page.click(sel('edit-save'));
      await page.waitForFunction(() => [...document.querySelectorAll('[data-testid="message"][data-role="assistant"] > .bubble')].some(b => b.innerText.includes('second version')));
      await waitStatus(page, 'completed');
      const switcher = page.locator(`${sel('message')}[data-role="user"] ${sel('branch-switcher')}`);
      await switcher.waitFor();
      assert((await switcher.locator(sel('branch-index')).innerText()) === '2 / 2', 'the edited message shows 2 / 2');
      await shots(page, 'ui-07-branch-2-of-2');
      await switcher.locator(sel('branch-prev')).click();
      await page.waitForFunction(() => [...document.querySelectorAll('[data-testid="message"][data-role="user"] > .bubble')].some(b => b.innerText === 'first version'));
      await page.locator(`${sel('branch-index')}`).filter({ hasText: '1 / 2' }).waitFor();
      assert((await lastText(page, 'assistant')) === 'You said: first version', 'the first branch is shown with its answer');
      await shots(page, 'ui-07-branch-1-of-2');
      await page.locator(`${sel('branch-switcher')} ${sel('branch-next')}`).click();
      await page.locator(`${sel('branch-index')}`).filter({ hasText: '2 / 2' }).waitFor();
      const answer = page.locator(`${sel('message')}[data-role="assistant"]`).last();
      await answer.hover();
      await answer.locator(sel('delete')).click();
      await page.locator(sel('confirm-dialog')).waitFor();
      await page.click(sel('confirm-cancel'));
      assert(await answer.isVisible(), 'cancelled: the message stays');
    },
  },
  {
    name: '8 honest liveness: no worker, worker lost, database unavailable — each clears itself',
    fn: async browser => {
      const t = await open(browser, 'liveness');
      const page = t.page;
      await newThread(page);
      await control('/worker/stop');
      try {
        await send(page, 'hello while no worker runs');
        const banner = page.locator(`${sel('liveness')}[data-state="unclaimed"]`);
        await banner.waitFor({ timeout: 15_000 });
        assert((await banner.innerText()).includes('No worker has picked up'), await banner.innerText());
        await shots(page, 'ui-08-unclaimed');
      } finally { await control('/worker/cont'); }
      await page.locator(sel('liveness')).waitFor({ state: 'hidden' });
      await waitStatus(page, 'completed');

      // A worker that stops mid-stream: quiet, then lost; when it comes back the run recovers.
      await send(page, mock([{ text: words(60, 'r'), chunkDelayMs: 200 }]));
      await page.locator(sel('streaming')).waitFor({ state: 'visible' });
      await control('/worker/stop');
      try {
        await page.locator(`${sel('liveness')}[data-state="lease_stale"]`).waitFor({ timeout: 15_000 });
        await shot(page, 'ui-08-worker-quiet');
        await page.locator(`${sel('liveness')}[data-state="lease_expired"]`).waitFor({ timeout: 15_000 });
        assert((await page.innerText(sel('liveness'))).includes('Recovery in progress'), 'recovery is announced');
        await shots(page, 'ui-08-worker-lost');
      } finally { await control('/worker/cont'); }
      await waitStatus(page, 'completed');
      await page.locator(sel('liveness')).waitFor({ state: 'hidden' });
      assert((await lastText(page, 'assistant')).endsWith('r60'), 'the answer completed after recovery');

      // The database away: a banner; back: it clears.
      await control('/db/down');
      try {
        await page.locator(sel('db-banner')).waitFor({ state: 'visible', timeout: 20_000 });
        await shots(page, 'ui-08-database-unavailable');
      } finally { await control('/db/up'); }
      await page.locator(sel('db-banner')).waitFor({ state: 'hidden', timeout: 20_000 });
      await send(page, 'after the outage');
      await waitStatus(page, 'completed');
    },
  },
  {
    name: '9 run inspector: steps, tokens, tool calls with timings, updated live',
    fn: async browser => {
      const t = await open(browser, 'inspector');
      const page = t.page;
      await newThread(page);
      await page.click(sel('inspector-toggle'));
      await send(page, mock([{ toolCalls: [{ name: 'calculator', arguments: { expression: '12*7' } }] },
        { text: words(60, 'x'), chunkDelayMs: 150 }]));
      await page.locator(`${sel('inspector-tool-call')}[data-status="done"]`).waitFor();
      await page.locator(`${sel('inspector-status')}`).filter({ hasText: 'running' }).waitFor();
      await shot(page, 'ui-09-inspector-live');
      await waitStatus(page, 'completed');
      await page.locator(`${sel('inspector-status')}`).filter({ hasText: 'completed' }).waitFor();
      assert(await page.locator(sel('inspector-step')).count() >= 1, 'steps are listed');
      const call = page.locator(sel('inspector-tool-call')).first();
      const summary = await call.locator('summary').innerText();
      assert(summary.includes('calculator') && /\d+(\.\d+)? ?(ms|s)/.test(summary), `the call with its time: ${summary}`);
      await shots(page, 'ui-09-inspector');
    },
  },
];

async function main() {
  if (!CONTROL) {
    console.error('CONTROL_URL is required');
    process.exit(2);
  }
  KEY = await control('/key/new?principal=person');
  await runTests({ label: 'browser-ui', tests, opened, api: API, out: OUT, exe: EXE });
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) await main();
