// Reading the REST API. Every error comes back as an ApiError carrying the problem document.
//
// A server bound beyond loopback answers 401 to any /v1 request without its bearer token. The
// first 401 asks the user for the token (one prompt, however many requests are waiting on
// it); the token is kept in sessionStorage, so for this tab only, and sent as
// `Authorization: Bearer …` on every request, never in a URL. Event streams are read with
// fetch for the same reason: EventSource cannot send headers.

import { askToken } from "./auth.js";

const TOKEN_KEY = "omniloop.apiToken";

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail || problem?.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

export function storedToken() {
  try {
    return sessionStorage.getItem(TOKEN_KEY);
  } catch {
    return null; // Storage disabled: the user is asked again on the next page load.
  }
}

function storeToken(token) {
  try {
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    else sessionStorage.removeItem(TOKEN_KEY);
  } catch {
    // See storedToken.
  }
}

let pending = null; // the prompt on screen; every request that got a 401 waits for it
let declined = false; // the user cancelled: 401s fail until they ask to sign in (login())

function tokenFromUser(rejected) {
  if (!pending) {
    pending = askToken({ rejected }).then((token) => {
      pending = null;
      if (token) storeToken(token);
      else declined = true;
      return token;
    });
  }
  return pending;
}

// Ask for the token now (the "Enter token" button of an error): resolves to true if given.
export async function login() {
  declined = false;
  return Boolean(await tokenFromUser(Boolean(storedToken())));
}

async function problemOf(response) {
  try {
    return await response.json();
  } catch {
    return null; // Not a problem document; the status says enough.
  }
}

// fetch() with the token; on a 401, ask for it and try again until it is accepted or the
// user cancels (then the 401 comes back as an ApiError).
export async function apiFetch(path, { headers = {}, signal } = {}) {
  for (;;) {
    const token = storedToken();
    const sent = token ? { ...headers, Authorization: `Bearer ${token}` } : headers;
    const response = await fetch(path, { headers: sent, signal, credentials: "same-origin" });
    if (response.status !== 401) return response;
    if (storedToken() !== token) continue; // another request got a new token meanwhile
    if (declined || signal?.aborted) throw new ApiError(401, await problemOf(response));
    if (token) storeToken(null);
    const given = await tokenFromUser(Boolean(token));
    if (!given) throw new ApiError(401, await problemOf(response));
  }
}

export async function getJSON(path, { signal } = {}) {
  const response = await apiFetch(path, { headers: { Accept: "application/json" }, signal });
  if (!response.ok) throw new ApiError(response.status, await problemOf(response));
  return response.json();
}

export function query(params) {
  const entries = Object.entries(params).filter(([, v]) => v !== null && v !== undefined && v !== "");
  return entries.length ? `?${new URLSearchParams(entries)}` : "";
}

export const enc = encodeURIComponent;

// Parse a text/event-stream body, calling onEvent({id, event, data}) per event (data as text).
async function readEvents(body, onEvent) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split(/\r\n|\r|\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (line === "") {
        if (event.data.length) {
          onEvent({ id: event.id, event: event.event || "message", data: event.data.join("\n") });
        }
        event = { data: [] };
      } else if (!line.startsWith(":")) {
        const at = line.indexOf(":");
        const field = at < 0 ? line : line.slice(0, at);
        const text = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
        if (field === "data") event.data.push(text);
        else if (field === "event") event.event = text;
        else if (field === "id") event.id = text;
      }
    }
  }
}

const RETRY_MS = [500, 1000, 2000, 5000];

// Follow a Server-Sent Events stream with the token in a header. Like EventSource, it
// reconnects after a dropped connection, resuming with Last-Event-ID. `onEvent(event)` gets
// each event; `onState("open" | "reconnecting" | "failed", error)` the stream's state (a
// 4xx answer other than 401 fails it for good). Returns {close()}.
export function followEvents(path, { onEvent, onState = () => {} }) {
  const controller = new AbortController();
  let lastId = null;
  let closed = false;
  (async () => {
    for (let attempt = 0; !closed; attempt += 1) {
      try {
        const headers = { Accept: "text/event-stream" };
        if (lastId !== null) headers["Last-Event-ID"] = lastId;
        const response = await apiFetch(path, { headers, signal: controller.signal });
        if (!response.ok) throw new ApiError(response.status, await problemOf(response));
        attempt = 0;
        onState("open");
        await readEvents(response.body, (event) => {
          if (event.id) lastId = event.id;
          if (!closed) onEvent(event);
        });
      } catch (err) {
        if (closed || err.name === "AbortError") return;
        if (err instanceof ApiError && err.status < 500) {
          onState("failed", err);
          return;
        }
      }
      if (closed) return;
      onState("reconnecting");
      await new Promise((resolve) => setTimeout(resolve, RETRY_MS[Math.min(attempt, RETRY_MS.length - 1)]));
    }
  })();
  return {
    close() {
      closed = true;
      controller.abort();
    },
  };
}

// Open a JSON document of the API in a new tab: fetched with the token, shown from a blob
// (a plain link would be a request without it).
export async function openJSON(path) {
  const doc = await getJSON(path);
  const blob = new Blob([JSON.stringify(doc, null, 2)], { type: "application/json" });
  const url = URL.createObjectURL(blob);
  window.open(url, "_blank", "noopener");
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

// Fetch a binary document of the API (an episode's image, clip or video) with the token and
// give it as a blob: URL for an <img>, <audio> or <video> (whose src cannot send the header).
// The caller revokes the URL when it is no longer shown.
export async function getBlobURL(path, { signal } = {}) {
  const response = await apiFetch(path, { signal });
  if (!response.ok) throw new ApiError(response.status, await problemOf(response));
  return URL.createObjectURL(await response.blob());
}

export const api = {
  runs: (params) => getJSON(`/v1/runs${query(params)}`),
  run: (id) => getJSON(`/v1/runs/${enc(id)}`),
  metrics: (id, params, opts) => getJSON(`/v1/runs/${enc(id)}/metrics${query(params)}`, opts),
  faults: (id, params, opts) => getJSON(`/v1/runs/${enc(id)}/faults${query(params)}`, opts),
  episodes: (params, opts) => getJSON(`/v1/episodes${query(params)}`, opts),
  episode: (id, params) => getJSON(`/v1/episodes/${enc(id)}${query(params || {})}`),
  tokens: (id) => getJSON(`/v1/tokens/${enc(id)}`),
  media: (id, index, opts) => getBlobURL(`/v1/episodes/${enc(id)}/media/${index}`, opts),
  events: (id, handlers) => followEvents(`/v1/episodes/${enc(id)}/events`, handlers),
};
