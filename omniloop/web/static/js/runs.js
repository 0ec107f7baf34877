// The runs list and one run's page (charts updating live, then its episodes).

import { api } from "./api.js";
import { ChartPanel, MetricStore, groupMetrics } from "./charts.js";
import { episodeBrowser } from "./episodes.js";
import { badge, clear, errorBox, fmtTime, h } from "./dom.js";

const POLL_MS = 2000;
const MAX_POINTS = 400;

export function runsPage(root) {
  const state = { cursors: [null], index: 0 };
  const body = h("tbody");
  const newer = h("button", { type: "button", class: "btn", disabled: true, onclick: () => go(-1) }, "← Newer");
  const older = h("button", { type: "button", class: "btn", disabled: true, onclick: () => go(1) }, "Older →");
  const message = h("div");
  clear(root,
    h("div", { class: "page-head" }, h("h1", {}, "Runs"), h("span", { class: "spacer" }), newer, older),
    message,
    h("table", { class: "grid", "data-runs": "" },
      h("thead", {}, h("tr", {}, ["run", "id", "status", "created", "updated", "finished"].map((c) => h("th", {}, c)))),
      body),
    h("p", { class: "muted" }, "Episodes submitted over the API outside any run: ", h("a", { href: "#/episodes" }, "all episodes"), "."));

  async function load() {
    try {
      const page = await api.runs({ cursor: state.cursors[state.index], limit: 50 });
      state.cursors[state.index + 1] = page.next_cursor;
      newer.disabled = state.index === 0;
      older.disabled = !page.next_cursor;
      clear(body, page.items.length ? page.items.map((run) => {
        const link = `#/runs/${encodeURIComponent(run.id)}`;
        return h("tr", { "data-run": run.id },
          h("td", {}, h("a", { href: link }, run.name || run.id)),
          h("td", { class: "mono" }, run.id),
          h("td", {}, badge(run.status)),
          h("td", { class: "nowrap" }, fmtTime(run.created_at)),
          h("td", { class: "nowrap" }, fmtTime(run.updated_at)),
          h("td", { class: "nowrap" }, fmtTime(run.finished_at)));
      }) : h("tr", {}, h("td", { colspan: 6, class: "muted empty" }, "No runs yet.")));
      root.dataset.ready = "true";
    } catch (err) {
      clear(message, errorBox(err));
    }
  }

  function go(delta) {
    state.index = Math.max(0, state.index + delta);
    load();
  }

  load();
  return () => {};
}

export function runPage(root, runId, filters, onFilters) {
  const store = new MetricStore();
  const panels = new Map();
  const grid = h("div", { class: "charts", "data-charts": "" });
  const head = h("div", { class: "page-head" }, h("h1", {}, "Run ", h("span", { class: "mono" }, runId)));
  const message = h("div");
  const browser = episodeBrowser({ runId, filters, onFilters });
  const config = h("pre", { class: "config" });
  clear(root,
    head, message,
    h("details", { class: "config-box" }, h("summary", {}, "Resolved configuration"), config),
    h("h2", {}, "Metrics"), grid,
    h("h2", {}, "Episodes"), browser.el);

  let stopped = false;
  let timer = null;
  const controller = new AbortController();

  api.run(runId).then((run) => {
    clear(head, h("h1", {}, run.name || "Run"), badge(run.status),
      h("span", { class: "mono muted" }, run.id),
      h("span", { class: "muted" }, `started ${fmtTime(run.created_at)}`));
    config.textContent = JSON.stringify(run.config, null, 2);
  }).catch((err) => clear(message, errorBox(err)));

  function layout() {
    const names = store.names();
    const groups = groupMetrics(names);
    const key = JSON.stringify(groups);
    if (key === grid.dataset.layout) return false;
    grid.dataset.layout = key;
    for (const panel of panels.values()) panel.destroy();
    panels.clear();
    clear(grid, groups.length ? [] : h("p", { class: "muted" }, "No metrics recorded yet."));
    for (const g of groups) {
      const panel = new ChartPanel(g.title, g.names, store);
      panels.set(g.title, panel);
      grid.append(panel.el);
    }
    return true;
  }

  async function poll(first) {
    try {
      // Re-read the last step seen: other metrics of that step may have been recorded since.
      const since = store.lastStep === null ? null : store.lastStep - 1;
      // A panel is a few hundred pixels wide: more points than that only cost load time.
      const params = { since_step: since, max_points: MAX_POINTS };
      const doc = await api.metrics(runId, params, { signal: controller.signal });
      if (stopped) return;
      const changed = store.merge(doc.metrics);
      const relaid = layout();
      for (const panel of panels.values()) {
        if (relaid || panel.names.some((n) => changed.has(n))) panel.render();
      }
      if (first) {
        grid.dataset.ready = "true";
        performance.mark("charts-rendered");
      }
    } catch (err) {
      if (err.name === "AbortError" || stopped) return;
      clear(message, errorBox(err));
    }
    if (!stopped) timer = setTimeout(() => poll(false), POLL_MS);
  }

  const onResize = () => { for (const p of panels.values()) p.resize(); };
  window.addEventListener("resize", onResize);
  poll(true);

  return () => {
    stopped = true;
    clearTimeout(timer);
    controller.abort();
    browser.stop();
    window.removeEventListener("resize", onResize);
    for (const panel of panels.values()) panel.destroy();
  };
}
