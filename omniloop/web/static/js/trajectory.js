// The trajectory viewer: an episode's summary, reward breakdown, and its token stream split
// into the prompt and each turn, with the loss mask overlaid, logprobs on hover, the turn's
// tool calls and their results, and media inline: each image, clip or video stands where its
// placeholder tokens are, in the prompt or the turn whose observation holds it.

import { api, openJSON } from "./api.js";
import { badge, clear, errorBox, fmtNum, fmtSeconds, fmtTime, h, taskSummary } from "./dom.js";

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const LOW_LOGPROB = -2.5;

export function trajectoryPage(root, episodeId) {
  const head = h("div", { class: "page-head" }, h("h1", {}, "Episode ", h("span", { class: "mono" }, episodeId)));
  const live = h("div", { class: "live muted" });
  const body = h("div", { class: "trajectory" });
  clear(root, head, live, body);
  const media = mediaLoader(episodeId);
  let source = null;
  let stopped = false;

  async function show() {
    try {
      const episode = await api.episode(episodeId);
      if (stopped) return;
      renderHead(head, episode);
      let tokens = null;
      let tokenError = null;
      if (episode.trajectory) {
        try {
          tokens = (await api.tokens(episodeId)).tokens;
        } catch (err) {
          tokenError = err;
        }
      }
      if (stopped) return;
      clear(body, renderEpisode(episode, tokens, tokenError, media));
      root.dataset.ready = "true";
      root.dataset.status = episode.status;
      if (!TERMINAL.has(episode.status)) follow();
    } catch (err) {
      clear(body, errorBox(err));
    }
  }

  // Follow the episode's event stream until its terminal status, then show it in full.
  function follow() {
    if (source) return;
    let turns = 0;
    const onStatus = (event) => {
      const payload = JSON.parse(event.data);
      const status = payload.data?.status;
      if (status) {
        const current = head.querySelector(".badge");
        current?.replaceWith(badge(status));
        root.dataset.status = status;
      }
      clear(live, `live: ${status || "…"}${turns ? ` · ${turns} turn(s) so far` : ""}`);
      if (TERMINAL.has(status)) {
        source.close();
        source = null;
        clear(live);
        show();
      }
    };
    source = api.events(episodeId, {
      onEvent: (event) => {
        if (event.event === "status") onStatus(event);
        else if (event.event === "turn") {
          turns += 1;
          clear(live, `live: running · ${turns} turn(s) so far`);
        }
      },
      onState: (state, err) => {
        // A dropped stream is resumed with Last-Event-ID; say so meanwhile.
        if (state === "reconnecting") clear(live, "live: reconnecting…");
        else if (state === "failed") clear(live, errorBox(err));
      },
    });
  }

  show();
  return () => {
    stopped = true;
    source?.close();
    media.close();
  };
}

// The episode's media: each item fetched once with the token and shown from a blob: URL (an
// <img src> cannot send the header). Leaving the page aborts the fetches still running and
// revokes the URLs.
function mediaLoader(episodeId) {
  const controller = new AbortController();
  const urls = new Map(); // index in trajectory.multimodal → Promise of its blob: URL
  return {
    url(index) {
      if (!urls.has(index)) urls.set(index, api.media(episodeId, index, { signal: controller.signal }));
      return urls.get(index);
    },
    close() {
      controller.abort();
      for (const pending of urls.values()) pending.then((url) => URL.revokeObjectURL(url), () => {});
      urls.clear();
    },
  };
}

function renderHead(head, ep) {
  clear(head,
    h("h1", {}, "Episode"), badge(ep.status),
    h("span", { class: "mono muted" }, ep.id),
    ep.run_id ? h("a", { href: `#/runs/${encodeURIComponent(ep.run_id)}` }, `run ${ep.run_id}`) : null,
    // Fetched with the token and shown from a blob: a plain link would go without it.
    h("a", { href: ep.href, class: "muted", onclick: (e) => { e.preventDefault(); openJSON(ep.href).catch((err) => head.append(errorBox(err))); } }, "JSON"));
}

function renderEpisode(ep, tokens, tokenError, media) {
  const traj = ep.trajectory;
  const facts = [
    ["agent", ep.agent],
    ["task", ep.task_id || "–"],
    ["stop reason", ep.stop_reason || "–"],
    ["turns", fmtNum(ep.num_turns)],
    ["response tokens", fmtNum(ep.response_length)],
    ["created", fmtTime(ep.created_at)],
    ["finished", fmtTime(ep.finished_at)],
    ...Object.entries(ep.timings || {}).map(([k, v]) => [`${k} time`, fmtSeconds(v)]),
  ];
  return [
    h("div", { class: "cards" },
      h("section", { class: "card" }, h("h2", {}, "Summary"),
        h("dl", { class: "facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
        ep.error ? h("div", { class: "error-box", "data-error": ep.error.type },
          h("strong", {}, ep.error.type), ": ", ep.error.message || "") : null),
      h("section", { class: "card" }, h("h2", {}, "Reward"), rewardBreakdown(ep)),
      h("section", { class: "card wide" }, h("h2", {}, "Task"),
        h("pre", { class: "prompt" }, taskSummary(ep.task)),
        ep.task?.answer !== undefined && ep.task?.answer !== null
          ? h("p", {}, h("span", { class: "muted" }, "answer: "), JSON.stringify(ep.task.answer)) : null)),
    traj ? tokenView(traj, tokens, tokenError, media)
      : h("p", { class: "muted", "data-no-trajectory": "" },
        TERMINAL.has(ep.status) ? "This episode has no trajectory." : "The trajectory appears when the episode finishes."),
  ];
}

function rewardBreakdown(ep) {
  const components = Object.entries(ep.reward_info || {});
  const total = h("p", { class: "reward-total" }, h("span", { class: "muted" }, "total "),
    h("strong", { "data-reward": ep.reward ?? "" }, fmtNum(ep.reward)));
  if (!components.length) return [total, h("p", { class: "muted" }, "No components.")];
  const scale = Math.max(1, ...components.map(([, v]) => Math.abs(v)));
  return [total, h("table", { class: "reward-table" }, components.map(([name, value]) =>
    h("tr", { "data-component": name },
      h("td", {}, name),
      h("td", { class: "num" }, fmtNum(value)),
      h("td", { class: "bar-cell" }, h("span", {
        class: `bar ${value < 0 ? "neg" : ""}`,
        style: `width:${(Math.abs(value) / scale) * 100}%`,
      })))))];
}

// One span per token; class `s` sampled (mask 1), `p` prompt, `o` observation.
function tokenSpans(tokens, start, end, promptLength) {
  const frag = document.createDocumentFragment();
  for (let i = start; i < end; i++) {
    const t = tokens[i];
    const kind = t.mask ? "s" : i < promptLength ? "p" : "o";
    let title = `#${i} id ${t.id}`;
    let cls = `tok ${kind}`;
    // Whitespace and partial-character tokens get a visible marker (CSS, not text).
    if (t.text.includes("\n")) cls += " nl";
    else if (!t.text.trim()) cls += " blank";
    if (t.mask) {
      title += ` · logprob ${t.logprob.toFixed(4)} · p ${Math.exp(t.logprob).toFixed(3)} · weights v${t.weight_version}`;
      if (t.logprob < LOW_LOGPROB) cls += " low";
    }
    const span = document.createElement("span");
    span.className = cls;
    span.title = title;
    span.dataset.i = i;
    span.textContent = t.text;
    frag.append(span);
  }
  return frag;
}

// Without a tokenizer the ids themselves are shown, with the same overlay.
function idTokens(traj) {
  return traj.input_ids.map((id, i) => ({
    id, text: `${id} `, mask: traj.loss_mask[i],
    logprob: traj.loss_mask[i] ? traj.rollout_logprobs[i] : null,
    weight_version: traj.weight_version[i],
  }));
}

function toolCall(call) {
  const ok = !call.error;
  return h("div", { class: `tool-call ${ok ? "ok" : "failed"}`, "data-tool": call.name || "" },
    h("div", { class: "tool-head" },
      h("strong", {}, call.name || "(unparsed call)"),
      h("span", { class: "muted" }, ` · ${fmtSeconds(call.duration)}`),
      call.error ? h("span", { class: "err" }, ` · ${call.error}`) : null),
    call.arguments ? h("pre", { class: "tool-args" }, JSON.stringify(call.arguments, null, 2))
      : h("pre", { class: "tool-args" }, call.raw),
    h("div", { class: "muted small" }, "result"),
    h("pre", { class: "tool-output", "data-tool-output": "" }, call.output));
}

function fmtBytes(n) {
  if (!Number.isFinite(n)) return "–";
  if (n < 1024) return `${n} B`;
  return n < 1024 * 1024 ? `${(n / 1024).toFixed(1)} kB` : `${(n / 1024 / 1024).toFixed(1)} MB`;
}

const MEDIA_TAGS = { image: "img", audio: "audio", video: "video" };

// One media item where its placeholder tokens are: an <img>, <audio controls> or <video
// controls> with a caption, standing for the whole placeholder run.
function mediaFigure(item, media) {
  const tag = MEDIA_TAGS[item.kind];
  const el = !tag ? h("span", { class: "muted" }, item.kind || "media")
    : tag === "img" ? h("img", { alt: `image ${item.index}` })
      : h(tag, { controls: true, preload: "metadata" });
  const last = item.offset + item.tokens - 1;
  const figure = h("figure", {
    class: "media",
    "data-media": item.kind || "",
    "data-index": item.index,
    "data-offset": item.offset,
    "data-tokens": item.tokens,
    "data-format": item.format || "",
    "data-state": "loading",
    title: `tokens ${item.offset}–${last} · ${item.format} · ${fmtBytes(item.size)} · sha256 ${item.sha256}`,
  }, el, h("figcaption", { class: "muted small" }, `${item.kind} · ${fmtNum(item.tokens)} tokens`));
  if (!tag) return figure;
  el.addEventListener(tag === "img" ? "load" : "loadedmetadata", () => { figure.dataset.state = "loaded"; });
  el.addEventListener("error", () => { figure.dataset.state = "failed"; });
  media.url(item.index).then((url) => { el.src = url; }, (err) => {
    if (err.name === "AbortError") return;
    figure.dataset.state = "failed";
    el.replaceWith(errorBox(err));
  });
  return figure;
}

// Tokens start..end-1 as spans, except media placeholder runs: each run is one figure, in the
// block that holds its first placeholder (a run that goes on past `end` is not shown again in
// the next block). `placed` is sorted by offset.
function streamSpans(list, start, end, promptLength, placed, media) {
  const frag = document.createDocumentFragment();
  let i = start;
  for (const item of placed) {
    const stop = item.offset + item.tokens;
    if (stop <= i) continue;
    if (item.offset >= end) break;
    if (item.offset > i) frag.append(tokenSpans(list, i, item.offset, promptLength));
    if (item.offset >= start) {
      frag.append(mediaFigure(item, media));
      item.shown = true;
    }
    i = Math.min(stop, end);
  }
  if (i < end) frag.append(tokenSpans(list, i, end, promptLength));
  return frag;
}

function tokenView(traj, tokens, tokenError, media) {
  const list = tokens || idTokens(traj);
  // Media placements (index = position in multimodal, what the media route takes).
  const placed = (traj.multimodal || [])
    .map((item, index) => ({ ...item, index }))
    .filter((item) => Number.isInteger(item.offset) && Number.isInteger(item.tokens) && item.tokens > 0)
    .sort((a, b) => a.offset - b.offset);
  const placeholders = placed.reduce((a, item) => a + item.tokens, 0);
  const meta = traj.meta || {};
  const turns = meta.turns || [];
  const calls = meta.tool_calls || [];
  const sampled = traj.loss_mask.reduce((a, m) => a + m, 0);
  const blocks = [];
  const block = (title, start, end, extra = []) => h("section", { class: "turn" },
    h("h3", {}, title, h("span", { class: "muted small" }, ` tokens ${start}–${end - 1}`)),
    h("div", { class: "tokens" }, streamSpans(list, start, end, traj.prompt_length, placed, media)),
    extra);
  blocks.push(block("Prompt", 0, Math.min(traj.prompt_length, list.length)));
  let covered = traj.prompt_length;
  turns.forEach((turn, index) => {
    // Context between turns (a prefill, template glue) is shown with the turn that follows it.
    const start = covered;
    const end = Math.max(start, Math.min(turn.start + turn.num_sampled + turn.num_observation, list.length));
    const title = `Turn ${index + 1} · ${turn.finish_reason} · weights v${turn.weight_version} · ${fmtSeconds(turn.generate_seconds)}`;
    const turnCalls = calls.filter((c) => c.turn === index);
    blocks.push(block(title, start, end, turnCalls.length
      ? h("div", { class: "tool-calls" }, turnCalls.map(toolCall)) : []));
    covered = Math.max(covered, end);
  });
  if (covered < list.length) blocks.push(block("Other tokens", covered, list.length));
  const orphanCalls = calls.filter((c) => c.turn >= turns.length);
  if (orphanCalls.length) blocks.push(h("section", { class: "turn" }, h("h3", {}, "Tool calls"), orphanCalls.map(toolCall)));
  // Items whose placeholders are not in the token stream shown (should not happen) still show.
  const unplaced = placed.filter((item) => !item.shown);
  if (unplaced.length) {
    blocks.push(h("section", { class: "turn" }, h("h3", {}, "Media outside the tokens"),
      h("div", { class: "media-list" }, unplaced.map((item) => mediaFigure(item, media)))));
  }
  const mediaCount = placed.length
    ? ` · ${placed.length} media (${fmtNum(placeholders)} placeholder tokens)` : "";
  return h("section", { class: "token-view", "data-trajectory": traj.id },
    h("div", { class: "page-head" }, h("h2", {}, "Trajectory"),
      h("span", { class: "legend" },
        h("span", { class: "tok s" }, "sampled (trained)"), " ",
        h("span", { class: "tok o" }, "observation"), " ",
        h("span", { class: "tok p" }, "prompt"), " ",
        h("span", { class: "tok s low" }, `logprob < ${LOW_LOGPROB}`)),
      h("span", { class: "muted small" },
        `${list.length} tokens · ${sampled} sampled · ${turns.length} turns · ${calls.length} tool calls${mediaCount} · hover a token for its logprob`)),
    tokenError ? h("div", { class: "error-box" }, `Token text unavailable (${tokenError.message}); showing ids.`) : null,
    meta.error ? h("div", { class: "error-box" }, `${meta.error.type}: ${meta.error.message}`) : null,
    blocks);
}
