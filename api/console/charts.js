// SVG charts: the kept-fraction heat strip, the calibration curve and the
// traffic sparklines. Drawn with attributes only (the CSP allows no inline styles).
import { svg } from './util.js';

// A sequential blue scale, light (nothing kept) to dark (everything kept).
const LOW = [238, 242, 247];
const HIGH = [31, 78, 121];

export function heatColor(fraction) {
  const t = Math.max(0, Math.min(1, fraction));
  const channel = (i) => Math.round(LOW[i] + (HIGH[i] - LOW[i]) * t);
  return `rgb(${channel(0)}, ${channel(1)}, ${channel(2)})`;
}

// svg#heat-strip: one rect[data-layer][data-head] per (layer, kv head), a
// column per layer and a row per head, coloured by kept[l][h] / tokens.
export function heatStrip(kept) {
  const layers = kept.n_layer;
  const heads = kept.n_head_kv;
  const left = 44;
  const top = 8;
  const maxWidth = 1140;
  const cell = Math.max(4, Math.min(120, Math.floor((maxWidth - left - 10) / Math.max(1, layers))));
  const rowHeight = Math.max(8, Math.min(26, Math.floor(220 / Math.max(1, heads))));
  const width = Math.max(left + layers * cell + 10, left + 230);
  const gridHeight = rowHeight * heads;
  const legendTop = top + gridHeight + 34;
  const height = legendTop + 30;
  const chart = svg('svg', {
    id: 'heat-strip', class: 'chart heat', viewBox: `0 0 ${width} ${height}`, width, height,
    role: 'img', 'aria-label': `Kept fraction for ${layers} layers by ${heads} kv heads`,
  });
  const labelled = cell >= 40 && rowHeight >= 16; // room for the percentage in each cell
  for (let l = 0; l < layers; l++) {
    for (let h = 0; h < heads; h++) {
      const count = kept.kept[l]?.[h] ?? 0;
      const fraction = kept.tokens ? count / kept.tokens : 0;
      chart.append(svg('rect', {
        x: left + l * cell, y: top + h * rowHeight, width: cell - 1, height: rowHeight - 1,
        fill: heatColor(fraction), 'data-layer': l, 'data-head': h, 'data-fraction': fraction.toFixed(4),
      }, svg('title', {}, `layer ${l}, kv head ${h}: ${(fraction * 100).toFixed(1)}% kept (${count} of ${kept.tokens})`)));
      if (labelled) {
        chart.append(svg('text', {
          x: left + l * cell + cell / 2, y: top + h * rowHeight + rowHeight / 2 + 4, 'text-anchor': 'middle',
          class: fraction > 0.55 ? 'cell-label dark' : 'cell-label', 'pointer-events': 'none',
        }, `${Math.round(fraction * 100)}%`));
      }
    }
  }
  const labelEvery = Math.ceil(layers / Math.max(1, Math.floor((width - left) / 28)));
  for (let l = 0; l < layers; l += labelEvery) {
    chart.append(svg('text', { x: left + l * cell + cell / 2, y: top + gridHeight + 14, class: 'axis-label', 'text-anchor': 'middle' }, String(l)));
  }
  chart.append(svg('text', { x: left, y: top + gridHeight + 28, class: 'axis-title' }, 'layer →'));
  const headEvery = Math.ceil(heads / Math.max(1, Math.floor(gridHeight / 12)));
  for (let h = 0; h < heads; h += headEvery) {
    chart.append(svg('text', { x: left - 6, y: top + h * rowHeight + rowHeight / 2 + 4, class: 'axis-label', 'text-anchor': 'end' }, `h${h}`));
  }
  chart.append(legend(left, legendTop));
  return chart;
}

function legend(x, y) {
  const group = svg('g', { class: 'legend' });
  const steps = 20;
  const w = 200;
  for (let i = 0; i < steps; i++) {
    group.append(svg('rect', { x: x + (i * w) / steps, y, width: w / steps + 0.5, height: 10, fill: heatColor(i / (steps - 1)) }));
  }
  group.append(svg('text', { x, y: y + 24, class: 'axis-label' }, '0%'));
  group.append(svg('text', { x: x + w, y: y + 24, class: 'axis-label', 'text-anchor': 'end' }, '100% kept'));
  return group;
}

// The NLL ratio the fitted curve predicts at retention rho.
export function curveAt(a, b, rho) {
  return 1 + a * (rho ** -b - 1);
}

function niceTicks(lo, hi, count) {
  const span = hi - lo;
  const raw = span / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((s) => span / s <= count) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toFixed(10)));
  return ticks;
}

// svg#calibration-chart: the curve f(rho) = 1 + a (rho^-b - 1) as
// path.curve, the measured points as circle.point, the tau line and the
// chosen retention.
export function calibrationChart(cal) {
  const width = 640;
  const height = 320;
  const pad = { left: 56, right: 20, top: 16, bottom: 44 };
  const points = cal.points || [];
  const xMin = Math.min(0.05, ...points.map((p) => p.retention), cal.chosen ?? 1);
  const xMax = 1;
  const interesting = [cal.tau, ...points.map((p) => p.nll_ratio), cal.measured, curveAt(cal.a, cal.b, cal.chosen || 1)]
    .filter((v) => Number.isFinite(v));
  const yMax = Math.max(1.05, ...interesting) * 1.15;
  const yMin = Math.min(1, ...interesting) - 0.02 * (yMax - 1);
  const sx = (x) => pad.left + ((x - xMin) / (xMax - xMin)) * (width - pad.left - pad.right);
  const sy = (y) => height - pad.bottom - ((y - yMin) / (yMax - yMin)) * (height - pad.top - pad.bottom);
  const chart = svg('svg', {
    id: 'calibration-chart', class: 'chart calibration', viewBox: `0 0 ${width} ${height}`, width, height, role: 'img',
    'aria-label': `NLL ratio against retention: a=${cal.a}, b=${cal.b}, tau=${cal.tau}, chosen retention ${cal.chosen}`,
  });
  const clipId = 'calibration-clip';
  chart.append(svg('defs', {}, svg('clipPath', { id: clipId },
    svg('rect', { x: pad.left, y: pad.top, width: width - pad.left - pad.right, height: height - pad.top - pad.bottom }))));
  for (const t of niceTicks(xMin, xMax, 8)) {
    chart.append(svg('line', { x1: sx(t), x2: sx(t), y1: pad.top, y2: height - pad.bottom, class: 'grid' }));
    chart.append(svg('text', { x: sx(t), y: height - pad.bottom + 16, class: 'axis-label', 'text-anchor': 'middle' }, String(t)));
  }
  for (const t of niceTicks(yMin, yMax, 6)) {
    chart.append(svg('line', { x1: pad.left, x2: width - pad.right, y1: sy(t), y2: sy(t), class: 'grid' }));
    chart.append(svg('text', { x: pad.left - 6, y: sy(t) + 4, class: 'axis-label', 'text-anchor': 'end' }, String(t)));
  }
  chart.append(svg('text', { x: (pad.left + width - pad.right) / 2, y: height - 8, class: 'axis-title', 'text-anchor': 'middle' }, 'retention ρ (fraction of rows kept)'));
  chart.append(svg('text', { x: 14, y: (pad.top + height - pad.bottom) / 2, class: 'axis-title', 'text-anchor': 'middle',
    transform: `rotate(-90 14 ${(pad.top + height - pad.bottom) / 2})` }, 'NLL ratio'));

  const plot = svg('g', { 'clip-path': `url(#${clipId})` });
  const steps = 160;
  let d = '';
  for (let i = 0; i <= steps; i++) {
    const rho = xMin + ((xMax - xMin) * i) / steps;
    d += `${i ? 'L' : 'M'}${sx(rho).toFixed(1)},${sy(curveAt(cal.a, cal.b, rho)).toFixed(1)}`;
  }
  plot.append(svg('path', { d, class: 'curve' }));
  if (Number.isFinite(cal.tau)) {
    plot.append(svg('line', { x1: pad.left, x2: width - pad.right, y1: sy(cal.tau), y2: sy(cal.tau), class: 'tau' }));
  }
  if (Number.isFinite(cal.chosen)) {
    plot.append(svg('line', { x1: sx(cal.chosen), x2: sx(cal.chosen), y1: pad.top, y2: height - pad.bottom, class: 'chosen' }));
    const y = Number.isFinite(cal.measured) ? cal.measured : curveAt(cal.a, cal.b, cal.chosen);
    plot.append(svg('circle', { cx: sx(cal.chosen), cy: sy(y), r: 5, class: 'chosen-point' },
      svg('title', {}, `chosen retention ${cal.chosen}: NLL ratio ${y.toFixed(4)}${Number.isFinite(cal.measured) ? ' (measured)' : ' (predicted)'}`)));
  }
  for (const p of points) {
    plot.append(svg('circle', { cx: sx(p.retention), cy: sy(p.nll_ratio), r: 4, class: 'point' },
      svg('title', {}, `retention ${p.retention}: NLL ratio ${p.nll_ratio}`)));
  }
  chart.append(plot);
  if (Number.isFinite(cal.tau)) {
    chart.append(svg('text', { x: width - pad.right - 4, y: sy(cal.tau) - 6, class: 'tau-label', 'text-anchor': 'end' }, `τ = ${cal.tau}`));
  }
  if (Number.isFinite(cal.chosen)) {
    chart.append(svg('text', { x: sx(cal.chosen) + 6, y: pad.top + 12, class: 'chosen-label' }, `chosen ρ = ${cal.chosen}`));
  }
  return chart;
}

// A small line of the recent values (at most `keep` of them).
export function sparkline(values, width = 160, height = 32) {
  const chart = svg('svg', { class: 'spark', viewBox: `0 0 ${width} ${height}`, width, height, preserveAspectRatio: 'none', 'aria-hidden': 'true' });
  const finite = values.filter((v) => Number.isFinite(v));
  if (finite.length < 2) return chart;
  const max = Math.max(...finite);
  const min = Math.min(0, ...finite);
  const span = max - min || 1;
  const step = width / Math.max(1, values.length - 1);
  let d = '';
  values.forEach((v, i) => {
    if (!Number.isFinite(v)) return;
    d += `${d ? 'L' : 'M'}${(i * step).toFixed(1)},${(height - 2 - ((v - min) / span) * (height - 4)).toFixed(1)}`;
  });
  chart.append(svg('path', { d, class: 'spark-line' }));
  return chart;
}
