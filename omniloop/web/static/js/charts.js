// Metric charts: names grouped into panels, one uPlot chart per panel, updated in place.

import { h } from "./dom.js";

// Known metrics first, in the order a run is usually read; anything else is grouped by the
// first segment of its name ("perf/…", "timing/…").
const GROUPS = [
  { title: "Reward", test: (n) => /^reward(\/|$)/.test(n) || /(^|\/)reward(_|\/|$)/.test(n) },
  { title: "Response length", test: (n) => /(^|\/)(response_)?length(\/|$)/.test(n) },
  { title: "KL", test: (n) => /(^|\/)kl(\/|_|$)/.test(n) },
  { title: "Entropy", test: (n) => /(^|\/)entropy(\/|$)/.test(n) },
  { title: "Staleness", test: (n) => /^staleness(\/|$)/.test(n) },
  { title: "Throughput", test: (n) => /^perf\//.test(n) || /per_second|throughput/.test(n) },
  {
    title: "Sandbox latency",
    test: (n) => /^sandbox\//.test(n) && /latency|seconds|duration|time/.test(n),
  },
  { title: "Sandbox", test: (n) => /^sandbox\//.test(n) },
  { title: "Errors", test: (n) => /(^|\/)errors?(\/|_|$)/.test(n) },
];

const MAX_SERIES = 8;
const COMPACT = new Intl.NumberFormat("en", { notation: "compact", maximumFractionDigits: 3 });
const MARKER_COLOR = "rgba(185, 28, 28, 0.7)";
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

// The unit of a metric, read from its name ("" when the name does not say). Series of
// different units never share an axis: seconds beside tokens/s would flatten one of them.
export function unitOf(name) {
  if (/^staleness\/(max|mean)$/.test(name)) return "steps behind";
  if (/^staleness\//.test(name)) return "samples";
  if (/per_second|_per_s$|throughput/.test(name)) return /tokens/.test(name) ? "tokens/s" : "per s";
  if (/(^|[/_])(seconds|latency|duration)($|[/_])/.test(name)) return "s";
  if (/(^|[/_])tokens$/.test(name)) return "tokens";
  if (/(^|[/_])bytes$/.test(name)) return "bytes";
  return "";
}

// Panels {title, names, unit}: names grouped by subject (GROUPS, else the first segment),
// then split by unit (a panel of one subject and several units becomes one panel per unit,
// titled "Subject · unit"), then split again past MAX_SERIES lines.
export function groupMetrics(names) {
  const panels = new Map();
  for (const name of [...names].sort()) {
    const known = GROUPS.find((g) => g.test(name));
    const title = known ? known.title : name.includes("/") ? name.split("/")[0] : name;
    if (!panels.has(title)) panels.set(title, []);
    panels.get(title).push(name);
  }
  const order = GROUPS.map((g) => g.title);
  const rank = (t) => (order.includes(t) ? order.indexOf(t) : order.length);
  const sorted = [...panels.entries()].sort((a, b) => rank(a[0]) - rank(b[0]) || a[0].localeCompare(b[0]));
  const result = [];
  for (const [title, members] of sorted) {
    const byUnit = new Map();
    for (const name of members) {
      const unit = unitOf(name);
      if (!byUnit.has(unit)) byUnit.set(unit, []);
      byUnit.get(unit).push(name);
    }
    const units = [...byUnit.keys()].sort();
    for (const unit of units) {
      const base = units.length > 1 ? `${title} · ${unit || "value"}` : title;
      const group = byUnit.get(unit);
      // Split panels with many series so every line stays readable.
      for (let i = 0; i < group.length; i += MAX_SERIES) {
        const part = group.slice(i, i + MAX_SERIES);
        result.push({ title: i ? `${base} (${i / MAX_SERIES + 1})` : base, names: part, unit });
      }
    }
  }
  return result;
}

// Points per metric, kept by step so re-polled steps replace rather than duplicate.
export class MetricStore {
  constructor() {
    this.series = new Map();
    this.lastStep = null;
  }

  merge(metrics) {
    const changed = new Set();
    for (const [name, points] of Object.entries(metrics)) {
      if (!this.series.has(name)) this.series.set(name, new Map());
      const byStep = this.series.get(name);
      for (const p of points) {
        byStep.set(p.step, p.value);
        if (this.lastStep === null || p.step > this.lastStep) this.lastStep = p.step;
      }
      if (points.length) changed.add(name);
    }
    return changed;
  }

  names() {
    return [...this.series.keys()];
  }

  aligned(names) {
    const steps = new Set();
    for (const n of names) for (const s of this.series.get(n)?.keys() || []) steps.add(s);
    const xs = Float64Array.from([...steps].sort((a, b) => a - b));
    const ys = names.map((n) => {
      const byStep = this.series.get(n) || new Map();
      return Array.from(xs, (s) => (byStep.has(s) ? byStep.get(s) : null));
    });
    return [xs, ...ys];
  }
}

export class ChartPanel {
  constructor(title, names, store, unit = "") {
    this.title = title;
    this.names = names;
    this.store = store;
    this.unit = unit;
    this.key = h("span", { class: "fault-key", hidden: true, title: "steps that saw a fault of the run's roles" }, "fault");
    this.el = h("section", { class: "chart-panel", "data-chart": title, "data-unit": unit },
      h("div", { class: "chart-head" }, h("h3", {}, title), this.key),
      h("div", { class: "chart-body" }));
    this.plot = null;
    this.markers = [];
  }

  // Mark `steps` (faults) with dashed vertical lines across the plot.
  setMarkers(steps) {
    this.markers = steps;
    if (steps.length) this.el.dataset.markers = steps.join(",");
    else delete this.el.dataset.markers;
    this.key.hidden = steps.length === 0;
    this.plot?.redraw(false, false);
  }

  drawMarkers(u) {
    if (!this.markers.length) return;
    const { ctx } = u;
    const { left, top, width, height } = u.bbox;
    ctx.save();
    ctx.strokeStyle = MARKER_COLOR;
    ctx.lineWidth = Math.max(1, window.devicePixelRatio || 1);
    ctx.setLineDash([4 * ctx.lineWidth, 3 * ctx.lineWidth]);
    for (const step of this.markers) {
      const x = Math.round(u.valToPos(step, "x", true));
      if (!Number.isFinite(x) || x < left || x > left + width) continue;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }

  render() {
    const body = this.el.querySelector(".chart-body");
    const data = this.store.aligned(this.names);
    this.el.dataset.points = String(data[0].length);
    if (this.plot) {
      this.plot.setData(data);
      return;
    }
    if (typeof window.uPlot !== "function") {
      body.textContent = "charting library failed to load";
      return;
    }
    const width = Math.max(body.clientWidth || 0, 280);
    const opts = {
      width,
      height: 190,
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false } },
      // Compact tick labels (538M, 1.2k, 0.04): byte counts would not fit the axis.
      axes: [
        { label: "step", size: 34, labelSize: 14 },
        {
          size: 56,
          ...(this.unit ? { label: this.unit, labelSize: 14 } : {}),
          values: (u, splits) => splits.map((v) => (v == null ? "" : COMPACT.format(v))),
        },
      ],
      series: [
        { label: "step" },
        ...this.names.map((name, i) => ({
          label: name,
          stroke: COLORS[i % COLORS.length],
          width: 1.5,
          spanGaps: true,
          points: { show: data[0].length < 60 },
        })),
      ],
      hooks: { draw: [(u) => this.drawMarkers(u)] },
    };
    this.plot = new window.uPlot(opts, data, body);
  }

  resize() {
    const body = this.el.querySelector(".chart-body");
    if (this.plot && body.clientWidth) this.plot.setSize({ width: body.clientWidth, height: 190 });
  }

  destroy() {
    this.plot?.destroy();
    this.plot = null;
  }
}

// A sparkline of points [{step, value}] as inline SVG: a line over the steps (broken where a
// value is null), a dot on the newest point, the range in the tooltip.
export function sparkline(points, { width = 96, height = 22 } = {}) {
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");
  svg.dataset.points = String(points.length);
  const finite = points.filter((p) => p.value !== null && Number.isFinite(p.value));
  if (finite.length < 2) return svg;
  const steps = points.map((p) => p.step);
  const values = finite.map((p) => p.value);
  const [x0, x1] = [Math.min(...steps), Math.max(...steps)];
  const [y0, y1] = [Math.min(...values), Math.max(...values)];
  const pad = 2;
  const x = (step) => pad + ((step - x0) / (x1 - x0 || 1)) * (width - 2 * pad);
  const y = (v) => height - pad - (y1 === y0 ? 0.5 : (v - y0) / (y1 - y0)) * (height - 2 * pad);
  let d = "";
  let pen = "M";
  for (const p of points) {
    if (p.value === null || !Number.isFinite(p.value)) {
      pen = "M";
      continue;
    }
    d += `${pen}${x(p.step).toFixed(1)},${y(p.value).toFixed(1)}`;
    pen = "L";
  }
  const line = document.createElementNS(ns, "path");
  line.setAttribute("d", d);
  svg.append(line);
  const last = finite[finite.length - 1];
  const dot = document.createElementNS(ns, "circle");
  dot.setAttribute("cx", x(last.step).toFixed(1));
  dot.setAttribute("cy", y(last.value).toFixed(1));
  dot.setAttribute("r", "2");
  svg.append(dot);
  const title = document.createElementNS(ns, "title");
  title.textContent = `steps ${x0}–${x1}: ${y0.toPrecision(3)} to ${y1.toPrecision(3)}`;
  svg.append(title);
  return svg;
}
