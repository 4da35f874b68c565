// Syntax highlighting of code blocks (highlight.js, vendored with its common languages), whole or while a block
// streams. The highlighted HTML is highlight.js's: the code's text escaped, wrapped in <span class="hljs-...">.
import hljs from "./vendor/highlight/highlight.min.js";
import { escapeHtml } from "./html.js";

// Guessing the language of an unlabelled block runs every grammar over it: only small blocks are guessed.
const GUESS_MAX_CHARS = 4000;
// A streaming block re-highlights its uncommitted lines each frame; past this many they are committed anyway
// (a comment or string open that long may then be coloured differently until the block ends).
const PENDING_MAX_LINES = 200;

// The grammar named by a fence's info string ("python", "js", "c++ {.class}"), or null.
export function languageOf(info) {
  const name = (info || "").trim().split(/\s+/)[0].toLowerCase();
  return name && hljs.getLanguage(name) ? name : null;
}

// `code` as highlighted HTML; `info` is the fence's info string (guessed for a small unlabelled block).
export function highlightCode(code, info) {
  const language = languageOf(info);
  if (language) return hljs.highlight(code, { language, ignoreIllegals: true }).value;
  if (!(info || "").trim() && code.length <= GUESS_MAX_CHARS) return hljs.highlightAuto(code).value;
  return escapeHtml(code);
}

// The class list a highlighted <code> gets (the `language-x` one marked writes, plus `hljs`), unescaped.
export const codeClass = (info) => {
  const name = (info || "").trim().split(/\s+/)[0];
  return name ? `hljs language-${name}` : "hljs";
};

// A code block that grows line by line: complete lines are highlighted once and committed where the grammar is
// back at its top level (no comment or string left open), so a 2,000-line block costs each line about once; the
// lines since the last such point are highlighted again each frame, and the unfinished last line is plain text.
export class LiveCode {
  constructor(codeElement, info) {
    this.code = codeElement;
    this.language = languageOf(info);
    this.committed = 0; // characters of the body committed as highlighted spans
    this.root = this.language ? hljs.highlight("", { language: this.language })._top : null;
    this.pending = document.createElement("span"); // highlighted lines since the last commit
    this.partial = document.createTextNode(""); // the unfinished last line
    this.code.append(this.pending, this.partial);
  }

  // Shows `body` (the block's text so far; it only grows).
  update(body) {
    const end = body.lastIndexOf("\n") + 1; // complete lines end here
    if (end > this.committed) this.highlightLines(body.slice(this.committed, end), end);
    this.partial.data = body.slice(Math.max(end, this.committed));
  }

  // Shows the whole block `body`, its last line highlighted too.
  // (Its final newline, the one before the closing fence, is not part of the code.)
  finish(body) {
    const code = body.endsWith("\n") ? body.slice(0, -1) : body;
    this.partial.remove();
    const rest = code.slice(this.committed);
    if (rest) {
      const result = this.run(rest);
      this.commit(result ? result.value : escapeHtml(rest), code.length);
    } else if (code.length < this.committed) dropLastNewline(this.code);
    this.pending.remove();
  }

  // highlight.js's result for `lines` (null without a grammar: then they are plain text)
  run(lines) {
    return this.language ? hljs.highlight(lines, { language: this.language, ignoreIllegals: true }) : null;
  }

  highlightLines(lines, end) {
    const result = this.run(lines);
    if (!result) return this.commit(escapeHtml(lines), end);
    const tooLong = lines.split("\n").length > PENDING_MAX_LINES;
    if (result._top === this.root || tooLong) return this.commit(result.value, end);
    this.pending.innerHTML = result.value; // highlight.js's escaped output
  }

  commit(html, end) {
    const span = document.createElement("span");
    span.className = "code-lines";
    span.innerHTML = html; // highlight.js's escaped output (or escapeHtml's)
    this.code.insertBefore(span, this.pending);
    this.pending.replaceChildren();
    this.committed = end;
  }
}

// Removes the newline that ends the text of `element` (its last non-empty text node ends with it).
function dropLastNewline(element) {
  const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
  let last = walker.lastChild(); // the deepest last text node
  while (last && !last.data) last = walker.previousNode();
  if (last && last.data.endsWith("\n")) last.data = last.data.slice(0, -1);
}
