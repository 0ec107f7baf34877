// The runs list and one run's page (charts updating live, then its episodes).

import { api } from "./api.js";
import { ChartPanel, MetricStore, groupMetrics, sparkline } from "./charts.js";
import { episodeBrowser } from "./episodes.js";
import { faultsPanel } from "./faults.js";
import { badge, clear, errorBox, fmtDuration, fmtNum, fmtTime, h, shortId } from "./dom.js";

const POLL_MS = 2000;
const MAX_POINTS = 400;

const LIST_REFRESH_MS = 5000;
const LIVE = new Set(["created", "running"]);

function stepsCell(run) {
  const done = run.steps_done;
  const total = run.steps_total;
  const text = total ? `${fmtNum(done)} / ${fmtNum(total)}` : fmtNum(done);
  const share = total ? Math.min(1, done / total) : null;
  return h("td", { class: "num nowrap", "data-col": "steps" }, text,
    share === null ? null : h("span", { class: "progress", title: `${Math.round(share * 100)}%` },
      h("span", { style: `width: ${(share * 100).toFixed(1)}%` })));
}

function rewardCell(run) {
  const trend = run.reward_trend || [];
  return h("td", { class: "num nowrap", "data-col": "reward" },
    h("span", { class: "reward-now" }, fmtNum(run.latest_reward)), " ",
    trend.length > 1 ? sparkline(trend) : null);
}

function errorsCell(run) {
  const n = run.infra_errors;
  return h("td", {
    class: `num ${n ? "err" : "muted"}`, "data-col": "errors",
    title: "episodes that ended in an infrastructure failure (sandbox, reward or engine error, or cancelled)",
  }, fmtNum(n));
}

export function runsPage(root) {
  const state = { cursors: [null], index: 0, timer: null, stopped: false };
  const body = h("tbody");
  const newer = h("button", { type: "button", class: "btn", disabled: true, onclick: () => go(-1) }, "← Newer");
  const older = h("button", { type: "button", class: "btn", disabled: true, onclick: () => go(1) }, "Older →");
  const message = h("div");
  const columns = [
    ["run"], ["id"], ["status"], ["steps", "num"], ["reward", "num"], ["errors", "num"],
    ["duration", "num"], ["created"],
  ];
  clear(root,
    h("div", { class: "page-head" }, h("h1", {}, "Runs"), h("span", { class: "spacer" }), newer, older),
    message,
    h("table", { class: "grid", "data-runs": "" },
      h("thead", {}, h("tr", {}, columns.map(([c, cls]) => h("th", { class: cls }, c)))),
      body),
    h("p", { class: "muted" }, "Episodes submitted over the API outside any run: ", h("a", { href: "#/episodes" }, "all episodes"), "."));

  async function load() {
    clearTimeout(state.timer);
    let live = false;
    try {
      const page = await api.runs({ cursor: state.cursors[state.index], limit: 50 });
      if (state.stopped) return;
      state.cursors[state.index + 1] = page.next_cursor;
      newer.disabled = state.index === 0;
      older.disabled = !page.next_cursor;
      clear(message);
      live = page.items.some((run) => LIVE.has(run.status));
      clear(body, page.items.length ? page.items.map((run) => {
        const link = `#/runs/${encodeURIComponent(run.id)}`;
        return h("tr", { "data-run": run.id, "data-status": run.status },
          h("td", {}, h("a", { href: link }, run.name || run.id)),
          h("td", { class: "mono", title: run.id }, shortId(run.id)),
          h("td", { title: run.status_reason || "" }, badge(run.status)),
          stepsCell(run),
          rewardCell(run),
          errorsCell(run),
          h("td", { class: "num nowrap", "data-col": "duration", title: run.finished_at ? `finished ${fmtTime(run.finished_at)}` : "still running" },
            fmtDuration(run.duration_seconds)),
          h("td", { class: "nowrap" }, fmtTime(run.created_at)));
      }) : h("tr", {}, h("td", { colspan: columns.length, class: "muted empty" }, "No runs yet.")));
      root.dataset.ready = "true";
    } catch (err) {
      if (state.stopped) return;
      clear(message, errorBox(err));
    }
    // Live runs move on: refresh their steps, reward and duration.
    if (!state.stopped && live) state.timer = setTimeout(load, LIST_REFRESH_MS);
  }

  function go(delta) {
    state.index = Math.max(0, state.index + delta);
    load();
  }

  load();
  return () => {
    state.stopped = true;
    clearTimeout(state.timer);
  };
}

export function runPage(root, runId, filters, onFilters) {
  const store = new MetricStore();
  const panels = new Map();
  const grid = h("div", { class: "charts", "data-charts": "" });
  const head = h("div", { class: "page-head" }, h("h1", {}, "Run ", h("span", { class: "mono" }, runId)));
  const message = h("div");
  // Why the run ended as it did (its error, the target that stopped it early), if said.
  const reason = h("p", { "data-status-reason": "" });
  const browser = episodeBrowser({ runId, filters, onFilters });
  const config = h("pre", { class: "config" });
  // Steps that saw a fault, marked on the reward chart(s).
  let faultSteps = [];
  const markFaults = () => {
    for (const panel of panels.values()) {
      if (panel.title.startsWith("Reward")) panel.setMarkers(faultSteps);
    }
  };
  const faults = faultsPanel({
    runId,
    pollMs: POLL_MS,
    onFaults: (list) => {
      faultSteps = [...new Set(list.map((f) => f.step).filter((s) => s !== null))].sort((a, b) => a - b);
      markFaults();
    },
  });
  clear(root,
    head, reason, message,
    h("details", { class: "config-box" }, h("summary", {}, "Resolved configuration"), config),
    h("h2", {}, "Metrics"), grid,
    h("h2", {}, "Faults"), faults.el,
    h("h2", {}, "Episodes"), browser.el);

  let stopped = false;
  let timer = null;
  const controller = new AbortController();

  api.run(runId).then((run) => {
    clear(head, h("h1", {}, run.name || "Run"), badge(run.status),
      h("span", { class: "mono muted" }, run.id),
      h("span", { class: "muted" }, `started ${fmtTime(run.created_at)}`));
    reason.className = run.status === "failed" ? "err" : "muted";
    reason.textContent = run.status_reason || "";
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
      const panel = new ChartPanel(g.title, g.names, store, g.unit);
      panels.set(g.title, panel);
      grid.append(panel.el);
    }
    markFaults();
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
    faults.stop();
    window.removeEventListener("resize", onResize);
    for (const panel of panels.values()) panel.destroy();
  };
}
