// The episode browser: filters, one keyset-paginated page at a time, refreshed while live.

import { api } from "./api.js";
import { badge, clear, errorBox, fmtNum, fmtTime, h, shortId } from "./dom.js";

const STATUSES = ["queued", "running", "completed", "failed", "cancelled"];
const STOP_REASONS = [
  "stop", "length", "max_turns", "context_limit", "tool_timeout",
  "sandbox_error", "reward_error", "cancelled", "engine_error", "media_error",
];
const NUMERIC = new Set(["reward", "turns", "length"]); // right-aligned, like their cells
const PAGE_SIZE = 50;
const REFRESH_MS = 2000;

function select(name, label, options, value, onChange) {
  return h("label", { class: "filter" }, label,
    h("select", { name, onchange: (e) => onChange(e.target.value) },
      h("option", { value: "" }, "any"),
      options.map((o) => h("option", { value: o, selected: o === value }, o))));
}

// `filters`: {status, stop_reason, error_type}; `onFilters(next)` is called when the user
// changes one (the caller puts them in the URL). Returns {el, stop()}.
export function episodeBrowser({ runId = null, filters = {}, onFilters = () => {} }) {
  const state = { cursors: [null], index: 0, timer: null, stopped: false, controller: null };
  const table = h("tbody");
  const status = h("span", { class: "muted page-info" });
  const newer = h("button", { type: "button", class: "btn", "data-page": "newer", disabled: true,
    onclick: () => go(state.index - 1) }, "← Newer");
  const older = h("button", { type: "button", class: "btn", "data-page": "older", disabled: true,
    onclick: () => go(state.index + 1) }, "Older →");
  const errorTypes = h("datalist", { id: `error-types-${Math.random().toString(36).slice(2)}` });
  const setFilter = (key, value) => onFilters({ ...filters, [key]: value || null });
  const errorInput = h("input", {
    name: "error_type", type: "search", placeholder: "e.g. SandboxError", value: filters.error_type || "",
    list: errorTypes.id, onchange: (e) => setFilter("error_type", e.target.value.trim()),
  });
  const message = h("div");
  const el = h("section", { class: "episodes", "data-episodes": runId || "all" },
    h("div", { class: "filters" },
      select("status", "status", STATUSES, filters.status, (v) => setFilter("status", v)),
      select("stop_reason", "stop reason", STOP_REASONS, filters.stop_reason, (v) => setFilter("stop_reason", v)),
      h("label", { class: "filter" }, "error type", errorInput, errorTypes),
      h("span", { class: "spacer" }), status, newer, older),
    message,
    h("table", { class: "grid" },
      h("thead", {}, h("tr", {},
        ["episode", "status", "task", "agent", "reward", "stop reason", "error", "turns", "length", "created"]
          .map((c) => h("th", { class: NUMERIC.has(c) ? "num" : null }, c)))),
      table));

  function row(ep) {
    const link = `#/episodes/${encodeURIComponent(ep.id)}`;
    const task = ep.task_id || "";
    return h("tr", { "data-episode": ep.id, "data-status": ep.status },
      h("td", { class: "mono" }, h("a", { href: link, title: ep.id }, shortId(ep.id))),
      h("td", {}, badge(ep.status)),
      h("td", { class: "ellipsis", title: task }, task),
      h("td", {}, ep.agent),
      h("td", { class: "num" }, fmtNum(ep.reward)),
      h("td", {}, ep.stop_reason || "–"),
      h("td", { title: ep.error?.message || "" }, ep.error ? h("span", { class: "err" }, ep.error.type) : "–"),
      h("td", { class: "num" }, fmtNum(ep.num_turns)),
      h("td", { class: "num" }, fmtNum(ep.response_length)),
      h("td", { class: "nowrap" }, fmtTime(ep.created_at)));
  }

  async function load({ quiet = false } = {}) {
    state.controller?.abort();
    const controller = new AbortController();
    state.controller = controller;
    clearTimeout(state.timer);
    try {
      const page = await api.episodes({
        run_id: runId, status: filters.status, stop_reason: filters.stop_reason,
        error_type: filters.error_type, cursor: state.cursors[state.index], limit: PAGE_SIZE,
      }, { signal: controller.signal });
      if (state.stopped) return;
      clear(message);
      clear(table, page.items.length ? page.items.map(row)
        : h("tr", {}, h("td", { colspan: 10, class: "muted empty" }, "No episodes match.")));
      state.cursors[state.index + 1] = page.next_cursor;
      newer.disabled = state.index === 0;
      older.disabled = !page.next_cursor;
      status.textContent = `page ${state.index + 1}`;
      const types = new Set(page.items.map((e) => e.error?.type).filter(Boolean));
      clear(errorTypes, [...types].map((t) => h("option", { value: t })));
      el.dataset.ready = "true";
      if (!quiet) performance.mark("episodes-rendered");
    } catch (err) {
      if (err.name === "AbortError" || state.stopped) return;
      clear(message, errorBox(err));
    }
    // Refresh the newest page (new and running episodes), or a page still in flight.
    const live = state.index === 0 || table.querySelector('[data-status="queued"],[data-status="running"]');
    if (!state.stopped && live) {
      state.timer = setTimeout(() => load({ quiet: true }), REFRESH_MS);
    }
  }

  function go(index) {
    if (index < 0 || index >= state.cursors.length) return;
    state.index = index;
    load();
  }

  load();
  return {
    el,
    stop() {
      state.stopped = true;
      clearTimeout(state.timer);
      state.controller?.abort();
    },
  };
}
