// A reply rendered while it streams, in time that grows with what arrived rather than with the whole reply:
// markdown blocks that can no longer change (every block before the last one marked's lexer finds) are rendered
// once and kept; only the last block is rendered again each frame; and a fenced code block, however long,
// streams into one <pre> line by line (web/code_highlight.js LiveCode) until its closing fence.
import { LiveCode } from "./code_highlight.js";
import { codeBlock, lexBlocks, renderInto, renderTokens } from "./markdown.js";

const FENCE = /^(`{3,}|~{3,})([^\n]*)\n/;
// A link reference definition ("[id]: url") may change blocks rendered before it: such a reply is rendered
// whole once it ends.
const REFERENCE = /^ {0,3}\[[^\]\n]+\]:/m;

export class StreamRenderer {
  constructor(element) {
    this.element = element;
    this.reset();
  }

  reset() {
    this.element.replaceChildren();
    this.text = "";
    this.settled = 0; // characters of the text rendered for good
    this.live = []; // the nodes of the last block, replaced each update
    this.code = null; // the fenced code block streaming now
  }

  // Shows `text`, the reply so far (each call's text extends the last one's).
  update(text) {
    if (text.length < this.text.length) this.reset();
    this.text = text;
    for (let more = true; more; ) more = this.code ? this.advanceCode(false) : this.renderTail();
  }

  // Shows the whole reply `text` for good.
  finish(text) {
    this.update(text);
    if (this.code) this.advanceCode(true);
    if (REFERENCE.test(text)) renderInto(this.element, text);
    this.live = [];
    this.settled = text.length; // (a later update with the same text changes nothing)
  }

  // Renders the text past the settled part; true when a fenced code block starts there (it streams on).
  renderTail() {
    const tokens = lexBlocks(this.text.slice(this.settled));
    let last = tokens.length - 1;
    while (last > 0 && tokens[last].type === "space") last--;
    const lastToken = tokens[last];
    // (a fence indented under its paragraph streams as any block: marked keeps its lines' indentation as is)
    const fence = lastToken && lastToken.type === "code" ? FENCE.exec(lastToken.raw) : null;
    if (last > 0) this.settle(tokens, last);
    this.replaceLive(fence ? [] : tokens.slice(last > 0 ? last : 0));
    if (!fence) return false;
    this.openCode(fence);
    return true;
  }

  // Renders tokens[0..count) for good and moves the settled offset past them.
  settle(tokens, count) {
    const done = tokens.slice(0, count);
    this.replaceLive([]);
    this.element.append(renderTokens(done));
    for (const token of done) this.settled += token.raw.length;
  }

  replaceLive(tokens) {
    for (const node of this.live) node.remove();
    const fragment = tokens.length ? renderTokens(tokens) : null;
    this.live = fragment ? [...fragment.childNodes] : [];
    if (fragment) this.element.append(fragment);
  }

  openCode([opening, marker, info]) {
    const { wrapper, code } = codeBlock(info);
    this.element.append(wrapper);
    const bodyStart = this.settled + opening.length;
    this.code = { wrapper, marker, bodyStart, scanFrom: bodyStart, view: new LiveCode(code, info) };
  }

  // Shows the code block's new lines; true when its closing fence arrived (the text after it is rendered next).
  // At the end of the reply (`final`) the last line counts too, and an unclosed block ends with the reply.
  advanceCode(final) {
    const code = this.code;
    const text = this.text;
    let lineStart = code.scanFrom;
    for (let end = text.indexOf("\n", lineStart); end >= 0 || final; end = text.indexOf("\n", lineStart)) {
      const lineEnd = end >= 0 ? end : text.length;
      if (this.closes(text.slice(lineStart, lineEnd), code.marker)) {
        code.view.finish(text.slice(code.bodyStart, lineStart));
        this.code = null;
        this.settled = end >= 0 ? end + 1 : text.length;
        return true;
      }
      if (end < 0) break;
      lineStart = end + 1;
    }
    code.scanFrom = lineStart;
    if (final) code.view.finish(text.slice(code.bodyStart));
    else code.view.update(text.slice(code.bodyStart));
    return false;
  }

  closes(line, marker) {
    const match = /^ {0,3}(`{3,}|~{3,})[ \t]*$/.exec(line);
    return match !== null && match[1][0] === marker[0] && match[1].length >= marker.length;
  }
}
