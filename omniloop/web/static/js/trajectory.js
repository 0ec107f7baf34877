// The trajectory viewer: an episode's summary, reward breakdown, and its token stream split
// into the prompt and each turn, with the loss mask overlaid, logprobs on hover, the turn's
// tool calls and their results, and media inline.

import { api, openJSON } from "./api.js";
import { badge, clear, errorBox, fmtNum, fmtSeconds, fmtTime, h, taskSummary } from "./dom.js";

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const LOW_LOGPROB = -2.5;

export function trajectoryPage(root, episodeId) {
  const head = h("div", { class: "page-head" }, h("h1", {}, "Episode ", h("span", { class: "mono" }, episodeId)));
  const live = h("div", { class: "live muted" });
  const body = h("div", { class: "trajectory" });
  clear(root, head, live, body);
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
      clear(body, renderEpisode(episode, tokens, tokenError));
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

function renderEpisode(ep, tokens, tokenError) {
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
    traj ? tokenView(traj, tokens, tokenError)
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

function mediaItem(item) {
  const kind = item.type || item.modality || item.kind || "";
  const raw = item.data_url || item.url || item.src ||
    (item.data && item.mime ? `data:${item.mime};base64,${item.data}` : null);
  const safe = typeof raw === "string" && /^(data:(image|audio|video)\/|https?:|\/)/i.test(raw) ? raw : null;
  const where = ["position", "token_index", "offset"].filter((k) => k in item).map((k) => `${k} ${item[k]}`).join(", ");
  let media;
  if (!safe) media = h("pre", { class: "small" }, JSON.stringify(item, null, 2));
  else if (/image/.test(kind) || /^data:image\//i.test(safe)) media = h("img", { src: safe, alt: item.name || "image", loading: "lazy" });
  else if (/audio/.test(kind) || /^data:audio\//i.test(safe)) media = h("audio", { src: safe, controls: true, preload: "metadata" });
  else if (/video/.test(kind) || /^data:video\//i.test(safe)) media = h("video", { src: safe, controls: true, preload: "metadata" });
  else media = h("a", { href: safe, target: "_blank", rel: "noopener" }, safe);
  return h("figure", { class: "media", "data-media": kind }, media, h("figcaption", { class: "muted small" }, [kind, where].filter(Boolean).join(" · ")));
}

function tokenView(traj, tokens, tokenError) {
  const list = tokens || idTokens(traj);
  const meta = traj.meta || {};
  const turns = meta.turns || [];
  const calls = meta.tool_calls || [];
  const sampled = traj.loss_mask.reduce((a, m) => a + m, 0);
  const blocks = [];
  const block = (title, start, end, extra = []) => h("section", { class: "turn" },
    h("h3", {}, title, h("span", { class: "muted small" }, ` tokens ${start}–${end - 1}`)),
    h("div", { class: "tokens" }, tokenSpans(list, start, end, traj.prompt_length)),
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
  const media = traj.multimodal || [];
  return h("section", { class: "token-view", "data-trajectory": traj.id },
    h("div", { class: "page-head" }, h("h2", {}, "Trajectory"),
      h("span", { class: "legend" },
        h("span", { class: "tok s" }, "sampled (trained)"), " ",
        h("span", { class: "tok o" }, "observation"), " ",
        h("span", { class: "tok p" }, "prompt"), " ",
        h("span", { class: "tok s low" }, `logprob < ${LOW_LOGPROB}`)),
      h("span", { class: "muted small" },
        `${list.length} tokens · ${sampled} sampled · ${turns.length} turns · ${calls.length} tool calls · hover a token for its logprob`)),
    tokenError ? h("div", { class: "error-box" }, `Token text unavailable (${tokenError.message}); showing ids.`) : null,
    meta.error ? h("div", { class: "error-box" }, `${meta.error.type}: ${meta.error.message}`) : null,
    media.length ? h("section", { class: "turn" }, h("h3", {}, "Media"), h("div", { class: "media-list" }, media.map(mediaItem))) : null,
    blocks);
}
