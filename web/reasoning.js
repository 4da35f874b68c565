// A reply's reasoning (the model's thinking before its answer: `reasoning_content`), shown in a collapsed
// <details> block above the reply. While it streams the summary says "Thinking…"; once the answer (or a tool
// call) begins, or the stream ends, it says how long the thinking took. The text reaches the page only through
// the markdown sanitiser (renderInto), as the reply's does.
import { renderInto } from "./markdown.js";
import { StreamRenderer } from "./stream_render.js";

export class Reasoning {
  constructor(messageNode) {
    this.block = messageNode.querySelector(".reasoning");
    this.summary = this.block.querySelector(".reasoning-summary");
    this.body = this.block.querySelector(".reasoning-text");
    this.text = "";
    this.started = null; // performance.now() of the first fragment
    this.ended = false;
  }

  // One streamed fragment (rendered by render(), at most once a frame).
  append(fragment) {
    if (this.started === null) {
      this.started = performance.now();
      this.block.hidden = false;
      this.block.classList.add("thinking");
      this.summary.textContent = "Thinking…";
    }
    this.text += fragment;
  }

  render() {
    if (this.started === null) return;
    this.block.dataset.text = this.text;
    this.renderer ??= new StreamRenderer(this.body); // (only what arrived since the last frame is rendered)
    this.renderer.update(this.text);
  }

  // The thinking is over: the answer began, or the stream ended (finished, stopped or broken off). True when
  // this call ended it.
  end() {
    if (this.started === null || this.ended) return false;
    this.ended = true;
    this.render();
    this.renderer.finish(this.text);
    this.block.classList.remove("thinking");
    this.summary.textContent = thoughtFor((performance.now() - this.started) / 1000);
    return true;
  }

  // A stored reply (GET /v1/sessions/{id}): its reasoning, if any, and how long it took when the server says.
  showStored(message) {
    if (!message.reasoning_content) return;
    this.text = message.reasoning_content;
    this.started = 0;
    this.ended = true;
    this.block.dataset.text = this.text;
    renderInto(this.body, this.text);
    this.block.hidden = false;
    const seconds = message.timing ? message.timing.reasoning_s : null;
    this.summary.textContent = seconds != null ? thoughtFor(seconds) : "Thoughts";
  }
}

const thoughtFor = (seconds) => `Thought for ${Math.max(1, Math.round(seconds))} s`;
