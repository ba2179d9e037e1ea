// Markdown rendering through kept libraries: markdown-it (CommonMark + GFM tables and
// strikethrough), highlight.js (code), DOMPurify (the only way rendered HTML reaches the page).
//
// markdown-it, not marked: marked's emphasis parsing is quadratic — an answer of 100,000 `_a`
// (200,000 characters on one line) took 72 s to parse and froze the tab (acceptance probe K,
// K-12); markdown-it parses every such input class we tried in time linear in its length
// (≤ 1.4 s at 400,000 characters, the worst being `![a` repeated). Texts longer than
// MARKDOWN_MAX_CHARS are shown as plain text all the same.

import MarkdownIt from 'markdown-it';
import { tame } from './util.js';
import DOMPurify from 'dompurify';
import hljs from 'highlight.js/lib/core';
import bash from 'highlight.js/lib/languages/bash';
import c from 'highlight.js/lib/languages/c';
import cpp from 'highlight.js/lib/languages/cpp';
import css from 'highlight.js/lib/languages/css';
import diff from 'highlight.js/lib/languages/diff';
import go from 'highlight.js/lib/languages/go';
import java from 'highlight.js/lib/languages/java';
import javascript from 'highlight.js/lib/languages/javascript';
import json from 'highlight.js/lib/languages/json';
import markdown from 'highlight.js/lib/languages/markdown';
import python from 'highlight.js/lib/languages/python';
import rust from 'highlight.js/lib/languages/rust';
import shell from 'highlight.js/lib/languages/shell';
import sql from 'highlight.js/lib/languages/sql';
import typescript from 'highlight.js/lib/languages/typescript';
import xml from 'highlight.js/lib/languages/xml';
import yaml from 'highlight.js/lib/languages/yaml';

const LANGS = {bash, c, cpp, css, diff, go, java, javascript, json, markdown, python, rust, shell, sql, typescript, xml, yaml};
for (const [name, lang] of Object.entries(LANGS)) hljs.registerLanguage(name, lang);

const escape = s => s.replace(/[&<>"']/g, ch => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[ch]));

/**
 * Longest code highlighted with its named language, and without one (detection tries every
 * grammar), in characters; longer code is shown plain. highlight.js takes time quadratic in a
 * long run without a token break in several grammars: 25,000 `$` as Java 7.3 s, 60,000 froze
 * the tab for 57 s; detection of 19,999 `a` 7.5 s (acceptance probe N, N-6). At these bounds the
 * worst of 24 repeated patterns in each of the 17 grammars took ~0.35 s (node, this machine).
 */
export const HIGHLIGHT_MAX_CHARS = 4000;
export const DETECT_MAX_CHARS = 1500;

/**
 * Most time spent highlighting in one task (ms): later code of the same task is shown plain. The
 * bounds above are per block, and a message may hold 25 blocks under them: 24 blocks of 3,990 `$`
 * as Java blocked the tab 7 s (verifier P, P-7). A task thus highlights for at most this plus one
 * block (~0.35 s at worst).
 */
export const HIGHLIGHT_BUDGET_MS = 100;
let spent = 0;
let resetting = false;

/** Highlighted HTML of `code` (tamed, escaped, hljs spans only); plain past the bounds above. */
export function highlight(code, lang) {
  code = tame(code);
  if (!resetting) {
    resetting = true;
    setTimeout(() => { spent = 0; resetting = false; }, 0);
  }
  if (spent >= HIGHLIGHT_BUDGET_MS) return escape(code);
  const started = performance.now();
  try {
    if (lang && hljs.getLanguage(lang)) {
      if (code.length <= HIGHLIGHT_MAX_CHARS) return hljs.highlight(code, {language: lang, ignoreIllegals: true}).value;
    } else if (code.length <= DETECT_MAX_CHARS) return hljs.highlightAuto(code).value;
  } catch (_) { /* plain below */ } finally {
    spent += performance.now() - started;
  }
  return escape(code);
}

/** Longest text rendered as Markdown (characters); a longer one is shown as plain text. */
export const MARKDOWN_MAX_CHARS = 100000;

const md = new MarkdownIt({html: true, linkify: false, breaks: false});
// The same without raw HTML (shown as text), for texts with more tags than HTML_MAX_TAGS.
const mdText = new MarkdownIt({html: false, linkify: false, breaks: false});

/**
 * Most raw HTML tags a text may hold and have them rendered; past it the text's HTML is shown as
 * text. Markdown's own nesting is bounded (markdown-it's maxNesting), raw HTML's is not, and
 * Chromium lays out deep nesting in time that grows faster than the nodes: 10,000 nested `<q>`
 * (30 KB) froze the tab 35.6 s, 16,000-33,000 `<u>` or `<ul>` 4.7-6.4 s (verifier P, P-11).
 */
export const HTML_MAX_TAGS = 300;
const TAG = /<\/?[A-Za-z]/g;
const tooManyTags = text => {
  let n = 0;
  TAG.lastIndex = 0;
  while (TAG.exec(text)) if (++n > HTML_MAX_TAGS) return true;
  return false;
};

md.renderer.rules.fence = mdText.renderer.rules.fence = (tokens, idx) => {
  const {content, info} = tokens[idx];
  const language = (info || '').trim().split(/\s+/)[0].toLowerCase();
  return '<div class="codeblock"><div class="codehead"><span class="lang">' + escape(language || 'text') +
    '</span><button type="button" class="copy-code" data-testid="copy-code">Copy</button></div>' +
    '<pre><code class="hljs' + (language ? ' language-' + escape(language) : '') + '">' + highlight(content, language) + '</code></pre></div>\n';
};

DOMPurify.addHook('afterSanitizeAttributes', node => {
  // The code block's copy button (its test id; content's own `data-*` are dropped).
  if (node.tagName === 'BUTTON' && node.classList.contains('copy-code')) node.setAttribute('data-testid', 'copy-code');
  if (node.tagName === 'A') {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer');
  }
});

// Classes our own renderer and highlight.js put in rendered Markdown; any other class in the
// content is dropped, so content cannot take the page's own look (acceptance probe K, K-2: an
// answer with `class="modal"` covered the page with a fake sign-in dialog).
const OWN_CLASS = /^(plain|codeblock|codehead|lang|copy-code|hljs|hljs-[\w-]+|language-[\w+#.-]+)$/;
DOMPurify.addHook('uponSanitizeAttribute', (node, data) => {
  if (data.attrName === 'class') {
    data.attrValue = data.attrValue.split(/\s+/).filter(c => OWN_CLASS.test(c)).join(' ');
    if (!data.attrValue) data.keepAttr = false;
  }
});

// Content never names the page's elements: `id` and `name` get a `user-content-` prefix
// (SANITIZE_NAMED_PROPS), so `#composer` is always the page's composer (acceptance probe K,
// K-1: an answer with `<button id="composer" value=...>` was found first by the page and its
// value posted as the user's next turn); no `data-*` attributes (the page's own selectors);
// nothing that opens a layer over the page (`dialog`, `popover`) or takes focus.
const PURIFY = {
  USE_PROFILES: {html: true},
  SANITIZE_NAMED_PROPS: true,
  ALLOW_DATA_ATTR: false,
  // No `role` / `aria-*` either: content announced as a modal dialog over the page (L-8).
  ALLOW_ARIA_ATTR: false,
  FORBID_TAGS: ['style', 'form', 'input', 'textarea', 'select', 'option', 'dialog', 'template', 'slot'],
  FORBID_ATTR: ['style', 'role', 'popover', 'popovertarget', 'popovertargetaction', 'command', 'commandfor', 'autofocus',
                'tabindex', 'accesskey', 'form', 'formaction', 'inert'],
};

const plain = text => '<p class="plain">' + escape(text) + '</p>';

/** Sanitised HTML of Markdown `text` (plain text past MARKDOWN_MAX_CHARS or if parsing fails). */
export function renderMarkdown(text) {
  text = tame(text || '');
  let html;
  if (text.length > MARKDOWN_MAX_CHARS) html = plain(text);
  else try { html = (tooManyTags(text) ? mdText : md).render(text); } catch (_) { html = plain(text); }
  return DOMPurify.sanitize(html, PURIFY);
}

/** Puts rendered Markdown into `el`, re-rendering only when the text changed. */
const rendered = new WeakMap();
export function setMarkdown(el, text) {
  if (rendered.get(el) === text) return;
  rendered.set(el, text);
  el.innerHTML = renderMarkdown(text);
}
