// HTTP to the agentloop api, and sign-in.
//
// Sign-in (CONTRACTS.md "Browser sign-in session"): the key is sent once to POST /api/session,
// which answers with an HttpOnly cookie; the page never stores the key. Every non-GET request
// carries `X-Requested-With: agentloop` (the CSRF guard of cookie sessions). Until a server has
// the session routes (404/405), the page falls back to a bearer key kept in sessionStorage (this
// tab only, never localStorage) and to long-poll (EventSource cannot send a header).

const KEY_SLOT = 'agentloop.bearer';

export const auth = {
  /** 'session' | 'bearer' | 'loopback' | null (signed out). */
  mode: null,
  principal: null,
  key: sessionStorage.getItem(KEY_SLOT) || '',
  /** Called once when a request answers 401 while signed in (revoked or expired key). */
  onExpired: null,
};

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Listeners of the database state seen in answers: `fn(down: boolean)`. */
export const dbListeners = new Set();

function headers(body) {
  const h = {'X-Requested-With': 'agentloop'};
  if (auth.mode === 'bearer' && auth.key) h.Authorization = 'Bearer ' + auth.key;
  if (body !== undefined) h['Content-Type'] = 'application/json';
  return h;
}

/** JSON request; throws ApiError with the envelope's code and message. */
export async function api(method, path, body, signal) {
  let res;
  try {
    res = await fetch(path, {method, headers: headers(body), signal, credentials: 'same-origin',
      body: body === undefined ? undefined : JSON.stringify(body)});
  } catch (e) {
    if (e && e.name === 'AbortError') throw e;
    throw new ApiError(0, 'network', 'the server cannot be reached');
  }
  let data = null;
  const text = await res.text();
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (res.status === 503 && data && data.error && data.error.code === 'database_unavailable') {
    dbListeners.forEach(f => f(true));
  } else if (res.ok) {
    dbListeners.forEach(f => f(false));
  }
  if (!res.ok) {
    const err = new ApiError(res.status, (data && data.error && data.error.code) || 'http_' + res.status,
      (data && data.error && data.error.message) || res.statusText || 'HTTP ' + res.status);
    if (res.status === 401 && auth.mode && auth.onExpired) auth.onExpired(err);
    throw err;
  }
  return data;
}

/** A file download through fetch (works with a cookie or a bearer key). */
export async function download(path, fallbackName) {
  const res = await fetch(path, {headers: headers(), credentials: 'same-origin'});
  if (!res.ok) {
    let msg = 'HTTP ' + res.status;
    try { msg = (await res.json()).error.message; } catch (_) { /* keep */ }
    throw new ApiError(res.status, 'download_failed', msg);
  }
  // RFC 6266: `filename*` (UTF-8, RFC 8187) when given, else `filename`.
  const header = res.headers.get('Content-Disposition') || '';
  const ext = /filename\*=UTF-8''([^;]+)/i.exec(header);
  const plain = /filename="([^"]+)"/.exec(header);
  let name = plain ? plain[1] : fallbackName;
  if (ext) { try { name = decodeURIComponent(ext[1].trim()); } catch (_) { /* keep the ASCII name */ } }
  const url = URL.createObjectURL(await res.blob());
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
  return a.download;
}

async function raw(method, path, body, extra = {}) {
  const h = {'X-Requested-With': 'agentloop', ...extra};
  if (body !== undefined) h['Content-Type'] = 'application/json';
  const res = await fetch(path, {method, headers: h, credentials: 'same-origin', body: body === undefined ? undefined : JSON.stringify(body)});
  let data = null;
  try { data = await res.json(); } catch (_) { data = null; }
  return {status: res.status, data};
}

/**
 * Who is this page? Tries the cookie session (GET /api/session), then — on a server without
 * session routes — a bearer key of this tab, then the development loopback principal.
 * Sets `auth` and returns true when signed in.
 */
export async function resume() {
  const s = await raw('GET', '/api/session');
  if (s.status === 200 && s.data && s.data.principal) {
    auth.mode = s.data.via === 'bearer' ? 'session' : (s.data.via || 'session');
    auth.principal = s.data.principal;
    return true;
  }
  if (s.status !== 404 && s.status !== 405) return false; // 401: the sign-in form
  if (auth.key) {
    const r = await raw('GET', '/api/models', undefined, {Authorization: 'Bearer ' + auth.key});
    if (r.status === 200) {
      auth.mode = 'bearer';
      auth.principal = {name: 'API key ' + auth.key.slice(0, 8) + '…'};
      return true;
    }
    sessionStorage.removeItem(KEY_SLOT);
    auth.key = '';
  }
  const l = await raw('GET', '/api/models');
  if (l.status === 200) {
    auth.mode = 'loopback';
    auth.principal = {name: 'local'};
    return true;
  }
  return false;
}

/** Whether a keyless request is accepted here (the development loopback principal). */
export async function loopbackAvailable() {
  const s = await raw('GET', '/api/session');
  if (s.status === 200 && s.data && s.data.via === 'loopback') return true;
  if (s.status === 404 || s.status === 405) return (await raw('GET', '/api/models')).status === 200;
  return false;
}

/** Signs in with an API key. Throws ApiError (401 invalid_api_key) when it is refused. */
export async function signIn(key) {
  const s = await raw('POST', '/api/session', {key});
  if (s.status === 200 && s.data && s.data.principal) {
    auth.mode = 'session';
    auth.principal = s.data.principal;
    auth.key = '';
    sessionStorage.removeItem(KEY_SLOT);
    return;
  }
  if (s.status === 404 || s.status === 405) {
    const r = await raw('GET', '/api/models', undefined, {Authorization: 'Bearer ' + key});
    if (r.status === 200) {
      auth.mode = 'bearer';
      auth.key = key;
      auth.principal = {name: 'API key ' + key.slice(0, 8) + '…'};
      sessionStorage.setItem(KEY_SLOT, key);
      return;
    }
    throw new ApiError(401, 'invalid_api_key', 'That API key is not valid (or it was revoked).');
  }
  const e = s.data && s.data.error;
  throw new ApiError(s.status, e ? e.code : 'http_' + s.status, s.status === 401 ? 'That API key is not valid (or it was revoked).' : (e ? e.message : 'sign-in failed'));
}

/** Signs out: ends the cookie session (if any) and forgets the tab's key. */
export async function signOut() {
  await raw('DELETE', '/api/session').catch(() => {});
  sessionStorage.removeItem(KEY_SLOT);
  auth.key = '';
  auth.mode = null;
  auth.principal = null;
}
