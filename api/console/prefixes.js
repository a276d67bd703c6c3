// Prefixes: the stored prefixes as a sortable, filterable table, with pin
// and delete (each confirmed in dialog#confirm-dialog).
import { api } from './api.js';
import {
  confirmAction, el, formatAgo, formatBytes, formatNumber, formatPercent, formatTime,
  markReady, policyKey, policyName, shortId,
} from './util.js';

const COLUMNS = [
  { key: 'id', label: 'Id' },
  { key: 'namespace', label: 'Namespace' },
  { key: 'tokens', label: 'Tokens', numeric: true },
  { key: 'kept_fraction', label: 'Kept', numeric: true },
  { key: 'policy', label: 'Policy' },
  { key: 'dtype', label: 'Dtype' },
  { key: 'bytes', label: 'Bytes', numeric: true },
  { key: 'pinned', label: 'Pinned' },
  { key: 'hits', label: 'Hits', numeric: true },
  { key: 'last_used', label: 'Last used', numeric: true },
];

// Sorting survives leaving the page and coming back.
const sortState = { key: 'last_used', descending: true };

function compare(a, b, key) {
  const x = a[key];
  const y = b[key];
  if (x === y) return 0;
  if (x === null || x === undefined) return 1;
  if (y === null || y === undefined) return -1;
  if (typeof x === 'number' || typeof x === 'boolean') return Number(x) - Number(y);
  return String(x).localeCompare(String(y));
}

function sorted(prefixes) {
  const list = [...prefixes];
  list.sort((a, b) => {
    const order = compare(a, b, sortState.key);
    return sortState.descending ? -order : order;
  });
  return list;
}

function matches(prefix, filter) {
  if (!filter) return true;
  const needle = filter.toLowerCase();
  return [prefix.id, prefix.namespace, prefix.policy].some((v) => (v || '').toLowerCase().includes(needle));
}

function keptCell(fraction) {
  if (fraction === null || fraction === undefined) return el('td', { class: 'num' }, '—');
  return el('td', { class: 'num' },
    el('span', { class: 'meter', title: formatPercent(fraction, 2) },
      el('meter', { min: 0, max: 1, value: fraction })),
    ' ', formatPercent(fraction));
}

function policyCell(spec) {
  const retention = policyKey(spec, 'retention');
  return el('td', { class: 'policy', title: spec || '' },
    el('span', { class: 'policy-name' }, policyName(spec) || '—'),
    retention ? el('span', { class: 'muted' }, ` r=${retention}`) : null,
    (spec || '').includes('|') ? el('span', { class: 'tag' }, 'layout') : null);
}

function prefixRow(prefix, actions) {
  if (prefix.error) {
    return el('tr', { 'data-prefix-id': prefix.id, class: 'broken' },
      el('td', { class: 'mono', title: prefix.id }, shortId(prefix.id)),
      el('td', { colspan: COLUMNS.length - 1, class: 'error' }, prefix.error),
      el('td', { class: 'actions' }, deleteButton(prefix, actions)));
  }
  const pin = el('button', { type: 'button', 'data-action': 'pin', class: 'small' }, prefix.pinned ? 'Unpin' : 'Pin');
  pin.addEventListener('click', () => actions.pin(prefix));
  return el('tr', { 'data-prefix-id': prefix.id },
    el('td', { class: 'mono' }, el('a', { href: `#/prefix/${prefix.id}`, 'data-action': 'open', title: prefix.id }, shortId(prefix.id))),
    el('td', {}, prefix.namespace ? prefix.namespace : el('span', { class: 'muted' }, '(default)')),
    el('td', { class: 'num' }, formatNumber(prefix.tokens)),
    keptCell(prefix.kept_fraction),
    policyCell(prefix.policy),
    el('td', {}, prefix.dtype || '—'),
    el('td', { class: 'num' }, formatBytes(prefix.bytes)),
    el('td', {}, prefix.pinned ? el('span', { class: 'badge' }, 'pinned') : el('span', { class: 'muted' }, 'no')),
    el('td', { class: 'num' }, prefix.hits === undefined ? '—' : formatNumber(prefix.hits)),
    el('td', { class: 'num', title: formatTime(prefix.last_used) }, formatAgo(prefix.last_used)),
    el('td', { class: 'actions' }, pin, deleteButton(prefix, actions)));
}

function deleteButton(prefix, actions) {
  const button = el('button', { type: 'button', 'data-action': 'delete', class: 'small danger-outline' }, 'Delete');
  button.addEventListener('click', () => actions.remove(prefix));
  return button;
}

function headerRow(onSort) {
  return el('tr', {}, COLUMNS.map((col) => {
    const th = el('th', {
      'data-sort': col.key,
      class: col.numeric ? 'num sortable' : 'sortable',
      'aria-sort': sortState.key === col.key ? (sortState.descending ? 'descending' : 'ascending') : 'none',
      tabindex: 0,
    }, col.label);
    th.addEventListener('click', () => onSort(col.key));
    th.addEventListener('keydown', (event) => {
      if (event.key === 'Enter' || event.key === ' ') {
        event.preventDefault();
        onSort(col.key);
      }
    });
    return th;
  }), el('th', { class: 'actions' }, ''));
}

export async function renderPrefixes(page) {
  const { main } = page;
  let prefixes = [];
  const filter = el('input', { id: 'prefixes-filter', type: 'search', placeholder: 'Filter by id, namespace or policy', 'aria-label': 'Filter' });
  const count = el('span', { class: 'muted' });
  const refresh = el('button', { type: 'button', class: 'quiet' }, 'Refresh');
  const thead = el('thead');
  const tbody = el('tbody');
  const table = el('table', { id: 'prefixes-table', class: 'data' }, thead, tbody);
  const empty = el('div', { id: 'prefixes-empty', class: 'notice', hidden: true },
    'No prefix is stored yet. ', el('a', { href: '#/register' }, 'Register one'), '.');
  const status = el('div', { class: 'status-line', role: 'status' });
  main.append(
    el('div', { class: 'page-head' }, el('h1', {}, 'Prefixes'), count,
      el('div', { class: 'spacer' }), filter, refresh, el('a', { href: '#/register', class: 'button primary' }, 'Register')),
    status, el('div', { class: 'table-wrap' }, table), empty);

  const draw = () => {
    thead.replaceChildren(headerRow(onSort));
    const shown = sorted(prefixes).filter((p) => matches(p, filter.value.trim()));
    tbody.replaceChildren(...shown.map((p) => prefixRow(p, actions)));
    if (prefixes.length && !shown.length) {
      tbody.append(el('tr', {}, el('td', { colspan: COLUMNS.length + 1, class: 'muted center' }, 'No prefix matches the filter.')));
    }
    empty.hidden = prefixes.length > 0;
    table.hidden = prefixes.length === 0;
    count.textContent = prefixes.length ? `${shown.length} of ${prefixes.length}` : '';
  };
  const onSort = (key) => {
    if (sortState.key === key) sortState.descending = !sortState.descending;
    else Object.assign(sortState, { key, descending: false });
    draw();
  };
  const say = (text, isError = false) => {
    status.textContent = text;
    status.classList.toggle('error', isError);
  };
  const load = async () => {
    delete main.dataset.ready;
    try {
      const list = await api.listPrefixes();
      if (!page.alive()) return;
      prefixes = list.data || [];
      say('');
      draw();
    } catch (error) {
      if (page.alive()) say(error.message, true);
    }
    if (page.alive()) markReady(main);
  };
  const actions = {
    pin: async (prefix) => {
      const pinning = !prefix.pinned;
      const question = pinning
        ? `Pin prefix ${shortId(prefix.id)}? A pinned prefix is never evicted by the store's size limit.`
        : `Unpin prefix ${shortId(prefix.id)}? It may then be evicted when the store is full.`;
      if (!(await confirmAction(question, pinning ? 'Pin' : 'Unpin'))) return;
      try {
        const updated = await api.setPinned(prefix.id, pinning);
        prefixes = prefixes.map((p) => (p.id === prefix.id ? { ...p, ...updated } : p));
        say(`${pinning ? 'Pinned' : 'Unpinned'} ${shortId(prefix.id)}`);
        draw();
      } catch (error) {
        say(`Could not ${pinning ? 'pin' : 'unpin'}: ${error.message}`, true);
      }
    },
    remove: async (prefix) => {
      const question = `Delete prefix ${shortId(prefix.id)}${prefix.namespace ? ` (namespace ${prefix.namespace})` : ''}? `
        + 'Requests stop finding it; this cannot be undone.';
      if (!(await confirmAction(question, 'Delete', true))) return;
      try {
        await api.deletePrefix(prefix.id);
        prefixes = prefixes.filter((p) => p.id !== prefix.id);
        say(`Deleted ${shortId(prefix.id)}`);
        draw();
      } catch (error) {
        say(`Could not delete: ${error.message}`, true);
      }
    },
  };
  filter.addEventListener('input', draw);
  refresh.addEventListener('click', load);
  draw();
  await load();
  return null;
}
