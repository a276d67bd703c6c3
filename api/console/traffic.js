// Traffic: rates from /admin/v1/metrics (Prometheus text) every 3 s. Rates
// are the differences between two scrapes; hit rates and TTFT fall back to
// the totals since the daemon started when the last interval saw nothing.
import { api } from './api.js';
import { sparkline } from './charts.js';
import { el, formatBytes, formatNumber, formatPercent, formatSeconds, markReady } from './util.js';

const REFRESH_MS = 3000;
const HISTORY = 40;

// Prometheus text exposition 0.0.4: [{name, labels: {k: v}, value}], comments skipped.
export function parseMetrics(text) {
  const samples = [];
  const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
  const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (const raw of text.split('\n')) {
    if (!raw || raw.startsWith('#')) continue;
    const m = line.exec(raw);
    if (!m) continue;
    const labels = {};
    for (const lm of (m[2] || '').matchAll(label)) labels[lm[1]] = lm[2].replace(/\\(.)/g, (_, c) => (c === 'n' ? '\n' : c));
    samples.push({ name: m[1], labels, value: parseValue(m[3]) });
  }
  return samples;
}

function parseValue(text) {
  if (text === '+Inf') return Infinity;
  if (text === '-Inf') return -Infinity;
  return Number(text);
}

// The sum of a family's series (optionally only those whose labels pass keep); null when absent.
function total(samples, name, keep = () => true) {
  let sum = null;
  for (const s of samples) if (s.name === name && keep(s.labels)) sum = (sum ?? 0) + s.value;
  return sum;
}

// A histogram's cumulative buckets: [{le, count}] by le.
function buckets(samples, name) {
  return samples.filter((s) => s.name === `${name}_bucket`)
    .map((s) => ({ le: parseValue(s.labels.le), count: s.value }))
    .sort((a, b) => a.le - b.le);
}

function bucketDelta(now, before) {
  if (!before) return now;
  return now.map((b, i) => ({ le: b.le, count: b.count - (before[i] && before[i].le === b.le ? before[i].count : 0) }));
}

// The q-quantile of cumulative buckets, interpolated linearly within its
// bucket as Prometheus' histogram_quantile does; null without observations.
export function quantile(q, cumulative) {
  if (!cumulative.length) return null;
  const count = cumulative[cumulative.length - 1].count;
  if (!(count > 0)) return null;
  const rank = q * count;
  let lowerBound = 0;
  let lowerCount = 0;
  for (const b of cumulative) {
    if (b.count >= rank) {
      if (b.le === Infinity) return lowerBound; // beyond the last finite bound
      const inBucket = b.count - lowerCount;
      return inBucket > 0 ? lowerBound + ((b.le - lowerBound) * (rank - lowerCount)) / inBucket : b.le;
    }
    lowerBound = b.le;
    lowerCount = b.count;
  }
  return lowerBound;
}

// A ratio of hits in the interval when there were lookups, else since start.
function hitRate(now, before, hitsName, missesName) {
  const hits = total(now, hitsName);
  const misses = total(now, missesName);
  if (hits === null && misses === null) return { value: null, note: 'not reported' };
  const all = (hits ?? 0) + (misses ?? 0);
  if (before) {
    const dh = (hits ?? 0) - (total(before, hitsName) ?? 0);
    const dm = (misses ?? 0) - (total(before, missesName) ?? 0);
    if (dh + dm > 0) return { value: dh / (dh + dm), note: `${dh} of ${dh + dm} in the last interval` };
  }
  if (all > 0) return { value: (hits ?? 0) / all, note: `${hits ?? 0} of ${all} since start` };
  return { value: null, note: 'no lookups yet' };
}

function ttft(now, before, q) {
  const name = 'prefixd_time_to_first_token_seconds';
  const current = buckets(now, name);
  const delta = before ? bucketDelta(current, buckets(before, name)) : null;
  if (delta && delta.length && delta[delta.length - 1].count > 0) {
    return { value: quantile(q, delta), note: `${delta[delta.length - 1].count} request(s) in the last interval` };
  }
  const lifetime = quantile(q, current);
  return lifetime === null ? { value: null, note: 'no requests yet' } : { value: lifetime, note: 'since start' };
}

function perSecond(now, before, seconds, name) {
  if (!before || !(seconds > 0)) return { value: null, note: 'after the next refresh' };
  const delta = (total(now, name) ?? 0) - (total(before, name) ?? 0);
  return { value: Math.max(0, delta) / seconds, note: `over the last ${seconds.toFixed(1)} s` };
}

// The tiles' values from two scrapes (before may be null: the first).
export function summarize(now, before, seconds) {
  return {
    request_rate: perSecond(now, before, seconds, 'prefixd_requests_total'),
    ttft_p50: ttft(now, before, 0.5),
    ttft_p95: ttft(now, before, 0.95),
    tokens_per_s: perSecond(now, before, seconds, 'prefixd_generated_tokens_total'),
    prefix_hit_rate: hitRate(now, before, 'prefixd_prefix_hits_total', 'prefixd_prefix_misses_total'),
    auto_hit_rate: hitRate(now, before, 'prefixd_auto_cache_hits_total', 'prefixd_auto_cache_misses_total'),
    hot_tier_bytes: { value: total(now, 'prefixd_hot_tier_bytes'), note: 'in-memory tier' },
    store_prefixes: { value: total(now, 'prefixd_store_prefixes'), note: `${formatBytes(total(now, 'prefixd_store_bytes'))} stored` },
  };
}

const TILES = [
  { key: 'request_rate', label: 'Requests / s', format: (v) => formatNumber(v, 3) },
  { key: 'ttft_p50', label: 'TTFT p50', format: formatSeconds },
  { key: 'ttft_p95', label: 'TTFT p95', format: formatSeconds },
  { key: 'tokens_per_s', label: 'Generated tokens / s', format: (v) => formatNumber(v, 4) },
  { key: 'prefix_hit_rate', label: 'Registered-prefix hit rate', format: (v) => formatPercent(v) },
  { key: 'auto_hit_rate', label: 'Automatic cache hit rate', format: (v) => formatPercent(v) },
  { key: 'hot_tier_bytes', label: 'Hot tier', format: formatBytes },
  { key: 'store_prefixes', label: 'Stored prefixes', format: (v) => formatNumber(v) },
];

function tile(spec) {
  const value = el('div', { class: 'value' }, '—');
  const note = el('div', { class: 'note' }, '');
  const spark = el('div', { class: 'spark-box' });
  const node = el('div', { class: 'tile card', 'data-metric': spec.key }, el('div', { class: 'label' }, spec.label), value, note, spark);
  return { node, value, note, spark, history: [] };
}

function routeTable(samples) {
  const byRoute = new Map();
  for (const s of samples) {
    if (s.name !== 'prefixd_http_requests_total') continue;
    const row = byRoute.get(s.labels.route) || { ok: 0, client: 0, server: 0 };
    const status = Number(s.labels.status);
    if (status >= 500) row.server += s.value;
    else if (status >= 400) row.client += s.value;
    else row.ok += s.value;
    byRoute.set(s.labels.route, row);
  }
  const rows = [...byRoute.entries()].sort((a, b) => (b[1].ok + b[1].client + b[1].server) - (a[1].ok + a[1].client + a[1].server));
  return el('table', { class: 'data compact' },
    el('thead', {}, el('tr', {}, el('th', {}, 'Route'), el('th', { class: 'num' }, '2xx/3xx'), el('th', { class: 'num' }, '4xx'), el('th', { class: 'num' }, '5xx'))),
    el('tbody', {}, rows.map(([route, r]) => el('tr', {}, el('td', { class: 'mono' }, route),
      el('td', { class: 'num' }, formatNumber(r.ok)), el('td', { class: 'num' }, formatNumber(r.client)),
      el('td', { class: 'num' }, formatNumber(r.server))))));
}

export async function renderTraffic(page) {
  const { main } = page;
  const tiles = TILES.map((spec) => ({ spec, ...tile(spec) }));
  const status = el('div', { class: 'status-line', role: 'status' });
  const routes = el('div', {});
  const section = el('section', { id: 'traffic', 'data-updated': '0' },
    el('div', { class: 'tiles' }, tiles.map((t) => t.node)),
    el('div', { class: 'card' }, el('h2', {}, 'HTTP requests by route, since start'), routes));
  main.append(el('div', { class: 'page-head' }, el('h1', {}, 'Traffic'),
    el('span', { class: 'muted' }, `from /admin/v1/metrics, every ${REFRESH_MS / 1000} s`)), status, section);

  let previous = null;
  let previousAt = 0;
  let updates = 0;
  let timer = null;
  let stopped = false;
  const refresh = async () => {
    try {
      const text = await api.metricsText();
      if (stopped || !page.alive()) return;
      const samples = parseMetrics(text);
      const at = performance.now();
      const values = summarize(samples, previous, (at - previousAt) / 1000);
      for (const t of tiles) {
        const v = values[t.spec.key];
        t.value.textContent = v.value === null || v.value === undefined ? '—' : t.spec.format(v.value);
        t.note.textContent = v.note;
        t.history.push(v.value ?? NaN);
        if (t.history.length > HISTORY) t.history.shift();
        t.spark.replaceChildren(sparkline(t.history));
      }
      routes.replaceChildren(routeTable(samples));
      previous = samples;
      previousAt = at;
      updates += 1;
      section.dataset.updated = String(updates);
      status.textContent = `Updated ${new Date().toLocaleTimeString('en-GB')}`;
      status.classList.remove('error');
      markReady(main);
    } catch (error) {
      if (stopped || !page.alive()) return;
      status.textContent = `Cannot read the metrics: ${error.message}`;
      status.classList.add('error');
      markReady(main);
    }
    if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
  };
  await refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
