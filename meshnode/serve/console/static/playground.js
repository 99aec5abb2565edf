// The playground on the host: a chat that streams from the node's own OpenAI API, with
// temperature and max tokens, and under each reply the speculation block of its final chunk.

import { AuthError, streamChat } from "./api.js";
import { fmtMs, fmtNum, fmtPct, h } from "./ui.js";

export class Playground {
  constructor(onAuthError) {
    this.messages = []; // the conversation sent with each request
    this.modelId = null;
    this.abort = null;
    this.onAuthError = onAuthError;
    this.form = document.getElementById("chat-form");
    this.log = document.getElementById("chat-log");
    this.input = document.getElementById("chat-input");
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        this.send();
      }
    });
    document.getElementById("chat-stop").addEventListener("click", () => this.abort?.abort());
    document.getElementById("chat-clear").addEventListener("click", () => this.clear());
  }

  setModel(modelId) {
    this.modelId = modelId;
    document.getElementById("chat-model").textContent = modelId || "–";
  }

  clear() {
    this.abort?.abort();
    this.messages = [];
    this.log.replaceChildren();
  }

  settings() {
    const temperature = Number(document.getElementById("chat-temperature").value);
    const maxTokens = Number(document.getElementById("chat-max-tokens").value);
    return { temperature, max_tokens: maxTokens > 0 ? Math.floor(maxTokens) : undefined };
  }

  async send() {
    const text = this.input.value.trim();
    if (!text || this.abort || !this.modelId) return;
    this.input.value = "";
    this.messages.push({ role: "user", content: text });
    this.log.append(h("div", { class: "msg user" }, text));
    const body = h("div", { class: "msg-text" });
    const meta = h("div", { class: "spec-block" }, "generating…");
    const reply = h("div", { class: "msg assistant", "data-state": "streaming" }, body, meta);
    this.log.append(reply);
    this.busy(true);
    let content = "";
    try {
      const result = await streamChat({ model: this.modelId, messages: this.messages, ...this.settings() },
        (piece) => {
          content += piece;
          body.textContent = content;
          this.log.scrollTop = this.log.scrollHeight;
        }, this.abort.signal);
      this.messages.push({ role: "assistant", content });
      meta.replaceChildren(...specBlock(result));
      reply.dataset.state = "done";
    } catch (err) {
      this.messages.pop(); // the turn failed: do not send it again with the next one
      reply.dataset.state = "error";
      const aborted = err.name === "AbortError";
      meta.replaceChildren(h("span", { class: aborted ? "muted" : "error" },
        aborted ? "stopped" : `failed: ${err.message}`));
      if (err instanceof AuthError) this.onAuthError(err.message);
    } finally {
      this.busy(false);
    }
  }

  busy(on) {
    this.abort = on ? new AbortController() : null;
    document.getElementById("chat-send").disabled = on;
    document.getElementById("chat-stop").disabled = !on;
  }
}

/** The reply's speculation and timing telemetry, as a few labelled facts. */
export function specBlock(result) {
  const tel = result.telemetry;
  if (!tel) return [h("span", { class: "muted" }, `finished (${result.finish || "?"}), no telemetry`)];
  const spec = tel.speculation || {};
  const timings = tel.timings || {};
  const fact = (label, value) => h("span", { class: "fact" }, h("b", {}, label), ` ${value}`);
  const strategy = spec.strategy || "off";
  const idle = strategy !== "off" && !spec.windows ? " (no drafts in this reply)" : "";
  const facts = [fact("speculation", strategy + idle)];
  if (spec.windows) {
    facts.push(fact("verify passes", spec.windows),
      fact("accepted", `${spec.accepted}/${spec.proposed} (${fmtPct(spec.accept_rate)})`),
      fact("tokens/verify", fmtNum(spec.tokens_per_verify, 2)));
  }
  facts.push(fact("first token", fmtMs(timings.time_to_first_token_s)));
  const tokens = result.usage?.completion_tokens;
  if (tokens > 1 && result.firstAt !== null && result.endAt > result.firstAt) {
    // As this browser saw it: tokens after the first over the time after the first text.
    const rate = (tokens - 1) / ((result.endAt - result.firstAt) / 1000);
    facts.push(fact("tokens", tokens), fact("speed", `${fmtNum(rate, 1)} tok/s`));
  }
  facts.push(fact("passes", timings.passes ?? "–"), fact("finish", result.finish || "?"));
  return facts;
}
