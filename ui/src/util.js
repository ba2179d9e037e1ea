// Small DOM and formatting helpers. `h` never parses HTML: strings become text nodes.

export const $ = (s, root = document) => root.querySelector(s);
export const $$ = (s, root = document) => [...root.querySelectorAll(s)];
export const sleep = ms => new Promise(r => setTimeout(r, ms));

/** Builds an element. `props`: class, text, on<event> (listeners, never inline attributes), other attributes. */
/** Most extending characters shown on one character; the rest are not shown. */
export const MAX_MARKS = 8;
// Whatever extends a grapheme cluster: combining marks, the other Grapheme_Extend characters and
// emoji skin-tone modifiers (Sk, yet they extend the emoji before them).
const EXTEND = '[\\p{M}\\p{Grapheme_Extend}\\p{Emoji_Modifier}]';
const MARK_RUN = new RegExp('(' + EXTEND + '{' + MAX_MARKS + '})' + EXTEND + '+', 'gu');

/**
 * `s` as shown on the page: at most MAX_MARKS characters extending one character. Chromium lays
 * out one grapheme cluster in time quadratic in its length: an answer of one letter and 70,000
 * accents froze the tab for 12 s, 300,000 for 100 s (acceptance probe N, N-7); one `a` and
 * 10,000 skin-tone modifiers 32 s, 30,000 over 6 minutes (verifier P, P-5). Real scripts stack a
 * few. Stored text is unchanged (copy, edit and export use it).
 */
export function tame(s) {
  return typeof s === 'string' && s.length > MAX_MARKS ? s.replace(MARK_RUN, '$1') : s;
}

export function h(tag, props, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v == null || v === false) continue;
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = tame(v);
    else if (k === 'value') e.value = v;
    else if (k.startsWith('on') && typeof v === 'function') e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of kids.flat()) if (c != null && c !== false) e.append(c);
  return e;
}

/** An inline SVG icon from a path list (24x24 viewBox, stroke style). */
export function icon(name) {
  const paths = ICONS[name] || ICONS.dot;
  const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  svg.setAttribute('viewBox', '0 0 24 24');
  svg.setAttribute('class', 'icon');
  svg.setAttribute('aria-hidden', 'true');
  for (const d of paths) {
    const p = document.createElementNS('http://www.w3.org/2000/svg', 'path');
    p.setAttribute('d', d);
    svg.append(p);
  }
  return svg;
}

const ICONS = {
  menu: ['M4 6h16', 'M4 12h16', 'M4 18h16'],
  plus: ['M12 5v14', 'M5 12h14'],
  send: ['M12 19V5', 'M5 12l7-7 7 7'],
  stop: ['M7 7h10v10H7z'],
  copy: ['M9 9h10v10H9z', 'M5 15V5h10'],
  check: ['M5 12l5 5L20 7'],
  edit: ['M4 20h4L19 9l-4-4L4 16z'],
  redo: ['M20 12a8 8 0 1 1-2.3-5.7', 'M20 4v5h-5'],
  trash: ['M5 7h14', 'M10 7V4h4v3', 'M7 7l1 13h8l1-13'],
  search: ['M11 18a7 7 0 1 1 0-14 7 7 0 0 1 0 14z', 'M20 20l-4-4'],
  gear: ['M12 15a3 3 0 1 0 0-6 3 3 0 0 0 0 6z', 'M12 2v3', 'M12 19v3', 'M2 12h3', 'M19 12h3', 'M5 5l2 2', 'M17 17l2 2', 'M5 19l2-2', 'M17 7l2-2'],
  panel: ['M4 5h16v14H4z', 'M14 5v14'],
  download: ['M12 4v11', 'M7 10l5 5 5-5', 'M5 20h14'],
  sun: ['M12 17a5 5 0 1 0 0-10 5 5 0 0 0 0 10z', 'M12 1v2', 'M12 21v2', 'M1 12h2', 'M21 12h2'],
  moon: ['M20 14A8 8 0 1 1 10 4a6 6 0 0 0 10 10z'],
  out: ['M15 4h4v16h-4', 'M10 8l-4 4 4 4', 'M6 12h10'],
  left: ['M15 5l-7 7 7 7'],
  right: ['M9 5l7 7-7 7'],
  close: ['M6 6l12 12', 'M18 6L6 18'],
  tool: ['M14 6a4 4 0 0 0 5 5l-8 8a2 2 0 0 1-3-3l8-8a4 4 0 0 0-2-2z'],
  dots: ['M5 12h.01', 'M12 12h.01', 'M19 12h.01'],
  compress: ['M4 9h5V4', 'M20 15h-5v5', 'M9 9L4 4', 'M15 15l5 5'],
  dot: ['M12 12h.01'],
};

export const fmt = n => n == null ? '?' : Number(n).toLocaleString('en-US');

/** "14:05", or "Mar 3, 14:05" for another day. */
export function shortTime(iso) {
  if (!iso) return '';
  const d = new Date(iso), now = new Date();
  const time = d.toLocaleTimeString([], {hour: '2-digit', minute: '2-digit'});
  if (d.toDateString() === now.toDateString()) return time;
  return d.toLocaleDateString([], {month: 'short', day: 'numeric'}) + ', ' + time;
}

export const fullTime = iso => iso ? new Date(iso).toLocaleString() : '';

/** A duration in ms as "850 ms", "12.3 s", "4 min 5 s". */
export function duration(ms) {
  if (ms == null || Number.isNaN(ms)) return '–';
  if (ms < 1000) return Math.round(ms) + ' ms';
  if (ms < 60000) return (ms / 1000).toFixed(ms < 10000 ? 1 : 0) + ' s';
  const m = Math.floor(ms / 60000);
  return m + ' min ' + Math.round((ms % 60000) / 1000) + ' s';
}

/** Which list group a thread falls in, by its last update. */
export function dayGroup(iso) {
  const d = new Date(iso), now = new Date();
  const start = x => new Date(x.getFullYear(), x.getMonth(), x.getDate()).getTime();
  const days = Math.round((start(now) - start(d)) / 86400000);
  if (days <= 0) return 'Today';
  if (days === 1) return 'Yesterday';
  if (days < 7) return 'Previous 7 days';
  if (days < 30) return 'Previous 30 days';
  return 'Older';
}

export function textOf(c) {
  if (typeof c === 'string') return c;
  if (Array.isArray(c)) return c.map(p => p && p.type === 'text' ? p.text : '[' + (p && p.type) + ']').join('\n');
  return c == null ? '' : JSON.stringify(c);
}

export function prettyArgs(a) {
  if (typeof a !== 'string') return JSON.stringify(a, null, 2);
  try { return JSON.stringify(JSON.parse(a), null, 2); } catch (_) { return a; }
}

export const oneLine = (s, n = 80) => {
  s = String(s == null ? '' : typeof s === 'string' ? s : JSON.stringify(s)).replace(/\s+/g, ' ');
  return s.length > n ? s.slice(0, n) + '…' : s;
};

/** Rough token count of text typed in the browser (the server counts exactly): ~4 chars a token. */
export const roughTokens = text => Math.ceil(new Blob([text]).size / 4) + 4;

export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch (_) {
    const ta = h('textarea', {class: 'offscreen'});
    ta.value = text;
    document.body.append(ta);
    ta.select();
    let ok = false;
    try { ok = document.execCommand('copy'); } catch (_) { ok = false; }
    ta.remove();
    return ok;
  }
}
