// Markdown rendering through kept libraries: marked (CommonMark + GFM tables), highlight.js
// (code), DOMPurify (the only way rendered HTML reaches the page).

import { Marked } from 'marked';
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

/** Highlighted HTML of `code` (escaped, hljs spans only). */
export function highlight(code, lang) {
  try {
    if (lang && hljs.getLanguage(lang)) return hljs.highlight(code, {language: lang, ignoreIllegals: true}).value;
    if (code.length < 20000) return hljs.highlightAuto(code).value;
  } catch (_) { /* plain below */ }
  return escape(code);
}

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    code({text, lang}) {
      const language = (lang || '').trim().split(/\s+/)[0].toLowerCase();
      return '<div class="codeblock"><div class="codehead"><span class="lang">' + escape(language || 'text') +
        '</span><button type="button" class="copy-code" data-testid="copy-code">Copy</button></div>' +
        '<pre><code class="hljs' + (language ? ' language-' + escape(language) : '') + '">' + highlight(text, language) + '</code></pre></div>';
    },
  },
});

DOMPurify.addHook('afterSanitizeAttributes', node => {
  if (node.tagName === 'A') {
    node.setAttribute('target', '_blank');
    node.setAttribute('rel', 'noopener noreferrer');
  }
});

const PURIFY = {USE_PROFILES: {html: true}, FORBID_TAGS: ['style', 'form', 'input', 'textarea', 'select'], FORBID_ATTR: ['style']};

/** Sanitised HTML of Markdown `text`. */
export function renderMarkdown(text) {
  let html;
  try { html = marked.parse(text || ''); } catch (_) { html = '<p>' + escape(text || '') + '</p>'; }
  return DOMPurify.sanitize(html, PURIFY);
}

/** Puts rendered Markdown into `el`, re-rendering only when the text changed. */
const rendered = new WeakMap();
export function setMarkdown(el, text) {
  if (rendered.get(el) === text) return;
  rendered.set(el, text);
  el.innerHTML = renderMarkdown(text);
}
