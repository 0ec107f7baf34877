// Reading the REST API. Every error comes back as an ApiError carrying the problem document.

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail || problem?.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

export async function getJSON(path, { signal } = {}) {
  const response = await fetch(path, { headers: { Accept: "application/json" }, signal });
  if (!response.ok) {
    let problem = null;
    try {
      problem = await response.json();
    } catch {
      // Not a problem document; the status says enough.
    }
    throw new ApiError(response.status, problem);
  }
  return response.json();
}

export function query(params) {
  const entries = Object.entries(params).filter(([, v]) => v !== null && v !== undefined && v !== "");
  return entries.length ? `?${new URLSearchParams(entries)}` : "";
}

export const enc = encodeURIComponent;

export const api = {
  runs: (params) => getJSON(`/v1/runs${query(params)}`),
  run: (id) => getJSON(`/v1/runs/${enc(id)}`),
  metrics: (id, params, opts) => getJSON(`/v1/runs/${enc(id)}/metrics${query(params)}`, opts),
  episodes: (params, opts) => getJSON(`/v1/episodes${query(params)}`, opts),
  episode: (id, params) => getJSON(`/v1/episodes/${enc(id)}${query(params || {})}`),
  tokens: (id) => getJSON(`/v1/tokens/${enc(id)}`),
  eventsUrl: (id) => `/v1/episodes/${enc(id)}/events`,
};
