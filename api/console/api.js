// Calls to the daemon's admin API. The token lives in sessionStorage only
// (never a URL, localStorage or a cookie) and goes out as a bearer token.

const TOKEN_KEY = 'prefixd.admin_token';

export function getToken() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(token) {
  sessionStorage.setItem(TOKEN_KEY, token);
}

export function clearToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

let unauthorizedHandler = () => {};

// Called with the error whenever the daemon answers 401 (the app logs out).
export function onUnauthorized(handler) {
  unauthorizedHandler = handler;
}

// The error message of a non-2xx answer (the OpenAI error shape), else its status line.
async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message, code);
}

// One call. options.token overrides the stored token (the login check);
// options.raw returns the Response (for streams and text).
export async function request(method, path, body = undefined, options = {}) {
  const token = options.token ?? getToken();
  const headers = { Authorization: `Bearer ${token || ''}` };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: 'no-store',
    credentials: 'omit',
    signal: options.signal,
  });
  if (!response.ok) {
    const error = await errorOf(response);
    if (response.status === 401 && !options.token) unauthorizedHandler(error);
    throw error;
  }
  if (options.raw) return response;
  if (response.status === 204) return null;
  return response.json();
}

const enc = encodeURIComponent;

export const api = {
  listPrefixes: (options) => request('GET', '/admin/v1/prefixes', undefined, options),
  getPrefix: (id) => request('GET', `/admin/v1/prefixes/${enc(id)}`),
  getKept: (id) => request('GET', `/admin/v1/prefixes/${enc(id)}/kept`),
  deletePrefix: (id) => request('DELETE', `/admin/v1/prefixes/${enc(id)}`),
  setPinned: (id, pinned) => request('PATCH', `/admin/v1/prefixes/${enc(id)}`, { pinned }),
  register: (body) => request('POST', '/admin/v1/prefixes', body),
  getJob: (id) => request('GET', `/admin/v1/jobs/${enc(id)}`),
  listPolicies: () => request('GET', '/admin/v1/policies'),
  listModels: () => request('GET', '/admin/v1/models'),
  metricsText: async () => (await request('GET', '/admin/v1/metrics', undefined, { raw: true })).text(),
  // The playground's stream: the raw Response, its body an SSE stream.
  complete: (endpoint, namespace, body, signal) => {
    const path = endpoint === 'chat' ? '/admin/v1/chat/completions' : '/admin/v1/completions';
    const query = namespace ? `?namespace=${enc(namespace)}` : '';
    return request('POST', path + query, body, { raw: true, signal });
  },
};
