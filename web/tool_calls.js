// A reply's tool calls, one card each under the reply: the function's name and its arguments, as raw text while
// they stream and pretty-printed JSON once the call is complete; a tool-role message's content is shown on the
// card of the call it answers (its tool_call_id). Everything is set as text (textContent), never as HTML.
//
// Streamed fragments (`delta.tool_calls`) are OpenAI's: a call's first fragment carries its index, id and
// function name, later ones (same index) pieces of the arguments' JSON text. Calls arrive one after another, so
// a call is complete when the next one starts, or when the stream ends.

export class ToolCalls {
  constructor(messageNode) {
    this.list = messageNode.querySelector(".tool-calls");
    this.calls = new Map(); // index -> {card, name, arguments}
  }

  get count() {
    return this.calls.size;
  }

  // The `delta.tool_calls` of one chunk.
  apply(fragments) {
    for (const fragment of fragments) {
      const index = Number(fragment.index ?? 0);
      for (const [other, call] of this.calls) if (other < index) this.complete(call);
      const call = this.calls.get(index) || this.add(index);
      const fn = fragment.function || {};
      if (fragment.id) call.card.dataset.callId = fragment.id;
      if (fn.name) call.name += fn.name;
      if (fn.arguments) call.arguments += fn.arguments;
      call.card.querySelector(".tool-call-name").textContent = call.name;
      call.card.setAttribute("aria-label", `Tool call ${call.name}`); // (a group, not a landmark: one per call)
      call.card.querySelector(".tool-call-arguments").textContent = call.arguments;
    }
  }

  // The stream ended: every call is as complete as it will be.
  finish() {
    for (const call of this.calls.values()) this.complete(call);
  }

  // A stored reply's `tool_calls`.
  showStored(toolCalls) {
    (toolCalls || []).forEach((stored, index) => {
      const fn = stored.function || {};
      const args = typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments ?? {});
      this.apply([{ index, id: stored.id, function: { name: fn.name, arguments: args } }]);
    });
    this.finish();
  }

  // A tool-role message: shown on the card of its call; false when no card of this reply has that id.
  attachResult(message) {
    const card = [...this.list.querySelectorAll(".tool-call")].find(
      (c) => c.dataset.callId === message.tool_call_id,
    );
    if (!card) return false;
    const result = card.querySelector(".tool-result");
    result.hidden = false;
    const text = textOf(message.content);
    result.querySelector(".tool-result-text").textContent = prettyJson(text) ?? text;
    return true;
  }

  add(index) {
    const card = document.getElementById("tool-call-template").content.firstElementChild.cloneNode(true);
    card.dataset.index = index;
    this.list.hidden = false;
    this.list.append(card);
    const call = { card, name: "", arguments: "" };
    this.calls.set(index, call);
    return call;
  }

  complete(call) {
    if (call.card.dataset.complete) return;
    call.card.dataset.complete = "true";
    const pretty = prettyJson(call.arguments);
    if (pretty === null) call.card.dataset.invalidArguments = "true"; // shown as it came
    else call.card.querySelector(".tool-call-arguments").textContent = pretty;
  }
}

// A message's content: a string, or OpenAI's list of content parts (their text joined).
function textOf(content) {
  if (Array.isArray(content)) return content.map((part) => (part && part.text) || "").join("");
  return content == null ? "" : String(content);
}

// `text` re-indented as JSON, or null when it is not JSON.
function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return null;
  }
}
