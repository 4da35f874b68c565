// "Regenerate ×3": the last reply's conversation asked again through POST /v1/chat/completions with n = 3 (the
// server computes the prompt once for the three and shares its cached blocks with the session's), the three
// alternatives streamed side by side. They are not saved: the session API can append a turn or regenerate the
// last reply, but not store a reply chosen here, so there is no "keep" (Regenerate is what changes the chat).
import { api, ApiError, readChunks } from "./api.js";
import { StreamRenderer } from "./stream_render.js";

const NUM_ALTERNATIVES = 3;

const FINISHED = { stop: "complete", length: "cut at max tokens", abort: "stopped" };

// The stored conversation up to its last user message, as /v1/chat/completions takes it; null when the session
// does not end with a reply.
function messagesBeforeLastReply(session) {
  const messages = session.messages.map(requestMessage);
  if (!messages.length || messages[messages.length - 1].role !== "assistant") return null;
  messages.pop();
  return session.system ? [{ role: "system", content: session.system }, ...messages] : messages;
}

// A stored message as a request's history carries it: tool calls and the id a tool result answers kept (the
// stored usage, timing and reasoning are not part of it).
function requestMessage(m) {
  const message = { role: m.role, content: m.content };
  if (m.tool_calls) message.tool_calls = m.tool_calls;
  if (m.tool_call_id) message.tool_call_id = m.tool_call_id;
  return message;
}

// The panel of alternatives: one column per choice, filled from the stream's chunks (choices told apart by
// `index`). Model text reaches the page only through the markdown sanitiser (web/stream_render.js renders it).
export class Alternatives {
  constructor({ temperature, onClose, onRender }) {
    this.onRender = onRender;
    this.answered = false; // the server took the request (its stream started)
    this.element = document.getElementById("alternatives-template").content.firstElementChild.cloneNode(true);
    this.usage = this.element.querySelector(".alternatives-usage");
    this.element.querySelector(".close-alternatives").addEventListener("click", onClose);
    if (temperature === 0) {
      this.element.querySelector(".alternatives-note").textContent +=
        " This chat's temperature is 0, so the three are the same.";
    }
    this.columns = Array.from({ length: NUM_ALTERNATIVES }, (_, i) => this.column(i));
    this.element.querySelector(".alternatives-grid").append(...this.columns.map((c) => c.node));
  }

  column(index) {
    const node = document.getElementById("alternative-template").content.firstElementChild.cloneNode(true);
    node.querySelector(".alternative-label").textContent = `Alternative ${index + 1}`;
    const content = node.querySelector(".content");
    content.setAttribute("aria-busy", "true");
    node.classList.add("streaming");
    return { node, text: "", frame: null, done: false, renderer: new StreamRenderer(content) };
  }

  // Asks for the alternatives and fills the columns as they stream; an AbortError when `signal` stops it.
  // `sampling`: the request's sampling fields (temperature, max_tokens, top_p, model: chat_settings.js).
  async stream(sessionId, sampling, signal) {
    const stored = await api.getSession(sessionId); // the reply on screen was stored when its stream ended
    const messages = messagesBeforeLastReply(stored);
    if (!messages) throw new ApiError(0, "This chat has no reply to regenerate.");
    const response = await api.chatCompletions({
      messages, n: NUM_ALTERNATIVES, stream: true, stream_options: { include_usage: true },
      ...sampling,
    }, signal);
    this.answered = true;
    for await (const chunk of readChunks(response)) this.handle(chunk);
  }

  // One chunk of the stream; an error event ends it (thrown).
  handle(chunk) {
    if (chunk.error) throw new ApiError(0, `The alternatives broke off: ${chunk.error.message || "server error"}`);
    if (chunk.usage) this.showUsage(chunk.usage);
    for (const choice of chunk.choices || []) {
      const column = this.columns[choice.index];
      if (!column) continue;
      if (choice.delta && choice.delta.content) {
        column.text += choice.delta.content;
        this.scheduleRender(column);
      }
      if (choice.finish_reason) this.finishColumn(column, choice.finish_reason);
    }
  }

  // Renders a column's new text at most once a frame.
  scheduleRender(column) {
    if (column.frame) return;
    column.frame = requestAnimationFrame(() => {
      column.frame = null;
      this.render(column);
      this.onRender();
    });
  }

  render(column, final = false) {
    column.node.dataset.text = column.text;
    if (final) column.renderer.finish(column.text);
    else column.renderer.update(column.text);
  }

  finishColumn(column, reason) {
    if (column.done) return;
    column.done = true;
    if (column.frame) cancelAnimationFrame(column.frame);
    column.frame = null;
    this.render(column, true);
    column.node.classList.remove("streaming");
    column.node.dataset.finishReason = reason;
    column.node.querySelector(".content").setAttribute("aria-busy", "false");
    column.node.querySelector(".stats").textContent = FINISHED[reason] || reason;
  }

  // The end of the stream: columns still open were stopped (or broke off).
  finish() {
    for (const column of this.columns) this.finishColumn(column, "abort");
  }

  showUsage(usage) {
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    this.usage.textContent =
      `prompt ${usage.prompt_tokens} tokens (${cached} cached) · ${usage.completion_tokens} tokens in all three`;
    this.usage.dataset.cachedTokens = cached;
  }
}
