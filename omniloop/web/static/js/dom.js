// Small helpers for building the DOM safely: data only ever goes in as text, never as HTML.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export function clear(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

export const STATUS_CLASSES = {
  queued: "st-queued",
  created: "st-queued",
  running: "st-running",
  completed: "st-ok",
  failed: "st-bad",
  cancelled: "st-off",
};

export function badge(status) {
  return h("span", { class: `badge ${STATUS_CLASSES[status] || ""}`, "data-status": status }, status);
}

export function fmtNum(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (!Number.isFinite(value)) return String(value);
  if (Number.isInteger(value)) return value.toLocaleString("en-US");
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return value.toFixed(digits).replace(/\.?0+$/, "");
}

export function fmtTime(iso) {
  if (!iso) return "–";
  const date = new Date(iso);
  return date.toLocaleString("en-GB", { dateStyle: "short", timeStyle: "medium" });
}

export function fmtSeconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${(value * 1000).toFixed(0)} ms` : `${value.toFixed(2)} s`;
}

// 42 s, 3 m 05 s, 1 h 02 m, 2 d 03 h.
export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.floor(seconds);
  const pad = (n) => String(n).padStart(2, "0");
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} m ${pad(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${pad(Math.floor((s % 3600) / 60))} m`;
  return `${Math.floor(s / 86400)} d ${pad(Math.floor((s % 86400) / 3600))} h`;
}

export function shortId(id) {
  return id.length > 14 ? `${id.slice(0, 12)}…` : id;
}

// An error for the page. A 401 (the user cancelled the token prompt) offers the prompt again;
// app.js handles the button.
export function errorBox(err) {
  return h("div", { class: "error-box", role: "alert" }, err?.message || String(err),
    err?.status === 401 ? [" ", h("button", { type: "button", class: "btn", "data-action": "login" }, "Enter token")] : null);
}

export function taskSummary(task) {
  const prompt = task?.prompt;
  if (typeof prompt === "string") return prompt;
  if (Array.isArray(prompt)) {
    const last = [...prompt].reverse().find((m) => m.role === "user") || prompt[prompt.length - 1];
    return last?.content || "";
  }
  return "";
}
