// A run's fault timeline: one row per failed replica of its roles, oldest first, refreshed
// live. Faults are append-only events, so each poll asks only for those after the newest
// seen (`cursor` = its id). A fault is recorded when detected and again once recovered, under
// one `fault_id`: the later event replaces the fault's row in place.

import { api } from "./api.js";
import { clear, errorBox, fmtSeconds, fmtTime, h, shortId } from "./dom.js";

const PAGE = 200;

function retriedCell(work) {
  if (!work.length) return h("td", { class: "num muted", "data-col": "retried" }, "0");
  // The count, with the list on hover (title) and on click (details).
  return h("td", { class: "num", "data-col": "retried" },
    h("details", { class: "retried", title: work.join("\n") },
      h("summary", {}, String(work.length)),
      h("ul", {}, work.map((w) => h("li", { class: "mono" }, w)))));
}

function recoveryCell(fault) {
  if (fault.recovery_seconds === null) {
    return h("td", { class: "nowrap", "data-col": "recovery" },
      h("span", { class: "badge st-bad", title: "not recovered when recorded" }, "down"));
  }
  return h("td", {
    class: "nowrap", "data-col": "recovery",
    title: fault.recovered_at ? `recovered ${fmtTime(fault.recovered_at)}` : null,
  }, `recovered after ${fmtSeconds(fault.recovery_seconds)}`);
}

// Events recorded without a fault id are faults of their own.
function faultKey(fault) {
  return fault.fault_id ?? `event-${fault.id}`;
}

function faultRow(fault) {
  const replica = fault.replica;
  return h("tr", { "data-fault": faultKey(fault), "data-role": fault.role },
    h("td", { class: "num", "data-col": "step" }, fault.step === null ? "–" : String(fault.step)),
    h("td", { "data-col": "role" }, h("span", { class: "role" }, fault.role)),
    h("td", { class: "mono", "data-col": "replica", title: replica || "no replica named" },
      replica ? shortId(replica) : "–"),
    h("td", { class: "ellipsis cause", "data-col": "cause", title: fault.cause || null },
      fault.cause || "–"),
    h("td", { class: "nowrap", "data-col": "detected" }, fmtTime(fault.detected_at)),
    recoveryCell(fault),
    retriedCell(fault.retried));
}

// The panel: {el, stop()}. `onFaults(faults)` gets every fault seen so far after each poll
// that found new ones (the run page marks their steps on the reward chart).
export function faultsPanel({ runId, pollMs, onFaults = () => {} }) {
  const columns = [["step", "num"], ["role"], ["replica"], ["cause"], ["detected"], ["recovery"], ["retried", "num"]];
  const body = h("tbody");
  const table = h("table", { class: "grid faults", hidden: true },
    h("thead", {}, h("tr", {}, columns.map(([c, cls]) => h("th", { class: cls }, c)))),
    body);
  const empty = h("p", { class: "muted faults-empty", "data-faults-empty": "" }, "No faults");
  const message = h("div");
  const el = h("section", { class: "faults-panel", "data-faults": "", "data-count": "0" },
    message, empty, table);
  const faults = [];
  const rows = new Map(); // fault key -> [index in `faults`, row]
  let after = null;
  let timer = null;
  let stopped = false;
  const controller = new AbortController();

  async function poll() {
    try {
      let found = false;
      for (;;) {
        const page = await api.faults(runId, { cursor: after, limit: PAGE }, { signal: controller.signal });
        if (stopped) return;
        for (const fault of page.items) {
          const key = faultKey(fault);
          const row = faultRow(fault);
          const seen = rows.get(key);
          if (seen) {
            faults[seen[0]] = fault;
            seen[1].replaceWith(row);
            seen[1] = row;
          } else {
            rows.set(key, [faults.length, row]);
            faults.push(fault);
            body.append(row);
          }
          after = fault.id;
          found = true;
        }
        if (!page.next_cursor) break;
      }
      clear(message);
      el.dataset.count = String(faults.length);
      table.hidden = faults.length === 0;
      empty.hidden = faults.length > 0;
      el.dataset.ready = "true";
      if (found) onFaults(faults);
    } catch (err) {
      if (err.name === "AbortError" || stopped) return;
      clear(message, errorBox(err));
    }
    if (!stopped) timer = setTimeout(poll, pollMs);
  }

  poll();
  return {
    el,
    stop() {
      stopped = true;
      clearTimeout(timer);
      controller.abort();
    },
  };
}
