// The token prompt: a modal dialog asking for the server's API token (OMNILOOP_API_TOKEN).
// It never shows the token (a password field) and never puts it anywhere but the caller.

import { h } from "./dom.js";

// Resolves to the token the user typed, or null when they cancel. `rejected`: the last token
// was refused, so say so.
export function askToken({ rejected = false } = {}) {
  return new Promise((resolve) => {
    const input = h("input", {
      type: "password", name: "token", required: true, autocomplete: "off", spellcheck: "false",
      "aria-label": "API token",
    });
    const form = h("form", { method: "dialog" },
      h("h2", {}, "API token"),
      h("p", {}, "This server needs its API token (", h("code", {}, "OMNILOOP_API_TOKEN"),
        ") to show runs and episodes. It is kept for this tab only."),
      rejected ? h("p", { class: "err", "data-token-rejected": "" }, "That token was not accepted.") : null,
      input,
      h("div", { class: "dialog-buttons" },
        // Not a submit button: Enter in the field submits with the form's first one.
        h("button", { type: "button", class: "btn", onclick: () => dialog.close("cancel") }, "Cancel"),
        h("button", { type: "submit", value: "ok", class: "btn primary" }, "Continue")));
    const dialog = h("dialog", { class: "token-dialog", "data-token-prompt": "" }, form);
    dialog.addEventListener("close", () => {
      const token = dialog.returnValue === "ok" ? input.value.trim() : "";
      dialog.remove();
      resolve(token || null);
    });
    document.body.append(dialog);
    dialog.showModal();
    input.focus();
  });
}
