// One reply as it streams: the chat.completion chunks of a turn go to its reasoning block, its text and its
// tool-call cards, rendered at most once a frame; at the end its stats line is written.
import { ApiError } from "./api.js";
import { markCut, writeStats } from "./message_view.js";
import { Reasoning } from "./reasoning.js";
import { StreamRenderer } from "./stream_render.js";
import { ToolCalls } from "./tool_calls.js";

export class ReplyStream {
  // `node`: the reply's (empty) message element; `started`: performance.now() when the turn was sent;
  // `onStatus(text)`: the status line; `onRender()`: after each frame's rendering (to keep the end in view).
  constructor(node, { started, onStatus, onRender }) {
    this.node = node;
    this.started = started;
    this.onStatus = onStatus;
    this.onRender = onRender;
    this.text = "";
    this.usage = null;
    this.finishReason = null;
    this.firstToken = null;
    this.frame = null;
    this.reasoning = new Reasoning(node);
    this.toolCalls = node.toolCalls = new ToolCalls(node);
    this.content = node.querySelector(".content");
    this.renderer = new StreamRenderer(this.content);
    this.content.setAttribute("aria-live", "polite");
    this.content.setAttribute("aria-busy", "true"); // screen readers read the reply once, when it is complete
    node.classList.add("streaming");
  }

  // One chunk of the stream (an error chunk throws: the reply broke off).
  handle(chunk) {
    if (chunk.error) throw new ApiError(0, `The reply broke off: ${chunk.error.message || "server error"}`);
    if (chunk.usage) this.usage = chunk.usage;
    const choice = chunk.choices && chunk.choices[0];
    if (choice && choice.finish_reason) this.finishReason = choice.finish_reason;
    const delta = choice && choice.delta;
    const calls = delta && delta.tool_calls && delta.tool_calls.length ? delta.tool_calls : null;
    if (!delta || !(delta.content || delta.reasoning_content || calls)) return;
    if (this.firstToken === null) {
      this.firstToken = performance.now(); // the first token of any kind: thinking, answer or tool call
      this.onStatus(delta.reasoning_content ? "The model is thinking…" : "The model is replying…");
    }
    if (delta.reasoning_content) this.reasoning.append(delta.reasoning_content);
    if ((delta.content || calls) && this.reasoning.end()) this.onStatus("The model is replying…");
    if (delta.content) this.text += delta.content;
    if (calls) this.toolCalls.apply(calls);
    this.scheduleRender();
  }

  // Renders what arrived at most once a frame (web/stream_render.js: only the last markdown block again).
  scheduleRender() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = null;
      this.reasoning.render();
      this.renderer.update(this.text);
      this.onRender();
    });
  }

  // The stream ended (finished, stopped, or broken off): the whole reply, then its stats.
  finish(stopped) {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.reasoning.end();
    this.toolCalls.finish();
    this.node.dataset.text = this.text;
    this.renderer.finish(this.text);
    this.content.setAttribute("aria-busy", "false");
    this.node.classList.remove("streaming");
    const usage = this.usage || {};
    const completion = usage.completion_tokens;
    const decodeS = this.firstToken !== null ? (performance.now() - this.firstToken) / 1000 : 0;
    const cut = !stopped && this.finishReason === "length";
    writeStats(this.node, {
      ttftMs: this.firstToken !== null ? this.firstToken - this.started : null,
      tokensPerS: completion > 1 && decodeS > 0 ? (completion - 1) / decodeS : null,
      promptTokens: usage.prompt_tokens, completionTokens: completion,
      cachedTokens: usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : undefined,
      stopped, cut,
    });
    markCut(this.node, cut);
  }
}
