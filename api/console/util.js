// Small DOM and formatting helpers shared by the pages.

// el('td', {class: 'num', 'data-x': 1}, 'text', childNode): an element with
// attributes (null/false ones skipped, true ones empty) and children
// (strings become text nodes; null is skipped).
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

const SVG_NS = 'http://www.w3.org/2000/svg';

export function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  append(node, children);
  return node;
}

function setAttrs(node, attrs) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    node.setAttribute(key, value === true ? '' : String(value));
  }
}

function append(node, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(node) {
  node.replaceChildren();
}

export function formatBytes(n) {
  if (n === null || n === undefined || Number.isNaN(n)) return '—';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = n;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(value < 10 ? 2 : 1)} ${units[unit]}`;
}

export function formatNumber(n, digits = 3) {
  if (n === null || n === undefined || Number.isNaN(n)) return '—';
  if (Number.isInteger(n)) return n.toLocaleString('en-US');
  return Number(n.toPrecision(digits)).toString();
}

export function formatPercent(fraction, digits = 1) {
  if (fraction === null || fraction === undefined || Number.isNaN(fraction)) return '—';
  return `${(fraction * 100).toFixed(digits)}%`;
}

export function formatSeconds(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return '—';
  if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 2 : 0)} ms`;
  return `${s.toFixed(2)} s`;
}

// Unix seconds as a local date and time, with "3 min ago" for recent ones.
export function formatTime(unixSeconds) {
  if (!unixSeconds) return '—';
  const date = new Date(unixSeconds * 1000);
  return date.toLocaleString('en-GB', { dateStyle: 'medium', timeStyle: 'short' });
}

export function formatAgo(unixSeconds) {
  if (!unixSeconds) return '—';
  const seconds = Math.max(0, Date.now() / 1000 - unixSeconds);
  if (seconds < 60) return 'just now';
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.floor(seconds / 3600)} h ago`;
  return `${Math.floor(seconds / 86400)} d ago`;
}

export function shortId(id) {
  return id && id.length > 10 ? `${id.slice(0, 10)}…` : id || '';
}

// The policy's name: the spec up to ':' (and before a layout's '|').
export function policyName(spec) {
  if (!spec) return '';
  return spec.split('|')[0].split(':')[0];
}

// The value of one key of a policy spec ("knorm:retention=0.5,..."), or null.
export function policyKey(spec, key) {
  if (!spec) return null;
  const params = spec.split('|')[0].split(':')[1] || '';
  for (const pair of params.split(',')) {
    const [k, v] = pair.split('=');
    if (k === key) return v;
  }
  return null;
}

// Marks the page loaded (data-ready="1"), for people and the browser test.
export function markReady(main) {
  main.dataset.ready = '1';
}

// Asks in dialog#confirm-dialog; resolves true for OK, false for Cancel or Escape.
export function confirmAction(text, okLabel = 'OK', danger = false) {
  const dialog = document.getElementById('confirm-dialog');
  const ok = document.getElementById('confirm-ok');
  const cancel = document.getElementById('confirm-cancel');
  document.getElementById('confirm-text').textContent = text;
  ok.textContent = okLabel;
  ok.classList.toggle('danger', danger);
  ok.classList.toggle('primary', !danger);
  return new Promise((resolve) => {
    const finish = (answer) => {
      ok.removeEventListener('click', onOk);
      cancel.removeEventListener('click', onCancel);
      dialog.removeEventListener('cancel', onEscape);
      if (dialog.open) dialog.close();
      resolve(answer);
    };
    const onOk = () => finish(true);
    const onCancel = () => finish(false);
    const onEscape = (event) => {
      event.preventDefault();
      finish(false);
    };
    ok.addEventListener('click', onOk);
    cancel.addEventListener('click', onCancel);
    dialog.addEventListener('cancel', onEscape);
    dialog.showModal();
    cancel.focus();
  });
}

// A message box for a failed call, in place of the page's content.
export function errorBox(error) {
  return el('div', { class: 'notice error-notice', role: 'alert' }, error.message || String(error));
}
