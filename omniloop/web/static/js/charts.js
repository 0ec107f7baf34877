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
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

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
  // Split panels with many series so every line stays readable.
  const result = [];
  for (const [title, members] of sorted) {
    for (let i = 0; i < members.length; i += MAX_SERIES) {
      const part = members.slice(i, i + MAX_SERIES);
      result.push({ title: i ? `${title} (${i / MAX_SERIES + 1})` : title, names: part });
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
  constructor(title, names, store) {
    this.title = title;
    this.names = names;
    this.store = store;
    this.el = h("section", { class: "chart-panel", "data-chart": title },
      h("h3", {}, title),
      h("div", { class: "chart-body" }));
    this.plot = null;
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
        { size: 56, values: (u, splits) => splits.map((v) => (v == null ? "" : COMPACT.format(v))) },
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
