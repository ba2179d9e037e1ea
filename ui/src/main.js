// agentloop web UI. Bundled by esbuild (ui/build.mjs) into api/static/ui/app.js; no inline
// script or handler anywhere (listeners only), so a strict Content-Security-Policy holds.

import './style.css';
import { $, $$, h, icon, sleep, fmt, shortTime, fullTime, duration, dayGroup, textOf, prettyArgs, oneLine, roughTokens, copyText, tame } from './util.js';
import { api, auth, download, resume, signIn, signOut, loopbackAvailable, dbListeners } from './api.js';
import { setMarkdown, highlight } from './markdown.js';

const ACTIVE = ['pending', 'queued', 'running', 'waiting_approval', 'waiting_authorization', 'blocked'];
const RANK = {running: 0, waiting_approval: 0, waiting_authorization: 0, blocked: 0, queued: 1, pending: 2};
const HEARTBEAT_MS = 15000;
const RUN_POLL_MS = 2000;
const READY_POLL_MS = 4000;
const UNDO_MS = 8000;
const isActive = r => !!r && ACTIVE.includes(r.status);
const mobile = () => window.matchMedia('(max-width: 820px)').matches;

const S = {threads: [], nextCursor: null, morePages: false, V: null, pollOnly: new Set(), models: [], titles: {},
  dbDown: false, search: null, inspector: false, timers: []};

// ---- theme -------------------------------------------------------------------------------------
function applyTheme() {
  const t = localStorage.getItem('agentloop.theme') || 'system';
  const dark = t === 'dark' || (t === 'system' && window.matchMedia('(prefers-color-scheme: dark)').matches);
  document.documentElement.dataset.theme = dark ? 'dark' : 'light';
}
applyTheme();
window.matchMedia('(prefers-color-scheme: dark)').addEventListener('change', applyTheme);

// ---- the page skeleton ------------------------------------------------------------------------
function skeleton() {
  const app = $('#app');
  app.replaceChildren(
    h('div', {id: 'signin', class: 'signin', 'data-testid': 'signin', hidden: true}),
    h('div', {id: 'shell', class: 'shell', hidden: true},
      h('aside', {id: 'side', class: 'side', 'data-testid': 'sidebar'},
        h('div', {class: 'side-top'},
          h('div', {class: 'brand'}, h('span', {class: 'logo', text: '∞'}), h('span', {text: 'agentloop'})),
          h('button', {class: 'icon-btn only-mobile', 'data-testid': 'close-sidebar', title: 'Close', onclick: closeDrawer}, icon('close'))),
        h('button', {id: 'new-thread', class: 'new-thread', 'data-testid': 'new-thread', onclick: () => newThread().then(focusComposer).catch(showError)},
          icon('plus'), h('span', {text: 'New chat'})),
        h('label', {class: 'search'}, icon('search'),
          h('input', {id: 'search', type: 'search', placeholder: 'Search chats', 'data-testid': 'search', autocomplete: 'off', oninput: onSearchInput})),
        h('nav', {id: 'thread-list', class: 'thread-list', 'data-testid': 'thread-list'}),
        h('button', {id: 'more', class: 'more', hidden: true, text: 'Load more', onclick: () => loadThreads(true)}),
        h('div', {class: 'side-foot'},
          h('span', {id: 'who', class: 'who', 'data-testid': 'principal'}),
          h('button', {class: 'icon-btn', 'data-testid': 'theme', title: 'Light / dark', onclick: toggleTheme}, icon('moon')),
          h('button', {class: 'icon-btn', 'data-testid': 'sign-out', title: 'Sign out', onclick: doSignOut}, icon('out')))),
      h('div', {id: 'scrim', class: 'scrim', onclick: closeDrawer}),
      h('main', {class: 'main'},
        h('header', {class: 'top'},
          h('button', {class: 'icon-btn only-mobile', 'data-testid': 'open-sidebar', title: 'Chats', onclick: openDrawer}, icon('menu')),
          h('div', {class: 'title-wrap'},
            h('button', {id: 'title', class: 'title', 'data-testid': 'thread-title', title: 'Rename', onclick: startRename, text: 'New chat'}),
            h('a', {id: 'parent-link', class: 'parent-link', 'data-testid': 'parent-link', hidden: true})),
          h('select', {id: 'model', class: 'model', 'data-testid': 'model-picker', title: 'Model', onchange: onModelChange}),
          h('div', {class: 'top-actions'},
            h('button', {id: 'settings-btn', class: 'icon-btn', 'data-testid': 'settings', title: 'Generation settings', onclick: toggleSettings}, icon('gear')),
            h('button', {id: 'export-btn', class: 'icon-btn', 'data-testid': 'export', title: 'Export', onclick: toggleExport}, icon('download')),
            h('button', {id: 'compact', class: 'icon-btn', 'data-testid': 'compact', hidden: true, onclick: compactThread,
              title: 'Compact: summarise this chat into a new chat (this one is left as it is)'}, icon('compress')),
            h('button', {id: 'inspector-btn', class: 'icon-btn', 'data-testid': 'inspector-toggle', title: 'Run inspector', onclick: toggleInspector}, icon('panel'))),
          h('div', {id: 'settings-pop', class: 'pop settings-pop', 'data-testid': 'settings-popover', hidden: true}),
          h('div', {id: 'export-pop', class: 'pop export-pop', 'data-testid': 'export-menu', hidden: true},
            h('button', {'data-testid': 'export-markdown', text: 'Export as Markdown', onclick: () => exportThread('markdown')}),
            h('button', {'data-testid': 'export-json', text: 'Export as JSON', onclick: () => exportThread('json')}))),
        h('div', {id: 'banners', class: 'banners'},
          h('div', {id: 'db-banner', class: 'banner bad', 'data-testid': 'db-banner', role: 'status', hidden: true,
            text: 'Database unavailable — the server cannot reach PostgreSQL. Nothing is lost; retrying…'}),
          h('div', {id: 'live-banner', class: 'banner warn', 'data-testid': 'liveness', role: 'status', hidden: true}),
          h('div', {id: 'model-banner', class: 'banner warn', 'data-testid': 'model-banner', hidden: true})),
        h('div', {class: 'body'},
          h('div', {id: 'log', class: 'log'},
            h('div', {id: 'msgs', class: 'msgs', 'data-testid': 'messages'}),
            h('div', {id: 'stream', class: 'msg assistant streaming', 'data-testid': 'streaming', hidden: true},
              h('details', {class: 'reasoning', hidden: true}, h('summary', {text: 'Thinking…'}), h('pre')),
              h('div', {class: 'bubble md'})),
            h('div', {id: 'queued', class: 'queued-list', 'data-testid': 'queued-turns'}),
            h('div', {id: 'bottom-pad', class: 'bottom-pad'})),
          h('aside', {id: 'inspector', class: 'inspector', 'data-testid': 'inspector', hidden: true})),
        h('div', {id: 'gate', class: 'gate', 'data-testid': 'gate', hidden: true}),
        h('div', {class: 'composer-wrap'},
          h('div', {id: 'error', class: 'error', 'data-testid': 'error', role: 'alert', hidden: true}),
          h('div', {id: 'busy-choice', class: 'busy-choice', 'data-testid': 'busy-choice', hidden: true},
            h('span', {text: 'The agent is still working on your last message.'}),
            h('button', {class: 'primary', 'data-testid': 'queue-send', text: 'Send after it finishes', onclick: () => send('enqueue')}),
            h('button', {'data-testid': 'interrupt-send', text: 'Stop it and send now', onclick: () => send('interrupt')}),
            h('button', {class: 'link', 'data-testid': 'keep-typing', text: 'Keep editing', onclick: hideBusyChoice})),
          h('form', {id: 'composer-form', class: 'composer', onsubmit: e => { e.preventDefault(); onSendClick(); }},
            h('textarea', {id: 'composer', 'data-testid': 'composer', rows: 1, placeholder: 'Message agentloop', 'aria-label': 'Message', oninput: onComposerInput,
              onkeydown: e => { if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); onSendClick(); } }}),
            h('div', {class: 'composer-side'},
              h('span', {id: 'limit', class: 'limit', 'data-testid': 'input-limit', hidden: true}),
              h('button', {id: 'send', class: 'send', type: 'submit', 'data-testid': 'send', title: 'Send (Enter)'}, icon('send')),
              h('button', {id: 'stop', class: 'send stop', type: 'button', 'data-testid': 'stop', title: 'Stop', hidden: true, onclick: cancelRun}, icon('stop')))),
          h('div', {class: 'statusbar'},
            h('span', {id: 'run-status', class: 'run-status', 'data-testid': 'run-status'}),
            h('span', {id: 'compaction-status', class: 'compaction-status', 'data-testid': 'compaction-status', hidden: true}),
            h('button', {id: 'ctx-btn', class: 'chip', 'data-testid': 'context', hidden: true, onclick: toggleContext, title: 'What the next model call carries', text: 'Context'}),
            h('button', {id: 'cancel', class: 'chip', 'data-testid': 'cancel', hidden: true, onclick: cancelRun, text: 'Cancel run'}),
            h('span', {id: 'transport', class: 'transport', 'data-testid': 'transport'}),
            h('div', {id: 'ctx-pop', class: 'pop ctx-pop', 'data-testid': 'context-popover', hidden: true}))))),
    h('div', {id: 'toast', class: 'toast', 'data-testid': 'toast', role: 'status', hidden: true}),
    h('div', {id: 'modal', class: 'modal', hidden: true}));
  $('#log').addEventListener('scroll', onLogScroll, {passive: true});
  document.addEventListener('click', onDocumentClick);
  document.addEventListener('keydown', e => {
    if (e.key !== 'Escape') return;
    closePops();
    if ($('#modal').hidden === false) closeModal(false);
    if (!mobile() || !S.inspector) return;
    toggleInspector();
  });
  window.addEventListener('hashchange', () => {
    const id = location.hash.slice(1);
    if (id && (!S.V || S.V.id !== id)) openThread(id);
    else if (!id && S.V) { S.V.close(); S.V = null; renderEmpty(); }
  });
}

function onDocumentClick(e) {
  const copy = e.target.closest('.copy-code');
  if (copy) {
    const code = copy.closest('.codeblock').querySelector('code');
    copyText(code.innerText).then(ok => flash(copy, ok ? 'Copied' : 'Copy failed'));
    return;
  }
  for (const [pop, btn] of [['#ctx-pop', '#ctx-btn'], ['#settings-pop', '#settings-btn'], ['#export-pop', '#export-btn']]) {
    const p = $(pop);
    if (p && !p.hidden && !p.contains(e.target) && !$(btn).contains(e.target)) p.hidden = true;
  }
  const menu = $('.item-menu');
  if (menu && !menu.contains(e.target) && !e.target.closest('.item-more')) menu.remove();
}

function closePops() { for (const p of ['#ctx-pop', '#settings-pop', '#export-pop']) $(p).hidden = true; $$('.item-menu').forEach(m => m.remove()); }

function flash(btn, text) {
  const old = btn.dataset.label || btn.textContent;
  btn.dataset.label = old;
  btn.textContent = text;
  setTimeout(() => { btn.textContent = old; }, 1500);
}

function focusComposer() { if (!mobile()) $('#composer').focus(); }
function openDrawer() { document.body.classList.add('drawer-open'); }
function closeDrawer() { document.body.classList.remove('drawer-open'); }
function toggleTheme() {
  const dark = document.documentElement.dataset.theme === 'dark';
  localStorage.setItem('agentloop.theme', dark ? 'light' : 'dark');
  applyTheme();
}

// ---- errors, toasts, dialogs -------------------------------------------------------------------
function showError(e) {
  const box = $('#error');
  if (!e) { box.hidden = true; box.textContent = ''; return; }
  if (e.name === 'AbortError') return;
  box.hidden = false;
  box.replaceChildren(h('span', {text: friendly(e)}), h('button', {class: 'link', text: 'Dismiss', onclick: () => showError(null)}));
  box.dataset.code = e.code || '';
}

/** An error in plain words, keeping its stable code for reference. */
function friendly(e) {
  const msg = e.message || String(e);
  switch (e.code) {
    case 'run_active': return 'The agent is still working on this chat. Wait for it, stop it, or queue your message.';
    case 'approval_required': return 'A tool call is waiting for your approval (above). Approve or reject it first.';
    case 'network': return 'The server cannot be reached. Check that agentloop is running.';
    case 'effects_in_branch': return 'This takes tool calls that already took effect (or may have) out of the conversation: ' +
      ((msg.match(/\(([^)]*)\)/) || [])[1] || 'see the thread') +
      '. They are not undone, and the model, no longer seeing them, may make them again.';
    default: return msg + (e.code ? ' (' + e.code + ')' : '');
  }
}

let toastTimer = null;
function toast(text, action) {
  const t = $('#toast');
  clearTimeout(toastTimer);
  t.replaceChildren(...[h('span', {text}), action ? h('button', {class: 'link', 'data-testid': 'toast-action', text: action.label, onclick: () => { t.hidden = true; action.run(); }}) : null].filter(Boolean));
  t.hidden = false;
  toastTimer = setTimeout(() => { t.hidden = true; }, action ? UNDO_MS : 3000);
}

let modalDone = null, modalOpener = null;
function confirmDialog(title, text, okLabel) {
  const m = $('#modal');
  // Focus goes back to what opened the dialog when it closes (acceptance probe K, K-11).
  modalOpener = document.activeElement;
  m.replaceChildren(h('div', {class: 'dialog', role: 'dialog', 'aria-modal': 'true', 'data-testid': 'confirm-dialog'},
    h('h2', {text: title}), h('p', {text}),
    h('div', {class: 'dialog-actions'},
      h('button', {'data-testid': 'confirm-cancel', text: 'Cancel', onclick: () => closeModal(false)}),
      h('button', {class: 'danger', 'data-testid': 'confirm-ok', text: okLabel, onclick: () => closeModal(true)}))));
  m.hidden = false;
  m.querySelector('[data-testid=confirm-ok]').focus();
  return new Promise(resolve => { modalDone = resolve; });
}
function closeModal(ok) {
  $('#modal').hidden = true;
  const opener = modalOpener;
  modalOpener = null;
  if (opener && opener.isConnected && typeof opener.focus === 'function') opener.focus();
  if (modalDone) { const d = modalDone; modalDone = null; d(ok); }
}

// ---- sign-in -------------------------------------------------------------------------------------
async function showSignIn(notice) {
  stopEverything();
  $('#shell').hidden = true;
  const box = $('#signin');
  box.hidden = false;
  const key = h('input', {type: 'password', 'data-testid': 'signin-key', placeholder: 'al_…', autocomplete: 'current-password', required: true});
  const err = h('div', {class: 'error', 'data-testid': 'signin-error', role: 'alert', hidden: !notice, text: notice || ''});
  const button = h('button', {class: 'primary', type: 'submit', 'data-testid': 'signin-submit', text: 'Sign in'});
  const local = h('button', {type: 'button', class: 'link', 'data-testid': 'signin-local', hidden: true, text: 'Continue without a key (local development)',
    onclick: async () => { if (await resume()) start(); }});
  box.replaceChildren(h('form', {class: 'card', onsubmit: async e => {
    e.preventDefault();
    button.disabled = true;
    err.hidden = true;
    try {
      await signIn(key.value.trim());
      await start();
      focusComposer();
    } catch (x) {
      err.hidden = false;
      err.textContent = x.status === 401 ? 'That API key is not valid (or it was revoked).' : friendly(x);
    } finally { button.disabled = false; }
  }},
  h('div', {class: 'brand big'}, h('span', {class: 'logo', text: '∞'}), h('span', {text: 'agentloop'})),
  h('p', {class: 'muted', text: 'Sign in with your API key. It is sent once; the browser then keeps only a session cookie it cannot read.'}),
  h('label', {class: 'field'}, h('span', {text: 'API key'}), key),
  err, button, local,
  h('p', {class: 'muted small', text: 'An operator creates keys with: agentloop-worker create-key --principal NAME'})));
  key.focus();
  loopbackAvailable().then(ok => { local.hidden = !ok; }).catch(() => {});
}

async function doSignOut() {
  await signOut();
  showSignIn('Signed out.');
}

function stopEverything() {
  if (S.V) { S.V.close(); S.V = null; }
  S.timers.forEach(t => clearInterval(t));
  S.timers = [];
}

auth.onExpired = () => {
  auth.mode = null;
  showSignIn('Your session ended: the key was revoked or expired. Sign in again.');
};

// ---- models & thread list ----------------------------------------------------------------------
async function loadModels() {
  try {
    const r = await api('GET', '/api/models');
    S.models = r.models || [];
  } catch (e) { S.models = []; }
  renderModelPicker();
}

const modelOf = id => S.models.find(m => m.id === id);
const defaultModel = () => S.models.find(m => m.default) || S.models[0];
/** The model the open thread (or a new one) uses. */
function currentModel() {
  const V = S.V;
  if (V && V.thread && V.thread.model) return modelOf(V.thread.model) || {id: V.thread.model, missing: true};
  return modelOf(localStorage.getItem('agentloop.model')) || defaultModel();
}

function renderModelPicker() {
  const sel = $('#model'), cur = currentModel();
  const opts = S.models.map(m => h('option', {value: m.id, selected: cur && m.id === cur.id,
    text: m.id + (m.contextTokens ? ' · ' + Math.round(m.contextTokens / 1000) + 'k' : '') + (m.supportsTools ? '' : ' · no tools')}));
  if (cur && cur.missing) opts.unshift(h('option', {value: cur.id, selected: true, disabled: true, text: cur.id + ' (not configured)'}));
  if (!opts.length) opts.push(h('option', {value: '', text: 'no models'}));
  const key = opts.map(o => o.value + o.selected).join();
  if (sel.dataset.key !== key) { sel.replaceChildren(...opts); sel.dataset.key = key; }
  const banner = $('#model-banner');
  banner.hidden = !(cur && cur.missing);
  if (cur && cur.missing) {
    banner.textContent = 'This chat\'s model "' + cur.id + '" is no longer configured on this server. Pick one of ' +
      S.models.map(m => m.id).join(', ') + ' above to continue.';
  }
  renderLimit();
}

async function onModelChange(e) {
  const id = e.target.value, V = S.V;
  localStorage.setItem('agentloop.model', id);
  if (!V) { renderModelPicker(); return; }
  try {
    const t = await api('PATCH', '/api/threads/' + V.id, {model: id});
    if (V.alive) { V.thread = Object.assign({}, V.thread, t); renderAll(); }
    toast('Model for this chat: ' + id);
  } catch (x) { showError(x); renderModelPicker(); }
}

async function loadThreads(more) {
  try {
    const q = more && S.nextCursor ? '&cursor=' + encodeURIComponent(S.nextCursor) : '';
    const r = await api('GET', '/api/threads?limit=50' + q);
    const list = (r.threads || []).filter(t => !(t.metadata && t.metadata.stateless));
    if (more) {
      S.threads.push(...list.filter(t => !S.threads.some(x => x.id === t.id)));
      S.nextCursor = r.nextCursor;
      S.morePages = true;
    } else {
      const ids = new Set(list.map(t => t.id));
      S.threads = list.concat(S.morePages ? S.threads.filter(t => !ids.has(t.id)) : []);
      if (!S.morePages) S.nextCursor = r.nextCursor;
    }
    renderThreads();
  } catch (e) { if (!S.threads.length && e.status !== 401) showError(e); }
}
let refreshTimer = null;
const refreshThreadsSoon = () => { clearTimeout(refreshTimer); refreshTimer = setTimeout(() => loadThreads(false), 300); };

function threadTitle(t, preview) {
  if (t && t.title) return t.title;
  if (preview && preview.text) return oneLine(preview.text, 48);
  return 'New chat';
}

function renderThreads() {
  if (S.search) return renderSearch();
  const V = S.V, list = $('#thread-list');
  const nodes = [];
  let group = null;
  for (const t of S.threads) {
    const g = dayGroup(t.updatedAt);
    if (g !== group) { nodes.push(h('div', {class: 'group', text: g})); group = g; }
    const cur = V && V.id === t.id;
    const run = cur ? shownRun(V) : t.run;
    const busy = run && isActive(run);
    nodes.push(h('div', {class: 'item' + (cur ? ' sel' : ''), 'data-testid': 'thread-item', 'data-thread-id': t.id, title: fullTime(t.updatedAt),
      onclick: e => { if (e.target.closest('.item-more')) return; closeDrawer(); if (!cur) openThread(t.id); }},
      h('span', {class: 'item-title', 'data-testid': 'thread-item-title', text: threadTitle(cur ? V.thread : t, t.preview)}),
      busy ? h('span', {class: 'dot-busy', 'data-testid': 'run-badge', title: run.status.replace('_', ' ')}) : null,
      h('button', {class: 'item-more icon-btn', 'data-testid': 'thread-menu', title: 'More', onclick: e => { e.stopPropagation(); threadMenu(t, e.currentTarget); }}, icon('dots'))));
  }
  if (!nodes.length) nodes.push(h('div', {class: 'empty-list', text: 'No chats yet.'}));
  list.replaceChildren(...nodes);
  $('#more').hidden = !S.nextCursor;
}

function threadMenu(t, anchor) {
  $$('.item-menu').forEach(m => m.remove());
  const menu = h('div', {class: 'item-menu pop', 'data-testid': 'thread-menu-popover'},
    h('button', {'data-testid': 'menu-rename', text: 'Rename', onclick: () => { menu.remove(); renameThread(t.id); }}),
    h('button', {'data-testid': 'menu-export', text: 'Export as Markdown', onclick: () => { menu.remove(); exportThread('markdown', t.id); }}),
    h('button', {class: 'danger', 'data-testid': 'menu-delete', text: 'Delete', onclick: () => { menu.remove(); deleteThread(t); }}));
  anchor.closest('.item').append(menu);
}

async function renameThread(id) {
  if (S.V && S.V.id === id) { startRename(); return; }
  await openThread(id);
  startRename();
}

function startRename() {
  const V = S.V;
  if (!V) return;
  const btn = $('#title');
  const input = h('input', {class: 'rename', 'data-testid': 'rename-input', value: V.thread.title || btn.textContent, maxlength: 500});
  const finish = async save => {
    if (!input.isConnected) return;
    const title = input.value.trim();
    input.replaceWith(btn);
    if (!save || title === (V.thread.title || '')) return;
    try {
      const t = await api('PATCH', '/api/threads/' + V.id, {title});
      V.thread = Object.assign({}, V.thread, t);
      const entry = S.threads.find(x => x.id === V.id);
      if (entry) entry.title = t.title;
      renderAll();
    } catch (e) { showError(e); }
  };
  input.addEventListener('keydown', e => {
    if (e.key === 'Enter') { e.preventDefault(); finish(true); }
    if (e.key === 'Escape') { e.preventDefault(); finish(false); }
  });
  input.addEventListener('blur', () => finish(true));
  btn.replaceWith(input);
  input.focus();
  input.select();
}

async function deleteThread(t) {
  const title = threadTitle(t, t.preview);
  if (!await confirmDialog('Delete chat?', '"' + title + '" will be deleted. You can undo this for a few seconds.', 'Delete')) return;
  try {
    await api('DELETE', '/api/threads/' + t.id);
    S.threads = S.threads.filter(x => x.id !== t.id);
    if (S.V && S.V.id === t.id) { S.V.close(); S.V = null; history.replaceState(null, '', location.pathname); renderEmpty(); }
    renderThreads();
    toast('Chat deleted.', {label: 'Undo', run: async () => {
      try {
        await api('POST', '/api/threads/' + t.id + '/restore');
        await loadThreads(false);
        openThread(t.id);
      } catch (e) { showError(e); }
    }});
  } catch (e) { showError(e); }
}

// ---- search ----------------------------------------------------------------------------------------
let searchTimer = null;
function onSearchInput(e) {
  clearTimeout(searchTimer);
  const q = e.target.value.trim();
  if (!q) { S.search = null; renderThreads(); return; }
  searchTimer = setTimeout(async () => {
    try {
      const r = await api('GET', '/api/search?q=' + encodeURIComponent(q) + '&limit=20');
      if ($('#search').value.trim() !== q) return;
      S.search = {q, r};
      renderSearch();
    } catch (x) { showError(x); }
  }, 250);
}

function snippet(text) {
  // U+0002 ... U+0003 mark the matched words; built as text nodes and <mark>, never as HTML.
  const out = [];
  const re = /\u0002([^\u0003]*)\u0003/g;
  let last = 0, m;
  while ((m = re.exec(text))) {
    out.push(text.slice(last, m.index), h('mark', {text: m[1]}));
    last = re.lastIndex;
  }
  out.push(text.slice(last));
  return out;
}

function renderSearch() {
  const {r} = S.search;
  const nodes = [];
  if (r.threads.length) nodes.push(h('div', {class: 'group', text: 'Titles'}));
  for (const t of r.threads) {
    nodes.push(h('div', {class: 'item', 'data-testid': 'search-title-hit', onclick: () => { closeDrawer(); openThread(t.id); }},
      h('span', {class: 'item-title', text: t.title || 'New chat'})));
  }
  if (r.messages.length) nodes.push(h('div', {class: 'group', text: 'Messages'}));
  for (const m of r.messages) {
    nodes.push(h('div', {class: 'item hit', 'data-testid': 'search-message-hit', 'data-thread-id': m.threadId, 'data-sequence': m.sequence,
      onclick: () => { closeDrawer(); openThread(m.threadId, m.sequence); }},
      h('span', {class: 'item-title', text: m.title || 'New chat'}),
      h('span', {class: 'snippet'}, h('b', {text: m.role === 'user' ? 'You: ' : 'Agent: '}), ...snippet(m.snippet))));
  }
  if (!nodes.length) nodes.push(h('div', {class: 'empty-list', 'data-testid': 'search-empty', text: 'No chat matches "' + S.search.q + '".'}));
  $('#thread-list').replaceChildren(...nodes);
  $('#more').hidden = true;
}

// ---- the open thread -----------------------------------------------------------------------------
function newView(id) {
  const V = {id, alive: true, thread: {id, title: ''}, msgs: new Map(), els: new Map(), slots: new Map(),
    runs: new Map(), gaps: [], stream: null, snapSeq: 0, cursor: 0, ctl: new AbortController(), timers: [], es: null,
    gone: new Set(), userRunIds: new Set(), compaction: null, inspect: null, liveness: null};
  V.close = () => { V.alive = false; V.ctl.abort(); if (V.es) V.es.close(); V.timers.forEach(t => { clearTimeout(t); clearInterval(t); }); };
  return V;
}

function renderEmpty() {
  $('#msgs').replaceChildren(h('div', {class: 'welcome', 'data-testid': 'welcome'},
    h('div', {class: 'logo big', text: '∞'}),
    h('h1', {text: 'What should the agent work on?'}),
    h('p', {class: 'muted', text: 'Long, tool-using runs keep going when you close the tab, when a worker crashes or the database restarts.'})));
  renderAll();
}

// A thread id is a UUID: anything else in the URL fragment (`#../session`) must never become
// part of an API path.
const THREAD_ID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

async function openThread(id, focusSeq) {
  if (!THREAD_ID.test(id)) {
    history.replaceState(null, '', location.pathname);
    if (S.V) { S.V.close(); S.V = null; }
    renderEmpty();
    showError({message: 'That chat does not exist (or was deleted).', code: 'not_found'});
    return;
  }
  if (S.V) S.V.close();
  const V = S.V = newView(id);
  // Each chat opened is a history entry: Back and Forward move between chats (the hashchange
  // listener opens the chat of the hash; acceptance probe K, K-10).
  if (location.hash !== '#' + id) history.pushState(null, '', '#' + id);
  $('#msgs').replaceChildren();
  closePops();
  showError(null);
  hideBusyChoice();
  setTransport('connecting…');
  renderAll();
  let d;
  try { d = await api('GET', '/api/threads/' + id, undefined, V.ctl.signal); } catch (e) {
    if (!V.alive) return;
    setTransport('');
    if (e.status === 404) { history.replaceState(null, '', location.pathname); S.V = null; renderEmpty(); showError({message: 'That chat does not exist (or was deleted).', code: 'not_found'}); return; }
    showError(e);
    return;
  }
  if (!V.alive) return;
  applyWindow(V, d, true);
  V.cursor = d.thread.lastEventSequence || 0;
  scrollDown(true);
  if (focusSeq != null) revealMessage(V, focusSeq);
  connect(V);
  V.timers.push(setInterval(() => pollRun(V), RUN_POLL_MS));
  pollRun(V);
}

function revealMessage(V, seq) {
  const el = V.els.get(seq);
  if (el) {
    el.scrollIntoView({block: 'center'});
    el.classList.add('found');
    setTimeout(() => el.classList.remove('found'), 2500);
  }
}

function applyWindow(V, d, fresh) {
  if (fresh) {
    V.msgs.clear(); V.els.clear(); V.slots.clear(); V.gaps = []; V.gone.clear();
    $('#msgs').replaceChildren();
    const o = d.messageWindow && d.messageWindow.omitted;
    if (o && o.count > 0) addGap(V, o.after == null ? 0 : o.after, o.before == null ? Infinity : o.before, o.count);
  }
  V.thread = d.thread;
  V.snapSeq = d.thread.lastEventSequence || 0;
  if (d.run) V.runs.set(d.run.id, d.run);
  setStream(V, d.streamingMessage);
  for (const m of d.messages || []) addMessage(V, m);
  renderAll();
}

function setStream(V, s) {
  V.stream = s && (s.content || s.reasoning) ? {runId: s.runId, content: s.content || '', reasoning: s.reasoning || ''} : null;
}

function place(node, seq) {
  node.dataset.seq = seq;
  const box = $('#msgs');
  let ref = box.lastElementChild;
  while (ref && Number(ref.dataset.seq) > seq) ref = ref.previousElementSibling;
  if (ref) ref.after(node); else box.prepend(node);
}

function addMessage(V, m) {
  if (!m || m.sequence == null || V.msgs.has(m.sequence) || V.gone.has(m.sequence) || m.active === false) return false;
  V.msgs.set(m.sequence, m);
  if (m.role === 'user' && m.runId) V.userRunIds.add(m.runId);
  if (m.sequence > (V.thread.lastSequence || 0)) {
    V.thread.lastSequence = m.sequence;
    V.thread.messageCount = (V.thread.messageCount || 0) + 1;
  }
  renderMessage(V, m);
  if (m.truncated) loadWhole(V, m);
  return true;
}

/** Largest message the page reads whole, in bytes (the messages page's `maxBytes` bound). */
const WHOLE_MESSAGE_BYTES = 2 * 1024 * 1024;

// A message that came shortened (a live update carries at most an eighth of its bound per
// member; the window cuts what its byte budget cannot hold) is read again whole, up to
// WHOLE_MESSAGE_BYTES, and drawn in its place: the answer a user reads, copies or edits is the
// stored one, not its head.
async function loadWhole(V, m) {
  const q = new URLSearchParams({after: String(m.sequence - 1), take: '1', maxBytes: String(WHOLE_MESSAGE_BYTES)});
  let r;
  try { r = await api('GET', '/api/threads/' + V.id + '/messages?' + q, undefined, V.ctl.signal); } catch (_) { return; }
  const whole = r && (r.messages || []).find(x => x.sequence === m.sequence);
  // Gone, or replaced by something newer, while this was read.
  if (!V.alive || !whole || whole.active === false || V.msgs.get(m.sequence) !== m) return;
  const stick = nearBottom();
  V.msgs.set(m.sequence, whole);
  const old = V.els.get(m.sequence);
  if (old && !(m.role === 'tool' && V.slots.has(m.toolCallId))) old.remove();
  renderMessage(V, whole);
  if (stick) scrollDown(true);
}

function fillSlot(slot, m) {
  const card = slot.closest('.call');
  slot.textContent = tame(textOf(m.content)) || '(empty result)';
  slot.className = 'result';
  slot.setAttribute('data-testid', 'message');
  slot.setAttribute('data-role', 'tool');
  slot.setAttribute('data-sequence', m.sequence);
  if (card) {
    card.dataset.status = /^(error|outcome unknown|Tool call declined)/i.test(slot.textContent) ? 'error' : 'done';
    const st = card.querySelector('.call-state');
    if (st) st.textContent = card.dataset.status === 'error' ? 'error' : 'done';
  }
}

function actionButton(id, iconName, title, fn, cls) {
  return h('button', {type: 'button', class: 'act' + (cls ? ' ' + cls : ''), 'data-testid': id, title, 'aria-label': title,
    onclick: e => { e.stopPropagation(); fn(e.currentTarget); }}, icon(iconName));
}

function renderMessage(V, m) {
  const txt = textOf(m.content);
  if (m.role === 'tool') {
    const slot = V.slots.get(m.toolCallId);
    if (slot) { fillSlot(slot, m); V.els.set(m.sequence, slot); return; }
    const node = h('details', {class: 'msg tool orphan', 'data-testid': 'message', 'data-role': 'tool', 'data-sequence': m.sequence,
      'data-tool-call-id': m.toolCallId, title: fullTime(m.createdAt)},
      h('summary', {text: 'tool result'}, h('code', {text: ' ' + oneLine(txt)})), h('pre', {text: txt}));
    V.els.set(m.sequence, node);
    place(node, m.sequence);
    return;
  }
  const node = h('div', {class: 'msg ' + m.role + (m.stopped ? ' stopped' : ''), 'data-testid': 'message', 'data-role': m.role, 'data-sequence': m.sequence});
  if (m.role === 'system' || m.role === 'developer') {
    node.append(h('details', {class: 'sys'}, h('summary', {text: txt.startsWith('Summary of the earlier conversation') ? 'Summary of the earlier conversation' : m.role + ' instructions'}),
      h('div', {class: 'bubble', text: txt})));
  } else {
    if (m.reasoning) node.append(h('details', {class: 'reasoning'}, h('summary', {text: 'Thought process'}), h('pre', {text: m.reasoning})));
    if (txt) {
      const bubble = h('div', {class: 'bubble' + (m.role === 'assistant' ? ' md' : '')});
      if (m.role === 'assistant') setMarkdown(bubble, txt); else bubble.textContent = tame(txt);
      node.append(bubble);
    }
    if (m.truncated) node.append(h('div', {class: 'note', 'data-testid': 'shortened', text: '(long message: shortened here — export the chat to read it whole)'}));
    if (m.stopped) node.append(h('div', {class: 'stopped-tag', 'data-testid': 'stopped', text: 'Stopped — you interrupted this answer'}));
    // The provider ended the answer early (finish_reason `length`, `content_filter`, ...).
    if (m.finishReason) node.append(h('div', {class: 'stopped-tag', 'data-testid': 'cut', text: m.finishReason === 'length'
      ? 'Cut off — the answer reached the length limit (max tokens or the end of the context)'
      : 'Cut off — the model ended this answer early (' + m.finishReason + ')'}));
    for (const c of m.toolCalls || []) node.append(toolCard(V, c));
    if (!txt && !(m.toolCalls || []).length && !m.reasoning) node.append(h('div', {class: 'note', text: '(empty message)'}));
  }
  node.append(messageActions(V, m, node, txt));
  V.els.set(m.sequence, node);
  place(node, m.sequence);
}

function toolCard(V, c) {
  const fn = c.function || {};
  const slot = h('pre', {class: 'result pending', text: 'running…'});
  const args = h('pre', {class: 'args'}, h('code', {class: 'hljs'}));
  args.firstChild.innerHTML = highlight(prettyArgs(fn.arguments), 'json');
  const card = h('details', {class: 'call', 'data-testid': 'tool-call', 'data-tool-call-id': c.id, 'data-status': 'pending'},
    h('summary', null, icon('tool'), h('b', {text: fn.name || 'tool'}), h('code', {class: 'call-args', text: oneLine(fn.arguments, 60)}),
      h('span', {class: 'call-state', text: 'running'})),
    h('div', {class: 'lbl', text: 'Arguments'}), args,
    h('div', {class: 'lbl', text: 'Result'}), slot);
  V.slots.set(c.id, slot);
  for (const [seq, el] of V.els) {
    const tm = V.msgs.get(seq);
    if (tm && tm.role === 'tool' && tm.toolCallId === c.id && el.parentElement === $('#msgs')) {
      el.remove(); fillSlot(slot, tm); V.els.set(seq, slot);
    }
  }
  return card;
}

function messageActions(V, m, node, txt) {
  const path = '/messages/' + m.sequence;
  const acts = h('div', {class: 'acts'});
  if (m.branch && m.branch.count > 1) acts.append(branchSwitcher(V, m, node));
  if (txt && (m.role === 'user' || m.role === 'assistant')) {
    acts.append(actionButton('copy', 'copy', 'Copy', async b => { const ok = await copyText(txt); b.classList.toggle('ok', ok); b.replaceChildren(icon(ok ? 'check' : 'copy')); setTimeout(() => b.replaceChildren(icon('copy')), 1500); }));
  }
  if (m.role === 'user') acts.append(actionButton('edit', 'edit', 'Edit (the answer after it is replaced; the old version stays as a branch)', () => startEdit(V, m, node)));
  if (m.role === 'assistant') acts.append(actionButton('regenerate', 'redo', 'Regenerate (the old answer stays as a branch)', () => branchOp(V, node, 'POST', path + '/regenerate', {})));
  acts.append(actionButton('delete', 'trash', (m.toolCalls || []).length ? 'Delete this message with its tool results' : 'Delete this message', async () => {
    if (!await confirmDialog('Delete message?', 'This message' + ((m.toolCalls || []).length ? ' and its tool results' : '') + ' will be removed from the conversation the agent sees.', 'Delete')) return;
    branchOp(V, node, 'DELETE', path);
  }, 'danger'));
  acts.append(h('time', {class: 'when', 'data-testid': 'timestamp', datetime: m.createdAt || '', title: fullTime(m.createdAt), text: shortTime(m.createdAt)}));
  return acts;
}

function branchSwitcher(V, m, node) {
  const {index, count} = m.branch;
  const go = async delta => {
    try {
      const list = await api('GET', '/api/threads/' + V.id + '/messages/' + m.sequence + '/branches');
      const target = list.branches[list.index - 1 + delta];
      if (!target) return;
      await branchOp(V, node, 'POST', '/messages/' + m.sequence + '/branches/activate', {firstSequence: target.firstSequence});
      await reload(V);
    } catch (e) { actionError(node, e); }
  };
  return h('span', {class: 'branches', 'data-testid': 'branch-switcher'},
    h('button', {class: 'act', 'data-testid': 'branch-prev', title: 'Previous version', disabled: index <= 1, onclick: e => { e.stopPropagation(); go(-1); }}, icon('left')),
    h('span', {'data-testid': 'branch-index', text: index + ' / ' + count}),
    h('button', {class: 'act', 'data-testid': 'branch-next', title: 'Next version', disabled: index >= count, onclick: e => { e.stopPropagation(); go(1); }}, icon('right')));
}

/** Updates the branch switchers of the shown messages from a fresh window (nothing is cleared). */
async function refreshMarks(V) {
  try {
    const d = await api('GET', '/api/threads/' + V.id, undefined, V.ctl.signal);
    if (!V.alive) return;
    for (const m of d.messages || []) {
      const mine = V.msgs.get(m.sequence), el = V.els.get(m.sequence);
      if (!mine || !el || JSON.stringify(mine.branch || null) === JSON.stringify(m.branch || null)) continue;
      mine.branch = m.branch;
      const acts = el.querySelector(':scope > .acts');
      if (acts) acts.replaceWith(messageActions(V, mine, el, textOf(mine.content)));
    }
  } catch (_) { /* the next event or reload brings them */ }
}

function actionError(node, e) {
  let box = node.querySelector(':scope > .act-err');
  if (!e) { if (box) box.remove(); return; }
  if (!box) node.append(box = h('div', {class: 'act-err', 'data-testid': 'action-error', role: 'alert'}));
  box.textContent = friendly(e) + (e.code && !friendly(e).includes(e.code) ? ' (' + e.code + ')' : '');
}

async function branchOp(V, node, method, path, body) {
  const buttons = [...node.querySelectorAll('.acts button, .edit button')];
  buttons.forEach(x => { x.disabled = true; });
  actionError(node, null);
  try {
    const r = await api(method, '/api/threads/' + V.id + path, body);
    if (!V.alive) return true;
    $$('#msgs .act-err').forEach(x => x.remove());
    if (/\/(edit|regenerate)$/.test(path)) {
      // A new version: an edited message is the newest of its fork (‹ n/n ›); a regenerated
      // answer gets its switcher when its run ends (refreshMarks).
      V.branchPending = true;
      const old = V.msgs.get(Number(path.split('/')[2]));
      if (r.message && /\/edit$/.test(path)) {
        const n = ((old && old.branch && old.branch.count) || 1) + 1;
        r.message.branch = {index: n, count: n};
      }
    }
    dropMessages(V, r.deactivated);
    addMessage(V, r.message);
    if (r.run && !V.runs.has(r.run.id)) V.runs.set(r.run.id, r.run);
    renderAll();
    // The live event of the new message (without its ‹ n/n ›) and even the end of its run may
    // have come before this answer: read the switchers from the server now as well.
    if (/\/(edit|regenerate)$/.test(path)) refreshMarks(V);
    if (r.run) scrollDown(true);
    refreshThreadsSoon();
    return true;
  } catch (e) {
    // Replacing calls that took effect: the server asks, the user decides (migration 000037).
    if (e.code === 'effects_in_branch' && !(body && body.repeatEffects) && V.alive &&
        await confirmDialog('Tool calls took effect', friendly(e), 'Go ahead')) {
      return method === 'DELETE'
        ? branchOp(V, node, method, path + '?repeatEffects=true', body)
        : branchOp(V, node, method, path, Object.assign({}, body, {repeatEffects: true}));
    }
    if (node.isConnected) actionError(node, e); else showError(e);
    return false;
  } finally { buttons.forEach(x => { x.disabled = false; }); }
}

function startEdit(V, m, node) {
  if (node.querySelector('.edit')) return;
  const bubble = node.querySelector(':scope > .bubble');
  const ta = h('textarea', {'data-testid': 'edit-input', rows: Math.min(8, textOf(m.content).split('\n').length + 1)});
  ta.value = tame(textOf(m.content));
  const close = () => { box.remove(); node.classList.remove('editing'); if (bubble) bubble.hidden = false; actionError(node, null); };
  const save = async () => {
    if (!ta.value.trim()) return;
    if (await branchOp(V, node, 'POST', '/messages/' + m.sequence + '/edit', {content: ta.value}) && node.isConnected) close();
  };
  ta.addEventListener('keydown', e => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) { e.preventDefault(); save(); }
    if (e.key === 'Escape') close();
  });
  const box = h('div', {class: 'edit'}, ta, h('div', {class: 'row'},
    h('button', {type: 'button', 'data-testid': 'edit-cancel', text: 'Cancel', onclick: close}),
    h('button', {type: 'button', class: 'primary', 'data-testid': 'edit-save', text: 'Save & submit', title: 'Ctrl+Enter', onclick: save})));
  if (bubble) bubble.hidden = true;
  node.classList.add('editing');
  node.insertBefore(box, node.querySelector(':scope > .acts'));
  ta.focus();
}

function dropMessages(V, seqs) {
  let n = 0;
  for (const s of seqs || []) {
    if (V.gone.has(s)) continue;
    V.gone.add(s);
    n += 1;
    const m = V.msgs.get(s), el = V.els.get(s);
    V.msgs.delete(s);
    V.els.delete(s);
    for (const c of (m && m.toolCalls) || []) V.slots.delete(c.id);
    if (!el) continue;
    if (el.classList.contains('result')) {
      el.className = 'result pending'; el.textContent = 'running…';
      el.removeAttribute('data-testid'); el.removeAttribute('data-sequence');
    } else el.remove();
  }
  if (n) V.thread.messageCount = Math.max(0, (V.thread.messageCount || 0) - n);
}

// ---- older messages load on scrolling up ---------------------------------------------------------
function addGap(V, after, before, count, later) {
  const g = {after, before, count, loading: false};
  const what = later ? (count ? fmt(count) + ' more messages' : 'More messages') + ' — loading'
    : (count ? fmt(count) + ' earlier messages' : 'Earlier messages') + ' — scroll up to load';
  g.el = h('div', {class: 'gap', 'data-testid': 'load-earlier'}, h('span', {class: 'spinner'}), h('span', {text: what}));
  V.gaps.push(g);
  place(g.el, after + 0.5);
}

function onLogScroll() {
  const V = S.V;
  if (!V) return;
  const log = $('#log'), top = log.getBoundingClientRect().top;
  for (const g of V.gaps) {
    if (g.loading) continue;
    const r = g.el.getBoundingClientRect();
    if (r.bottom > top - 400 && r.top < top + log.clientHeight) loadGap(V, g);
  }
}

async function loadGap(V, g) {
  g.loading = true;
  g.el.classList.add('loading');
  // The page just before the gap's lower edge (the messages next to what is on screen); rows at
  // or below its upper edge are already shown and dropped below.
  const q = new URLSearchParams({take: '100'});
  if (Number.isFinite(g.before)) q.set('before', g.before); else if (g.after > 0) q.set('after', g.after);
  let r;
  try { r = await api('GET', '/api/threads/' + V.id + '/messages?' + q, undefined, V.ctl.signal); } catch (e) {
    if (!V.alive) return;
    g.loading = false;
    g.el.classList.remove('loading');
    showError(e);
    return;
  }
  if (!V.alive) return;
  // Older messages appear above what is being read: keep the message below the gap where it is
  // on screen (so the gap moves up out of view instead of loading page after page).
  const log = $('#log'), anchor = g.el.nextElementSibling;
  const before = anchor ? anchor.getBoundingClientRect().top : null;
  const keep = anchor ? () => { log.scrollTop += anchor.getBoundingClientRect().top - before; } : scrollKeeper();
  const got = (r.messages || []).filter(m => m.sequence > g.after && m.sequence < g.before).sort((a, b) => a.sequence - b.sequence);
  g.el.remove();
  V.gaps = V.gaps.filter(x => x !== g);
  got.forEach(m => addMessage(V, m));
  if (got.length) {
    const first = got[0].sequence, last = got[got.length - 1].sequence;
    const left = Math.max(0, (g.count || 0) - got.length);
    if (r.hasMoreBefore !== false && first > g.after + 1) addGap(V, g.after, first, left);
    // A page read forwards (a gap open at the bottom: the window left out the newest messages,
    // larger than its budget) stops at its size: the rest of the gap stays to load — without it
    // the newest answer never appeared after a reload (acceptance probe K, K-3).
    else if (r.hasMoreAfter && last + 1 < g.before) addGap(V, last, g.before, left, true);
  }
  keep();
  setTimeout(onLogScroll, 50);
}

// ---- run state ------------------------------------------------------------------------------------
/**
 * Keeps `run` (a command's answer) unless the page already has a newer state of it: the live
 * update of a cancelled run can arrive before the answer to the cancel, which carries the run as
 * the command left it (still running, cancel requested) and put Stop back on a stopped run.
 */
function keepRun(V, run) {
  const known = V.runs.get(run.id);
  if (!known || !(Date.parse(known.updatedAt) > Date.parse(run.updatedAt))) V.runs.set(run.id, run);
}

function shownRun(V) {
  let best = null;
  const t = r => Date.parse(r.createdAt) || 0;
  for (const r of V.runs.values()) {
    if (isActive(r)) {
      if (!isActive(best) || RANK[r.status] < RANK[best.status] || (RANK[r.status] === RANK[best.status] && t(r) < t(best))) best = r;
    } else if (!best || (!isActive(best) && t(r) >= t(best))) best = r;
  }
  return best;
}

const runText = (V, r) => (r.kind === 'compaction' ? 'Compaction: ' : '') + agentRunText(V, r);

function agentRunText(V, r) {
  const model = modelOf(r.model), limit = r.contextLimit || (model && model.contextTokens);
  const ctxTokens = r.contextTokens != null ? r.contextTokens : V.thread.contextTokens;
  const ctx = ctxTokens != null ? ' · context ' + fmt(ctxTokens) + (limit ? ' / ' + fmt(limit) : '') : '';
  const extra = (r.toolCallsUsed ? ' · ' + r.toolCallsUsed + ' tool call' + (r.toolCallsUsed === 1 ? '' : 's') : '') +
    (r.recoveries ? ' · recovered ×' + r.recoveries : '');
  const cancelling = isActive(r) && r.cancelRequestedAt ? 'Stopping… ' : '';
  switch (r.status) {
    case 'pending': return cancelling + 'Queued behind the current run';
    case 'queued': return cancelling + 'Waiting for a worker' + (r.attempts ? ' (attempt ' + (r.attempts + 1) + ')' : '');
    case 'running': return cancelling + 'Working · step ' + ((r.stepsUsed || 0) + 1) + ctx + extra;
    case 'waiting_approval': return cancelling + 'Waiting for your approval' + ctx;
    case 'waiting_authorization': return cancelling + 'Waiting for you to sign in to a tool server';
    case 'blocked': return cancelling + 'Blocked' + (r.error ? ': ' + r.error.message : '');
    case 'completed': return 'Done · ' + (r.stepsUsed || 0) + ' step' + (r.stepsUsed === 1 ? '' : 's') +
      ' · ' + fmt(r.promptTokens) + ' in / ' + fmt(r.completionTokens) + ' out tokens' + extra;
    case 'failed': return 'Failed: ' + (r.error ? r.error.message + ' (' + r.error.code + ')' : 'unknown error');
    case 'cancelled': return 'Stopped';
    default: return r.status;
  }
}

function renderStatus() {
  const V = S.V, el = $('#run-status'), r = V && shownRun(V);
  const queued = V ? [...V.runs.values()].filter(x => x !== r && isActive(x)).length : 0;
  el.textContent = V && V.deleted ? 'This chat was deleted.'
    : (r ? runText(V, r) : '') + (queued ? ' · ' + queued + ' more queued' : '');
  el.dataset.status = r ? r.status : 'none';
  el.dataset.runId = r ? r.id : '';
  const busy = isActive(r);
  $('#cancel').hidden = !busy;
  $('#cancel').disabled = !!(r && r.cancelRequestedAt);
  $('#send').hidden = busy && !$('#composer').value.trim();
  $('#stop').hidden = !busy;
  $('#stop').disabled = !!(r && r.cancelRequestedAt);
  if (!busy) hideBusyChoice();
  const cs = $('#compaction-status'), k = V && V.compaction;
  const show = !!(k && r && k.runId === r.id && (k.done || isActive(r)));
  cs.hidden = !show;
  cs.dataset.state = show ? (k.done ? 'done' : 'running') : '';
  cs.textContent = !show ? '' : k.done
    ? 'context compacted (' + fmt(k.inputTokens) + ' → ' + fmt(k.summaryTokens) + ' tokens' + (k.passes > 1 ? ', ' + k.passes + ' passes' : '') + ')'
    : (k.label || 'reducing context, part ' + k.part + '/' + k.of) + '…';
  $('#ctx-btn').hidden = !V;
  renderLiveness();
}

/** The liveness banner: a queued run nobody claims, a worker that stopped renewing its lease. */
function renderLiveness() {
  const V = S.V, el = $('#live-banner'), r = V && shownRun(V), l = V && V.liveness;
  let text = '';
  let state = 'ok';
  if (r && l && l.runId === r.id && l.status === r.status && isActive(r)) {
    state = l.state;
    const s = Math.round((l.sinceMs || 0) / 1000);
    if (l.state === 'unclaimed') text = 'No worker has picked up this run for ' + s + ' s. All workers may be busy, or none is running.';
    if (l.state === 'lease_stale') text = 'The worker running this chat has gone quiet for ' + s + ' s (it may have crashed). Another worker takes over in ' + Math.max(0, Math.round((l.expiresInMs || 0) / 1000)) + ' s; nothing is lost.';
    if (l.state === 'lease_expired') text = 'The worker running this chat was lost. Recovery in progress: the run continues on another worker from its last checkpoint.';
  }
  el.hidden = !text;
  el.dataset.state = state;
  el.textContent = text;
}

async function pollRun(V) {
  if (!V.alive || document.hidden) return;
  const r = shownRun(V);
  if (!r || (!isActive(r) && !S.inspector) || (!isActive(r) && V.inspect && V.inspect.id === r.id && !isActive(V.inspect))) return;
  try {
    const d = await api('GET', '/api/runs/' + r.id, undefined, V.ctl.signal);
    if (!V.alive) return;
    V.inspect = d;
    V.liveness = Object.assign({runId: d.id, status: d.status}, d.liveness || {});
    const known = V.runs.get(d.id);
    if (!known || Date.parse(d.updatedAt) > Date.parse(known.updatedAt)) {
      const copy = Object.assign({}, d);
      delete copy.steps; delete copy.toolCalls; delete copy.liveness; delete copy.compactions;
      V.runs.set(d.id, copy);
    }
    renderStatus();
    renderInspector();
  } catch (e) { /* the db banner and the sign-in screen handle their cases */ }
}

function renderQueued() {
  const V = S.V, box = $('#queued');
  const t = r => Date.parse(r.createdAt) || 0;
  const list = !V ? [] : [...V.runs.values()]
    .filter(r => r.input && (r.status === 'pending' || (isActive(r) && !V.userRunIds.has(r.id))))
    .sort((a, b) => t(a) - t(b));
  const key = list.map(r => r.id + ':' + r.status + ':' + (r.cancelRequestedAt ? 1 : 0)).join();
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.replaceChildren(...list.map(r => {
    const cancel = async e => {
      e.target.disabled = true;
      try {
        const res = await api('POST', '/api/runs/' + r.id + '/cancel');
        const run = res && (res.run || (res.id ? res : null));
        if (run && V.alive) { keepRun(V, run); renderAll(); }
      } catch (err) { showError(err); e.target.disabled = false; }
    };
    return h('div', {class: 'msg user queued', 'data-testid': 'queued-turn', 'data-run-id': r.id, title: 'Sent after the current run finishes'},
      h('div', {class: 'bubble', text: textOf(r.input.content)}),
      h('div', {class: 'acts'}, h('span', {class: 'note', text: r.status === 'pending' ? 'queued — sent when the current run finishes' : 'starting…'}),
        r.status === 'pending' ? h('button', {type: 'button', class: 'link', 'data-testid': 'cancel-queued', text: 'Cancel', onclick: cancel}) : null));
  }));
}

// The partial answer is drawn at most once per animation frame, and each draw re-renders the
// whole answer's Markdown: for a long answer a draw is kept to at most a fifth of the time
// (the next waits four times as long as the last took), so a stream of a large answer never
// keeps the page busy (acceptance probe K, K-12).
let streamFrame = 0, streamTimer = 0, streamDrawnAt = 0, streamDrawMs = 0;
function renderStream() {
  const ending = !(S.V && S.V.stream);
  if (streamTimer && ending) { clearTimeout(streamTimer); streamTimer = 0; }
  if (streamFrame || streamTimer) return;
  const wait = streamDrawnAt + 4 * streamDrawMs - performance.now();
  if (!ending && wait > 16) { streamTimer = setTimeout(() => { streamTimer = 0; renderStream(); }, wait); return; }
  streamFrame = requestAnimationFrame(() => {
    streamFrame = 0;
    const V = S.V, box = $('#stream'), s = V && V.stream;
    box.hidden = !s;
    if (!s) return;
    box.dataset.runId = s.runId || '';
    const bubble = box.querySelector('.bubble');
    const started = performance.now();
    setMarkdown(bubble, s.content);
    streamDrawnAt = performance.now();
    streamDrawMs = streamDrawnAt - started;
    bubble.hidden = !s.content && !!s.reasoning;
    const rd = box.querySelector('details');
    rd.hidden = !s.reasoning;
    rd.querySelector('pre').textContent = tame(s.reasoning);
  });
}

function renderHeader() {
  const V = S.V, t = V && V.thread;
  let first = null;
  if (V) for (const m of V.msgs.values()) if (m.role === 'user' && (!first || m.sequence < first.sequence)) first = m;
  const entry = V && S.threads.find(x => x.id === V.id);
  const title = V ? threadTitle(t, first ? {text: textOf(first.content)} : entry && entry.preview) : 'New chat';
  const btn = $('#title');
  if (btn) btn.textContent = tame(title);
  document.title = V ? title + ' · agentloop' : 'agentloop';
  const pid = t && t.parentThreadId, link = $('#parent-link');
  link.hidden = !pid;
  if (pid) { link.href = '#' + pid; link.textContent = tame('↖ compacted from ' + parentTitle(pid)); }
  $('#compact').hidden = !V;
  $('#export-btn').hidden = !V;
  $('#settings-btn').hidden = !V;
  renderModelPicker();
}

function parentTitle(id) {
  const t = S.threads.find(x => x.id === id);
  if (t && t.title) return t.title;
  if (!(id in S.titles)) {
    S.titles[id] = 'the parent chat';
    api('GET', '/api/threads/' + id).then(d => {
      const first = (d.messages || []).find(m => m.role === 'user');
      S.titles[id] = threadTitle(d.thread, first ? {text: textOf(first.content)} : null);
      renderHeader();
    }).catch(() => {});
  }
  return S.titles[id];
}

function renderAll() { renderHeader(); renderStatus(); renderStream(); renderQueued(); renderThreads(); renderGate(); renderInspector(); }

// ---- composer, Send / Stop, queue or interrupt -----------------------------------------------------
function onComposerInput() {
  const ta = $('#composer');
  ta.style.height = 'auto';
  ta.style.height = Math.min(ta.scrollHeight, Math.round(window.innerHeight * 0.35)) + 'px';
  renderLimit();
  renderStatus();
}

/** The input limit, shown when the text gets near it (the server refuses larger turns: 413). */
function renderLimit() {
  const el = $('#limit');
  if (!el) return;
  const model = currentModel(), text = $('#composer').value;
  const max = model && model.maxInputTokens;
  const used = text ? roughTokens(text) : 0;
  const near = max && used > max * 0.5;
  el.hidden = !near;
  el.classList.toggle('over', !!(max && used > max));
  el.textContent = near ? '≈' + fmt(used) + ' / ' + fmt(max) + ' tokens' : '';
  el.title = max ? 'The largest message ' + model.id + ' accepts is about ' + fmt(max) + ' tokens.' : '';
}

function hideBusyChoice() { const b = $('#busy-choice'); if (b) b.hidden = true; }

function onSendClick() {
  const V = S.V, r = V && shownRun(V);
  if (!$('#composer').value.trim()) return;
  // A turn whose answer was lost is sent again exactly as it was (same key, same mode): the
  // server answers with the turn it took, whatever the run does now (verification probe L,
  // L-7: the "send after it finishes" choice offered here sent it again under a new key).
  const p = pendingTurn;
  if (p && V && p.threadId === V.id && p.content === $('#composer').value) { send(p.multitask || undefined); return; }
  const model = currentModel(), used = roughTokens($('#composer').value);
  if (model && model.maxInputTokens && used > model.maxInputTokens) {
    showError({code: 'turn_too_large', message: 'This message is about ' + fmt(used) + ' tokens; ' + model.id +
      ' accepts at most about ' + fmt(model.maxInputTokens) + ' tokens in one message. Shorten it or split it up.'});
    return;
  }
  if (isActive(r)) {
    if (r.status === 'waiting_approval') { showError({code: 'approval_required', message: ''}); return; }
    $('#busy-choice').hidden = false;
    return;
  }
  send();
}

/** The idempotency key of the turn being sent: a resend of the same text to the same chat
 *  after a failure whose outcome the page cannot know (the request reached the server, the
 *  answer was lost) carries the same key, so the server answers with the turn it already took
 *  instead of taking it twice (acceptance probe K, K-5). A new text gets a new key. */
let pendingTurn = null;
function turnKey(threadId, content, multitask) {
  const p = pendingTurn;
  if (!p || p.threadId !== threadId || p.content !== content || p.multitask !== multitask) {
    // crypto.getRandomValues, not randomUUID: the latter exists only in secure contexts, and
    // an api served over plain HTTP on a LAN address is not one.
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    pendingTurn = {threadId, content, multitask, key: 'ui-' + Array.from(bytes, b => b.toString(16).padStart(2, '0')).join('')};
  }
  return pendingTurn.key;
}

async function send(multitask) {
  const ta = $('#composer'), content = ta.value;
  if (!content.trim()) return;
  hideBusyChoice();
  const btn = $('#send');
  btn.disabled = true;
  try {
    if (!S.V) await newThread();
    const V = S.V;
    const body = {content, commandId: turnKey(V.id, content, multitask || null)};
    if (multitask) body.multitask = multitask;
    const r = await api('POST', '/api/threads/' + V.id + '/chat', body);
    pendingTurn = null;
    showError(null);
    ta.value = '';
    onComposerInput();
    if (V.alive) {
      addMessage(V, r.message);
      if (r.run && !V.runs.has(r.run.id)) V.runs.set(r.run.id, r.run);
      renderAll();
      scrollDown(true);
      pollRun(V);
    }
    refreshThreadsSoon();
  } catch (e) {
    // A refusal the server answered (4xx) took nothing: the next try is a new turn. Without an
    // answer (the network, a 5xx) the turn may have been taken: it keeps its key.
    if (e.status >= 400 && e.status < 500) pendingTurn = null;
    if (e.code === 'run_active') $('#busy-choice').hidden = false;
    else showError(e);
  } finally { btn.disabled = false; focusComposer(); }
}

async function newThread() {
  const model = $('#model').value || undefined;
  const t = await api('POST', '/api/threads', model && modelOf(model) ? {model} : {});
  S.threads = [Object.assign({messageCount: 0, preview: null, run: null}, t)].concat(S.threads.filter(x => x.id !== t.id));
  if (S.search) { S.search = null; $('#search').value = ''; }
  await openThread(t.id);
  closeDrawer();
  return t;
}

async function compactThread() {
  const V = S.V, btn = $('#compact');
  if (!V) return;
  btn.disabled = true;
  try {
    const r = await api('POST', '/api/threads/' + V.id + '/compact');
    showError(null);
    S.titles[V.id] = $('#title').textContent;
    S.threads = [Object.assign({messageCount: 0, preview: null, run: r.run}, r.thread)].concat(S.threads.filter(x => x.id !== r.thread.id));
    await openThread(r.thread.id);
    refreshThreadsSoon();
  } catch (e) { showError(e); } finally { btn.disabled = false; }
}

async function cancelRun() {
  const V = S.V, r = V && shownRun(V);
  if (!isActive(r)) return;
  $('#stop').disabled = true;
  $('#cancel').disabled = true;
  try {
    const res = await api('POST', '/api/runs/' + r.id + '/cancel');
    const run = res && (res.run || (res.id ? res : null));
    if (run && V.alive) { keepRun(V, run); renderAll(); }
  } catch (e) { showError(e); $('#stop').disabled = false; $('#cancel').disabled = false; }
}

async function exportThread(format, id) {
  closePops();
  const tid = id || (S.V && S.V.id);
  if (!tid) return;
  try {
    const name = await download('/api/threads/' + tid + '/export?format=' + format, 'chat.' + (format === 'json' ? 'json' : 'md'));
    toast('Exported ' + name);
  } catch (e) { showError(e); }
}

function toggleExport() { const p = $('#export-pop'); const open = p.hidden; closePops(); p.hidden = !open; }

// ---- generation settings -------------------------------------------------------------------------
function toggleSettings() {
  const pop = $('#settings-pop'), V = S.V;
  const open = pop.hidden;
  closePops();
  if (!open || !V) return;
  const meta = V.thread.metadata || {};
  const model = currentModel();
  const maxTokens = h('input', {type: 'number', min: 1, step: 1, 'data-testid': 'setting-max-tokens', value: meta.maxTokens != null ? meta.maxTokens : '',
    placeholder: model && model.defaultMaxTokens ? 'default ' + fmt(model.defaultMaxTokens) : 'provider default'});
  const temp = h('input', {type: 'number', min: 0, max: 2, step: 0.1, 'data-testid': 'setting-temperature', value: meta.temperature != null ? meta.temperature : '', placeholder: 'provider default'});
  const err = h('div', {class: 'error', hidden: true, role: 'alert'});
  const save = async () => {
    const next = Object.assign({}, V.thread.metadata || {});
    if (maxTokens.value === '') delete next.maxTokens; else next.maxTokens = Number(maxTokens.value);
    if (temp.value === '') delete next.temperature; else next.temperature = Number(temp.value);
    try {
      const t = await api('PATCH', '/api/threads/' + V.id, {metadata: next});
      V.thread = Object.assign({}, V.thread, t);
      pop.hidden = true;
      toast('Settings saved for this chat.');
      renderLimit();
    } catch (e) { err.hidden = false; err.textContent = friendly(e); }
  };
  pop.replaceChildren(
    h('div', {class: 'pop-title', text: 'Generation settings (this chat)'}),
    h('label', {class: 'field'}, h('span', {text: 'Max tokens per answer'}), maxTokens),
    h('label', {class: 'field'}, h('span', {text: 'Temperature (0–2)'}), temp),
    h('p', {class: 'muted small', text: model ? 'Model ' + model.id + (model.contextTokens ? ': context ' + fmt(model.contextTokens) + ' tokens, largest message ≈' + fmt(model.maxInputTokens) + ' tokens.' : '.') : ''}),
    err,
    h('div', {class: 'dialog-actions'}, h('button', {class: 'primary', 'data-testid': 'settings-save', text: 'Save', onclick: save})));
  pop.hidden = false;
}

// ---- context popover -------------------------------------------------------------------------------
async function toggleContext() {
  const pop = $('#ctx-pop'), V = S.V;
  if (!pop.hidden || !V) { pop.hidden = true; return; }
  closePops();
  pop.hidden = false;
  pop.replaceChildren(h('div', {class: 'note', text: 'loading…'}));
  try {
    const c = await api('GET', '/api/threads/' + V.id + '/context', undefined, V.ctl.signal);
    if (V.alive && !pop.hidden) drawContext(c);
  } catch (e) { if (!pop.hidden) pop.replaceChildren(h('div', {class: 'note', text: 'context unavailable: ' + (e.code || e.message)})); }
}

function drawContext(c) {
  const row = (label, value, id, cls) => h('tr', {'data-testid': id, class: cls}, h('td', {text: label}), h('td', {class: 'num', text: value}));
  const s = c.snapshot, pct = v => Math.min(100, Math.round(1000 * v / c.limit) / 10);
  const bar = c.limit ? h('div', {class: 'ctxbar', title: 'used / limit; the mark is the compaction threshold'}, h('span'), h('i')) : null;
  if (bar) { bar.firstChild.style.width = pct(c.total) + '%'; bar.lastChild.style.left = pct(c.threshold) + '%'; }
  $('#ctx-pop').replaceChildren(...[
    h('div', {class: 'pop-title', text: 'Context of the next model call'}), bar,
    h('table', null,
      s ? row('summary v' + s.version + ' (#' + s.fromSequence + '–#' + s.toSequence + ')', fmt(s.tokens), 'context-snapshot') : null,
      c.instructions && c.instructions.messages ? row('instructions (' + c.instructions.messages + ')', fmt(c.instructions.tokens)) : null,
      row('messages (' + fmt(c.tail.messages) + (s ? ', from #' + c.tail.fromSequence : '') + ')', fmt(c.tail.tokens)),
      c.tools != null ? row('tool schemas', fmt(c.tools)) : null,
      row('total', fmt(c.total) + (c.limit ? ' / ' + fmt(c.limit) + ' (' + pct(c.total) + '%)' : ''), 'context-total', 'total'),
      row('compaction above', fmt(c.threshold)),
      c.measured != null ? row('last measured by the worker', fmt(c.measured)) : null),
    h('div', {class: 'note', text: 'token counts: tiktoken o200k_base (approximate for non-OpenAI models)'})].filter(Boolean));
}

// ---- run inspector -----------------------------------------------------------------------------------
function toggleInspector() {
  S.inspector = !S.inspector;
  document.body.classList.toggle('inspecting', S.inspector);
  $('#inspector').hidden = !S.inspector;
  if (S.inspector && S.V) { S.V.inspect = null; pollRun(S.V); }
  renderInspector();
}

function renderInspector() {
  const box = $('#inspector');
  if (!S.inspector || !box) return;
  const V = S.V, d = V && V.inspect;
  const head = h('div', {class: 'insp-head'}, h('b', {text: 'Run inspector'}),
    h('button', {class: 'icon-btn', 'data-testid': 'inspector-close', title: 'Close', onclick: toggleInspector}, icon('close')));
  if (!d) { box.replaceChildren(head, h('p', {class: 'muted', text: V ? 'No run in this chat yet.' : 'Open a chat.'})); return; }
  const started = Date.parse(d.startedAt || d.createdAt), end = d.finishedAt ? Date.parse(d.finishedAt) : Date.now();
  const kv = (k, v, id) => h('div', {class: 'kv', 'data-testid': id}, h('span', {text: k}), h('b', {text: v}));
  const steps = (d.steps || []).map(s => h('tr', {'data-testid': 'inspector-step', 'data-status': s.status},
    h('td', {text: '#' + s.sequence + (s.attempt > 1 ? ' (attempt ' + s.attempt + ')' : '')}),
    h('td', {text: s.model}),
    h('td', {class: 'num', text: fmt(s.promptTokens) + ' / ' + fmt(s.completionTokens)}),
    h('td', {class: 'num', text: duration((s.finishedAt ? Date.parse(s.finishedAt) : Date.now()) - Date.parse(s.startedAt))}),
    h('td', {text: s.status + (s.toolCalls ? ' · ' + s.toolCalls + ' tools' : '') + (s.errorCode ? ' · ' + s.errorCode : '')})));
  const calls = (d.toolCalls || []).map(c => h('details', {class: 'insp-call', 'data-testid': 'inspector-tool-call', 'data-status': c.finishedAt ? 'done' : 'pending'},
    h('summary', null, h('b', {text: c.name}), h('span', {class: 'muted', text: ' ' + (c.finishedAt ? duration(c.durationMs) : 'running…')}),
      c.ledger ? h('span', {class: 'chip small', title: 'ledger of external effects', text: c.ledger}) : null,
      c.approval ? h('span', {class: 'chip small', title: 'approval', text: c.approval}) : null),
    h('pre', {text: prettyArgs(c.arguments)}),
    c.result != null ? h('pre', {class: 'muted', text: c.result}) : null));
  const compactions = (d.compactions || []).map(c => h('li', {text: 'v' + c.version + ': messages #' + c.fromSequence + '–#' + c.toSequence + ' → ' + fmt(c.tokens) + ' tokens'}));
  box.replaceChildren(...[head,
    h('div', {class: 'insp-sec'},
      kv('Status', d.status + (d.error ? ' — ' + d.error.code : ''), 'inspector-status'),
      kv('Model', d.model),
      kv('Steps', (d.stepsUsed || 0) + ' of ' + d.maxSteps),
      kv('Tokens in / out', fmt(d.promptTokens) + ' / ' + fmt(d.completionTokens)),
      kv('Time', duration(end - started)),
      kv('Tool calls', fmt(d.toolCallsTotal != null ? d.toolCallsTotal : d.toolCallsUsed)),
      kv('Attempts / recoveries', d.attempts + ' / ' + d.recoveries, 'inspector-recoveries'),
      d.liveness && d.liveness.state !== 'ok' ? kv('Liveness', d.liveness.state.replace('_', ' '), 'inspector-liveness') : null),
    h('div', {class: 'insp-title', text: 'Steps'}),
    steps.length ? h('table', {class: 'insp-steps'}, h('tr', null, h('th', {text: 'step'}), h('th', {text: 'model'}), h('th', {text: 'in / out'}), h('th', {text: 'time'}), h('th', {text: 'outcome'})), ...steps)
      : h('p', {class: 'muted', text: 'No step yet.'}),
    h('div', {class: 'insp-title', text: 'Tool calls' + (d.toolCallsTotal > calls.length ? ' (last ' + calls.length + ' of ' + d.toolCallsTotal + ')' : '')}),
    calls.length ? h('div', null, ...calls) : h('p', {class: 'muted', text: 'None.'}),
    compactions.length ? h('div', {class: 'insp-title', text: 'Compactions'}) : null,
    compactions.length ? h('ul', {class: 'insp-list'}, ...compactions) : null].filter(Boolean));
}

// ---- approvals and blocked runs ------------------------------------------------------------------
const gateKey = r => r && (r.status === 'waiting_approval' || r.status === 'waiting_authorization' || r.status === 'blocked') ? r.id + ':' + r.status + ':' + (r.updatedAt || '') : '';

function renderGate() {
  const V = S.V, r = V && shownRun(V), key = gateKey(r);
  if (!key) { $('#gate').hidden = true; $('#gate').replaceChildren(); if (V) { V.gate = null; V.gateKey = ''; } return; }
  if (V.gateKey !== key) { V.gateKey = key; loadGate(V, r); }
}

async function loadGate(V, r) {
  const key = V.gateKey;
  try {
    let gate;
    if (r.status === 'waiting_approval') {
      const d = await api('GET', '/api/threads/' + V.id + '/approvals?status=pending', undefined, V.ctl.signal);
      gate = {kind: 'approvals', run: r, list: (d.approvals || []).filter(a => a.runId === r.id).reverse()};
    } else if (r.status === 'waiting_authorization') {
      // MCP sign-in: the run's pending authorization carries the sign-in URL.
      const d = await api('GET', '/api/runs/' + r.id, undefined, V.ctl.signal);
      gate = {kind: 'authorization', run: d, list: d.authorization && d.authorization.url ? [d.authorization] : []};
    } else {
      const d = await api('GET', '/api/runs/' + r.id + '/operations', undefined, V.ctl.signal);
      gate = {kind: 'operations', run: d.run || r, list: (d.operations || []).filter(o => o.status === 'uncertain')};
    }
    if (!V.alive || V.gateKey !== key) return;
    V.gate = gate;
    drawGate(V);
  } catch (e) { if (V.alive) showError(e); }
}

function drawGate(V) {
  const box = $('#gate'), g = V.gate;
  if (!g || !g.list.length) { box.hidden = true; box.replaceChildren(); return; }
  box.hidden = false;
  V.drafts = V.drafts || {};
  if (g.kind === 'authorization') {
    const a = g.list[0];
    box.replaceChildren(h('div', {class: 'gate-title', text: 'The tool server “' + a.server + '” needs you to sign in before the agent can go on.'}),
      h('a', {class: 'btn', 'data-testid': 'signin-link', href: a.url, target: '_blank', rel: 'noopener noreferrer', text: 'Sign in to ' + a.server}));
  } else if (g.kind === 'approvals') {
    box.replaceChildren(h('div', {class: 'gate-title', text: 'The agent wants to run ' + (g.list.length === 1 ? 'a tool' : g.list.length + ' tools') + ' — approve?'}), ...g.list.map(a => approvalCard(V, a)));
  } else {
    box.replaceChildren(h('div', {class: 'gate-title', 'data-testid': 'blocker',
      text: 'Run blocked: ' + (g.run.error ? g.run.error.message : 'an external effect has an unknown outcome')}), ...g.list.map(o => operationCard(V, g.run, o)));
  }
}

function gateDone(V, run) {
  showError(null);
  if (run && V.alive) keepRun(V, run);
  renderAll();
}

function approvalCard(V, a) {
  const original = JSON.stringify(a.arguments, null, 2);
  // Arguments the page cannot show whole (a run of extending characters, see `tame`: 70,000
  // accents froze the tab 12 s on every open of the thread, verifier P, P-6) are shown tamed and
  // cannot be edited here: approving sends no edit, so the call runs with what the model wrote.
  const editable = tame(original) === original;
  const ta = h('textarea', {class: 'args', 'data-testid': 'approval-arguments', spellcheck: 'false', readonly: !editable,
    rows: Math.min(10, original.split('\n').length + 1)});
  ta.value = !editable ? tame(original) : V.drafts[a.id] != null ? V.drafts[a.id] : original;
  ta.addEventListener('input', () => { V.drafts[a.id] = ta.value; });
  const reason = h('input', {'data-testid': 'reject-reason', placeholder: 'Reason for rejecting (optional)'});
  const decide = async (verb, body) => {
    for (const b of card.querySelectorAll('button')) b.disabled = true;
    try {
      const r = await api('POST', '/api/approvals/' + a.id + '/' + verb, body);
      delete V.drafts[a.id];
      if (V.gate) V.gate.list = V.gate.list.filter(x => x.id !== a.id);
      drawGate(V);
      gateDone(V, r && r.run);
    } catch (e) {
      showError(e);
      for (const b of card.querySelectorAll('button')) b.disabled = false;
      if (e.status === 409) { V.gateKey = ''; renderGate(); }
    }
  };
  const approve = () => {
    const body = {};
    if (editable && ta.value.trim() !== original.trim()) {
      try { body.arguments = JSON.parse(ta.value); } catch (e) {
        showError({code: 'invalid_arguments', message: 'The arguments are not valid JSON: ' + e.message});
        return;
      }
    }
    decide('approve', body);
  };
  const card = h('div', {class: 'approval', 'data-testid': 'approval', 'data-approval-id': a.id, 'data-tool-name': a.toolName},
    h('div', null, icon('tool'), h('b', {text: ' ' + a.toolName}),
      h('span', {class: 'note', text: ' · undecided calls are rejected at ' + new Date(a.deadlineAt).toLocaleString()})),
    h('div', {class: 'lbl', text: editable ? 'Arguments (JSON, you can edit them)' : 'Arguments (JSON; too long a run of combining characters to show whole or edit here)'}), ta,
    h('div', {class: 'gate-actions'},
      h('button', {class: 'primary', 'data-testid': 'approve', text: 'Approve', onclick: approve}),
      h('button', {'data-testid': 'reject', text: 'Reject', onclick: () => decide('reject', reason.value.trim() ? {reason: reason.value.trim()} : {})}),
      reason));
  return card;
}

function operationCard(V, run, o) {
  const result = h('input', {'data-testid': 'resolve-result', placeholder: 'What happened (optional, for "It happened")'});
  const resolve = async outcome => {
    const body = {outcome};
    if (outcome === 'completed' && result.value.trim()) body.result = result.value.trim();
    if (run.updatedAt) body.runUpdatedAt = run.updatedAt;
    for (const b of card.querySelectorAll('button')) b.disabled = true;
    try {
      const r = await api('POST', '/api/runs/' + run.id + '/operations/' + encodeURIComponent(o.key) + '/resolve', body);
      if (V.gate) V.gate.list = V.gate.list.filter(x => x.key !== o.key);
      drawGate(V);
      gateDone(V, r && r.run);
    } catch (e) {
      showError(e);
      for (const b of card.querySelectorAll('button')) b.disabled = false;
      if (e.status === 409) { V.gateKey = ''; renderGate(); }
    }
  };
  const card = h('div', {class: 'operation', 'data-testid': 'operation', 'data-key': o.key, 'data-tool-name': o.toolName},
    h('div', null, h('span', {class: 'chip small', text: 'uncertain'}), h('b', {text: ' ' + o.toolName}), h('code', {class: 'note', text: ' ' + o.key})),
    h('div', {class: 'note', text: 'This call may have reached the tool but no answer says what it did (it timed out, its connection broke, the tool answered an error after receiving it, or the worker stopped): nobody knows whether it took effect, so nothing is retried automatically.'}),
    h('pre', {text: prettyArgs(o.arguments)}),
    o.result ? h('div', {class: 'lbl', text: 'What the worker saw'}) : null,
    o.result ? h('pre', {'data-testid': 'operation-result', text: o.result}) : null,
    h('div', {class: 'gate-actions'},
      h('button', {class: 'primary', 'data-testid': 'resolve-completed', text: 'It happened', onclick: () => resolve('completed')}),
      h('button', {'data-testid': 'resolve-failed', text: 'It did not happen', onclick: () => resolve('failed')}),
      h('button', {'data-testid': 'resolve-retry', text: 'Safe to retry', onclick: () => resolve('retry')}),
      result));
  return card;
}

// ---- scrolling ---------------------------------------------------------------------------------------
function nearBottom() { const l = $('#log'); return l.scrollHeight - l.scrollTop - l.clientHeight < 120; }
function scrollDown(force) { const l = $('#log'); if (force) l.scrollTop = l.scrollHeight; }
function scrollKeeper() { const l = $('#log'), h0 = l.scrollHeight, top = l.scrollTop; return () => { l.scrollTop = top + (l.scrollHeight - h0); }; }

// ---- live updates ------------------------------------------------------------------------------------
function onEvent(V, kind, p, seq) {
  if (!V.alive || p == null) return;
  const stick = nearBottom();
  if (seq != null) V.cursor = Math.max(V.cursor, seq);
  const fresh = seq == null || seq > V.snapSeq;
  switch (kind) {
    case 'message':
      addMessage(V, p);
      if (fresh && p.role === 'assistant') V.stream = null;
      if (fresh && p.role === 'user') refreshThreadsSoon();
      break;
    case 'run':
      if (fresh || !V.runs.has(p.id) || Date.parse(p.updatedAt) > Date.parse(V.runs.get(p.id).updatedAt)) V.runs.set(p.id, p);
      if (fresh && !isActive(p)) {
        if (V.stream && V.stream.runId === p.id) V.stream = null;
        refreshThreadsSoon();
        pollRun(V);
        if (V.branchPending) { V.branchPending = false; refreshMarks(V); }
      }
      if (fresh && isActive(p)) V.liveness = null;
      break;
    case 'streaming':
      if (fresh) applyDelta(V, p);
      break;
    case 'thread':
      if (p.thread && 'sig' in p) {
        V.thread = p.thread;
        V.snapSeq = p.thread.lastEventSequence || 0;
        if (p.run) V.runs.set(p.run.id, p.run);
        setStream(V, p.streamingMessage);
      } else if (fresh) {
        V.thread = Object.assign({}, V.thread, p);
        const entry = S.threads.find(x => x.id === V.id);
        if (entry && p.title != null) entry.title = p.title;
      }
      break;
    case 'approval':
      if (fresh) V.gateKey = '';
      break;
    case 'messages_deactivated':
      dropMessages(V, p.sequences);
      break;
    case 'branch_switched':
      if (fresh) { reload(V); return; }
      break;
    case 'compaction':
      V.compaction = p;
      break;
    case 'thread_deleted':
      V.deleted = true;
      refreshThreadsSoon();
      break;
    case 'reset':
      reload(V, p.sequence);
      return;
  }
  if (kind === 'streaming') renderStream(); else renderAll();
  if (stick) scrollDown(true);
}

function applyDelta(V, p) {
  // A delta larger than a live event's share comes cut (`truncated`): the thread's read has the
  // partial answer whole.
  if (p.truncated) { resync(V); return; }
  let s = V.stream;
  if (p.offset === 0) s = V.stream = {runId: p.runId, content: '', reasoning: ''};
  else if (!s || s.runId !== p.runId || p.offset > s.content.length) { resync(V); return; }
  s.content = s.content.slice(0, p.offset) + (p.delta || '');
  if (p.reasoningDelta != null && p.reasoningOffset != null) s.reasoning = s.reasoning.slice(0, p.reasoningOffset) + p.reasoningDelta;
}

function resync(V) {
  if (V.resyncing) return;
  V.resyncing = true;
  api('GET', '/api/threads/' + V.id, undefined, V.ctl.signal)
    .then(d => { if (V.alive) applyWindow(V, d, false); })
    .catch(() => {})
    .finally(() => { V.resyncing = false; });
}

async function reload(V, sequence) {
  try {
    const d = await api('GET', '/api/threads/' + V.id, undefined, V.ctl.signal);
    if (!V.alive) return;
    const stick = nearBottom();
    applyWindow(V, d, true);
    V.cursor = sequence != null ? sequence : Math.max(V.cursor, d.thread.lastEventSequence);
    if (stick) scrollDown(true);
  } catch (e) { if (V.alive) showError(e); }
}

/** The live-updates chip: `● live` only while updates flow; `○ reconnecting…` otherwise (it
 *  said live through reconnects and a 40 s frozen connection: acceptance probe K, K-6). */
function setTransport(text, mode, healthy = true) {
  const el = $('#transport');
  el.textContent = text ? (mode ? (healthy ? '● live' : '○ reconnecting…') : text) : '';
  el.title = text ? 'Live updates: ' + text : '';
  el.dataset.transport = mode || '';
  el.dataset.healthy = healthy ? 'true' : 'false';
}

function connect(V) {
  if (auth.mode === 'bearer' || S.pollOnly.has(V.id) || typeof EventSource === 'undefined') poll(V);
  else sse(V);
}

function sse(V) {
  const es = V.es = new EventSource('/api/threads/' + V.id + '/updates/stream?afterSequence=' + V.cursor, {withCredentials: true});
  let connected = false, errors = 0, last = Date.now();
  const fallback = why => {
    if (!V.alive || V.es !== es) return;
    es.close();
    V.es = null;
    S.pollOnly.add(V.id);
    console.info('agentloop: SSE → long-poll:', why);
    poll(V);
  };
  V.timers.push(setTimeout(() => { if (!connected) fallback('no connected event within 5 s'); }, 5000));
  V.timers.push(setInterval(() => {
    const silent = Date.now() - last;
    if (silent > 3 * HEARTBEAT_MS) fallback('silent for 45 s');
    else if (connected && silent > 2 * HEARTBEAT_MS) setTransport('SSE (no heartbeat for 30 s)', 'sse', false);
  }, 5000));
  es.addEventListener('connected', () => { connected = true; errors = 0; last = Date.now(); setTransport('SSE', 'sse'); });
  es.addEventListener('heartbeat', () => { last = Date.now(); setTransport('SSE', 'sse'); });
  for (const kind of ['thread', 'message', 'run', 'streaming', 'messages_deactivated', 'branch_switched', 'compaction', 'approval', 'thread_deleted', 'reset']) {
    es.addEventListener(kind, e => {
      last = Date.now();
      let p;
      try { p = JSON.parse(e.data); } catch (_) { return; }
      const snapshot = kind === 'thread' && p && p.thread && 'sig' in p;
      onEvent(V, kind, p, snapshot || kind === 'reset' || e.lastEventId === '' ? null : Number(e.lastEventId));
    });
  }
  es.onerror = () => {
    if (!V.alive) return;
    errors += 1;
    if (es.readyState === EventSource.CLOSED || errors >= 3) fallback(errors >= 3 ? '3 consecutive errors' : 'stream closed');
    else setTransport('SSE (reconnecting…)', 'sse', false);
  };
}

async function poll(V) {
  setTransport('long-poll', 'long-poll');
  let fails = 0;
  while (V.alive) {
    try {
      const r = await api('GET', '/api/threads/' + V.id + '/updates?afterSequence=' + V.cursor + '&timeoutMs=25000', undefined, V.ctl.signal);
      if (!V.alive) return;
      if (fails) setTransport('long-poll', 'long-poll');
      fails = 0;
      if (r.reset) { await reload(V, r.nextSequence); continue; }
      for (const ev of r.events || []) onEvent(V, ev.kind, ev.payload, ev.sequence);
      if (r.nextSequence != null) V.cursor = Math.max(V.cursor, r.nextSequence);
    } catch (e) {
      if (!V.alive || e.status === 401) return;
      fails += 1;
      setTransport('long-poll (retrying: ' + (e.code || e.message) + ')', 'long-poll', false);
      await sleep(Math.min(1000 * 2 ** fails, 15000));
    }
  }
}

// ---- database health -----------------------------------------------------------------------------
function setDbDown(down) {
  if (S.dbDown === down) return;
  S.dbDown = down;
  $('#db-banner').hidden = !down;
  if (!down && S.V) resync(S.V);
}
dbListeners.add(setDbDown);

async function checkReady() {
  try {
    const r = await fetch('/readyz', {cache: 'no-store'});
    // 503 also means `draining` (this api process is shutting down; another one, or its
    // restart, serves next): only `database_unavailable` / `database_read_only` say
    // PostgreSQL cannot take this session's work.
    const code = r.status === 503 ? ((await r.json().catch(() => null))?.error?.code) : null;
    if (r.ok) setDbDown(false);
    else if (code === 'database_unavailable' || code === 'database_read_only') setDbDown(true);
  } catch (_) { /* the server itself is away: requests report it */ }
}

// ---- start --------------------------------------------------------------------------------------------
async function start() {
  $('#signin').hidden = true;
  $('#shell').hidden = false;
  $('#who').textContent = auth.principal ? auth.principal.name + (auth.mode === 'loopback' ? ' (local)' : '') : '';
  await loadModels();
  await loadThreads(false);
  const id = location.hash.slice(1);
  if (id) openThread(id); else renderEmpty();
  S.timers.push(setInterval(() => { if (!document.hidden) loadThreads(false); }, 10000));
  S.timers.push(setInterval(() => { if (!document.hidden) checkReady(); }, READY_POLL_MS));
  focusComposer();
}

skeleton();
(async function init() {
  let ok = false;
  try { ok = await resume(); } catch (_) { ok = false; }
  if (ok) start(); else showSignIn();
})();
