// Prefix detail: the quality numbers, the kept fraction per layer and kv
// head, per-span keep rates and the calibration curve.
import { api } from './api.js';
import { calibrationChart, heatStrip } from './charts.js';
import {
  confirmAction, el, errorBox, formatBytes, formatNumber, formatPercent, formatTime, markReady, shortId,
} from './util.js';

function qualityTable(prefix) {
  const q = prefix.quality || {};
  const rows = [
    ['Tokens', formatNumber(prefix.tokens)],
    ['Kept rows', formatNumber(prefix.kept_rows)],
    ['Kept fraction', formatPercent(prefix.kept_fraction, 2)],
    ['Retention', q.retention ?? '—'],
    ['Quality budget (tau)', q.tau ?? '—'],
    ['NLL, full prefix', q.nll_full === null || q.nll_full === undefined ? '—' : formatNumber(q.nll_full, 5)],
    ['NLL ratio', q.nll_ratio === null || q.nll_ratio === undefined ? '—' : formatNumber(q.nll_ratio, 5)],
    ['Hits', prefix.hits === undefined ? '—' : formatNumber(prefix.hits)],
    ['Bytes', formatBytes(prefix.bytes)],
    ['Dtype', prefix.dtype || '—'],
    ['Namespace', prefix.namespace || '(default)'],
    ['Pinned', prefix.pinned ? 'yes' : 'no'],
    ['Created', formatTime(prefix.created_at)],
    ['Last used', formatTime(prefix.last_used)],
  ];
  return el('table', { id: 'prefix-quality', class: 'data kv' },
    el('tbody', {}, rows.map(([k, v]) => el('tr', {}, el('th', { scope: 'row' }, k), el('td', { class: 'num' }, String(v))))));
}

function spanTable(kept) {
  const spans = kept && kept.spans ? kept.spans : [];
  if (!spans.length) {
    return el('p', { id: 'span-rates-none', class: 'muted' },
      'This prefix has no spans (it was registered without segments, automatic spans or kept phrases).');
  }
  const rows = spans.map((s) => el('tr', {},
    el('td', { class: 'mono' }, s.name),
    el('td', { class: 'num' }, `${s.start}–${s.end}`),
    el('td', {}, s.whitelisted ? el('span', { class: 'badge' }, 'kept whole') : 'no'),
    el('td', { class: 'num' }, formatNumber(s.rows)),
    el('td', { class: 'num' }, formatNumber(s.kept_rows)),
    el('td', { class: 'num' }, el('span', { class: 'meter' }, el('meter', { min: 0, max: 1, value: s.kept_fraction })), ' ', formatPercent(s.kept_fraction))));
  return el('table', { id: 'span-rates', class: 'data' },
    el('thead', {}, el('tr', {}, el('th', {}, 'Span'), el('th', { class: 'num' }, 'Tokens'), el('th', {}, 'Whitelisted'),
      ['Rows', 'Kept rows', 'Kept'].map((h) => el('th', { class: 'num' }, h)))),
    el('tbody', {}, rows));
}

function keptRanges(kept) {
  if (!kept || !kept.keep || !kept.keep.length) return null;
  return el('p', { class: 'muted' }, 'Tokens kept in every layer and head (kept phrases): ',
    kept.keep.map(([a, b]) => `${a}–${b}`).join(', '));
}

function calibrationSection(prefix) {
  const cal = prefix.calibration;
  if (!cal) {
    return el('p', { id: 'calibration-none', class: 'muted' },
      'No calibration is stored: the prefix was registered with a fixed retention.');
  }
  return el('div', {},
    calibrationChart(cal),
    el('p', { class: 'muted small' },
      `f(ρ) = 1 + ${formatNumber(cal.a, 4)} · (ρ^−${formatNumber(cal.b, 4)} − 1); `,
      `${(cal.points || []).length} measured point(s)${(cal.points || []).length ? '' : ' (zero-shot curve)'}; `,
      `chosen ρ = ${cal.chosen}`, cal.measured !== null && cal.measured !== undefined ? `, measured ratio ${formatNumber(cal.measured, 5)}` : ''),
    el('div', { class: 'chart-legend' },
      el('span', { class: 'key key-curve' }, 'fitted curve'), el('span', { class: 'key key-point' }, 'measured'),
      el('span', { class: 'key key-tau' }, 'tau'), el('span', { class: 'key key-chosen' }, 'chosen retention')));
}

export async function renderDetail(page) {
  const { main, arg: id } = page;
  let prefix;
  let kept = null;
  let keptError = null;
  try {
    [prefix, kept] = await Promise.all([
      api.getPrefix(id),
      api.getKept(id).catch((error) => {
        keptError = error;
        return null;
      }),
    ]);
  } catch (error) {
    if (!page.alive()) return null;
    main.append(el('div', { class: 'page-head' }, el('h1', {}, 'Prefix'), el('a', { href: '#/prefixes' }, '← all prefixes')), errorBox(error));
    markReady(main);
    return null;
  }
  if (!page.alive()) return null;

  const pin = el('button', { id: 'detail-pin', type: 'button' }, prefix.pinned ? 'Unpin' : 'Pin');
  const remove = el('button', { id: 'detail-delete', type: 'button', class: 'danger-outline' }, 'Delete');
  const status = el('div', { class: 'status-line', role: 'status' });
  const quality = el('div', {}, qualityTable(prefix));
  const section = el('section', { id: 'prefix-detail', 'data-prefix-id': prefix.id },
    el('div', { class: 'page-head' },
      el('div', {}, el('a', { href: '#/prefixes', class: 'back' }, '← all prefixes'),
        el('h1', {}, 'Prefix ', el('span', { class: 'mono', title: prefix.id }, shortId(prefix.id)))),
      el('div', { class: 'spacer' }), pin, remove),
    el('p', { class: 'mono muted small wrap' }, prefix.id),
    el('p', { class: 'mono small wrap policy-full', title: 'policy' }, prefix.policy || ''),
    status,
    el('div', { class: 'two-col' },
      el('div', { class: 'card' }, el('h2', {}, 'Quality'), quality),
      el('div', { class: 'card' }, el('h2', {}, 'Calibration: NLL ratio against retention'), calibrationSection(prefix))),
    el('div', { class: 'card' }, el('h2', {}, 'Kept fraction by layer and kv head'),
      kept ? heatStrip(kept) : el('p', { class: 'error' }, `The kept rows are unavailable: ${keptError ? keptError.message : 'no answer'}`)),
    el('div', { class: 'card' }, el('h2', {}, 'Keep rate by span'), spanTable(kept), keptRanges(kept)));
  main.append(section);

  pin.addEventListener('click', async () => {
    const pinning = !prefix.pinned;
    const question = pinning ? 'Pin this prefix? A pinned prefix is never evicted by the store\'s size limit.'
      : 'Unpin this prefix? It may then be evicted when the store is full.';
    if (!(await confirmAction(question, pinning ? 'Pin' : 'Unpin'))) return;
    try {
      prefix = { ...prefix, ...(await api.setPinned(prefix.id, pinning)) };
      pin.textContent = prefix.pinned ? 'Unpin' : 'Pin';
      quality.replaceChildren(qualityTable(prefix));
      status.textContent = prefix.pinned ? 'Pinned.' : 'Unpinned.';
      status.classList.remove('error');
    } catch (error) {
      status.textContent = `Could not change the pin: ${error.message}`;
      status.classList.add('error');
    }
  });
  remove.addEventListener('click', async () => {
    if (!(await confirmAction('Delete this prefix? Requests stop finding it; this cannot be undone.', 'Delete', true))) return;
    try {
      await api.deletePrefix(prefix.id);
      page.navigate('#/prefixes');
    } catch (error) {
      status.textContent = `Could not delete: ${error.message}`;
      status.classList.add('error');
    }
  });
  markReady(main);
  return null;
}
