// A message's element in the conversation: its role label, its rendered text, its action buttons (wired to the
// app's handlers), and for a reply its reasoning, tool-call cards and stats line.
import { copyText, renderInto } from "./markdown.js";
import { Reasoning } from "./reasoning.js";
import { ToolCalls } from "./tool_calls.js";

const ROLE_LABELS = { user: "You said:", assistant: "The model said:", tool: "A tool returned:" };

// `actions`: { regenerate(event), regenerateAlternatives(), continueReply(), editMessage(node) }.
export class MessageView {
  constructor(actions) {
    this.actions = actions;
    this.template = document.getElementById("message-template");
  }

  // A stored conversation's elements: a tool-role message goes on the card of its call in the reply before it
  // (or stands alone when that reply has no call with its id).
  nodes(messages) {
    const nodes = [];
    for (const m of messages) {
      const last = nodes[nodes.length - 1];
      if (m.role === "tool" && last && last.toolCalls && last.toolCalls.attachResult(m)) continue;
      nodes.push(this.element(m.role, m.content, m));
    }
    return nodes;
  }

  element(role, text, stored = null) {
    const node = this.template.content.firstElementChild.cloneNode(true);
    node.classList.add(role);
    node.dataset.role = role;
    node.querySelector(".role-label").textContent = ROLE_LABELS[role] || `${role}:`;
    node.querySelector(".regenerate").addEventListener("click", this.actions.regenerate);
    node.querySelector(".regenerate-alternatives").addEventListener("click", this.actions.regenerateAlternatives);
    node.querySelector(".continue").addEventListener("click", this.actions.continueReply);
    node.querySelector(".edit").addEventListener("click", () => this.actions.editMessage(node));
    const copy = node.querySelector(".copy-reply");
    copy.addEventListener("click", () => copyText(node.dataset.text, copy));
    node.dataset.text = text ?? ""; // a reply of only tool calls has content null
    renderInto(node.querySelector(".content"), text ?? "");
    if (stored && role === "assistant") showStoredReply(node, stored);
    return node;
  }
}

function showStoredReply(node, message) {
  new Reasoning(node).showStored(message);
  node.toolCalls = new ToolCalls(node);
  node.toolCalls.showStored(message.tool_calls);
  const usage = message.usage || {};
  const timing = message.timing || {};
  writeStats(node, {
    ttftMs: timing.ttft_s != null ? 1000 * timing.ttft_s : null,
    tokensPerS: timing.decode_tokens_per_s, promptTokens: usage.prompt_tokens,
    cachedTokens: usage.cached_tokens, completionTokens: usage.completion_tokens,
    stopped: message.finish_reason === "abort", cut: message.finish_reason === "length",
  });
  markCut(node, message.finish_reason === "length");
}

// A reply that ended at its token limit says so, and (as the last reply) offers Continue.
export function markCut(node, cut) {
  node.dataset.cut = cut ? "true" : "";
}

// The reply's stats line: first token, speed, tokens, the prompt and how much of it was cached.
export function writeStats(node, s) {
  const parts = [];
  if (s.ttftMs != null) parts.push(`first token ${Math.round(s.ttftMs)} ms`);
  if (s.tokensPerS) parts.push(`${s.tokensPerS.toFixed(1)} tokens/s`);
  if (s.completionTokens != null) parts.push(`${s.completionTokens} tokens`);
  if (s.promptTokens != null) parts.push(`prompt ${s.promptTokens} tokens (${s.cachedTokens ?? 0} cached)`);
  if (s.stopped) parts.push("stopped");
  if (s.cut) parts.push("cut at the token limit");
  const stats = node.querySelector(".stats");
  stats.textContent = parts.join(" · ");
  if (s.promptTokens != null) stats.dataset.promptTokens = s.promptTokens;
  if (s.cachedTokens != null) stats.dataset.cachedTokens = s.cachedTokens;
}
