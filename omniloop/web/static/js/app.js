// Hash routing: #/ runs, #/runs/ID run page, #/episodes browser, #/episodes/ID trajectory.

import { runPage, runsPage } from "./runs.js";
import { episodeBrowser } from "./episodes.js";
import { trajectoryPage } from "./trajectory.js";
import { clear, h } from "./dom.js";
import { login } from "./api.js";

const root = document.getElementById("app");
let teardown = () => {};

function parse() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, search = ""] = raw.split("?");
  const params = new URLSearchParams(search);
  const filters = {
    status: params.get("status"),
    stop_reason: params.get("stop_reason"),
    error_type: params.get("error_type"),
  };
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), filters, path };
}

function withFilters(path, filters) {
  const params = new URLSearchParams(Object.entries(filters).filter(([, v]) => v));
  const search = params.toString();
  return `#${path}${search ? `?${search}` : ""}`;
}

function route() {
  teardown();
  teardown = () => {};
  delete root.dataset.ready;
  const { parts, filters, path } = parse();
  const onFilters = (next) => { location.hash = withFilters(path, next); };
  for (const a of document.querySelectorAll("[data-nav]")) {
    a.classList.toggle("active", a.dataset.nav === (parts[0] === "episodes" ? "episodes" : "runs"));
  }
  if (parts.length === 0 || (parts[0] === "runs" && parts.length === 1)) {
    document.title = "Runs · omniloop";
    teardown = runsPage(root);
  } else if (parts[0] === "runs") {
    const runId = parts.slice(1).join("/");
    document.title = `Run ${runId} · omniloop`;
    teardown = runPage(root, runId, filters, onFilters);
  } else if (parts[0] === "episodes" && parts.length === 1) {
    document.title = "Episodes · omniloop";
    const browser = episodeBrowser({ filters, onFilters });
    clear(root, h("div", { class: "page-head" }, h("h1", {}, "Episodes")), browser.el);
    teardown = () => browser.stop();
  } else if (parts[0] === "episodes") {
    const episodeId = parts.slice(1).join("/");
    document.title = `Episode ${episodeId} · omniloop`;
    teardown = trajectoryPage(root, episodeId);
  } else {
    clear(root, h("p", {}, "No such page. ", h("a", { href: "#/" }, "Back to runs")));
  }
  window.scrollTo(0, 0);
}

// "Enter token" on an error (after the prompt was cancelled): ask again, then reload the page.
document.addEventListener("click", async (event) => {
  if (!event.target.closest?.('[data-action="login"]')) return;
  if (await login()) route();
});

window.addEventListener("hashchange", route);
route();
