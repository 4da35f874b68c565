// Markdown for chat messages, rendered so that neither the model nor a user can inject HTML or script:
// marked turns markdown into HTML with raw HTML escaped (shown as the text it is), then DOMPurify keeps only
// the tags markdown produces and drops unsafe URLs (javascript:, data: ...) before anything reaches the DOM.
// Code blocks are highlighted (web/code_highlight.js) and math drawn with KaTeX (web/math.js).
import { Marked } from "./vendor/marked/marked.esm.js";
import DOMPurify from "./vendor/dompurify/purify.es.js";
import { escapeHtml } from "./html.js";
import { codeClass, highlightCode } from "./code_highlight.js";
import { mathExtensions, renderMath } from "./math.js";

const marked = new Marked({
  gfm: true,
  breaks: true, // chat text uses single newlines as line breaks
  extensions: mathExtensions,
  renderer: {
    html: ({ text }) => escapeHtml(text),
    // no images: a remote image in a reply would be fetched unasked (a tracking pixel); show a link instead
    image: ({ href, text }) => `<a href="${escapeHtml(href || "")}">${escapeHtml(text || href || "image")}</a>`,
    code: ({ text, lang }) =>
      `<pre><code class="${escapeHtml(codeClass(lang))}">${highlightCode(text, lang)}</code></pre>\n`,
  },
});

const ALLOWED_TAGS = [
  "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del", "code", "pre", "blockquote",
  "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td", "span", "div",
];
const PURIFY = {
  ALLOWED_TAGS,
  ALLOWED_ATTR: ["href", "title", "class", "start", "align"],
  ALLOW_DATA_ATTR: false,
  // DOMPurify's default URI check stays: a javascript: (or data:, vbscript:) href is removed
  RETURN_DOM_FRAGMENT: true,
};

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

// The block tokens of `text` (marked's lexer): web/stream_render.js renders a streaming reply block by block.
export const lexBlocks = (text) => marked.lexer(text);

// A DocumentFragment of sanitised HTML for block `tokens`, its code blocks with copy buttons, its math drawn.
export function renderTokens(tokens) {
  const fragment = DOMPurify.sanitize(marked.parser(tokens), PURIFY);
  for (const pre of fragment.querySelectorAll("pre")) addCopyButton(pre);
  renderMath(fragment);
  return fragment;
}

// A DocumentFragment of sanitised HTML for `text` (markdown).
export function renderMarkdown(text) {
  return renderTokens(lexBlocks(text));
}

// Replaces the children of `element` by the rendering of `text`, with a copy button on each code block.
export function renderInto(element, text) {
  element.replaceChildren(renderMarkdown(text));
}

// An empty code block as renderTokens makes one (its wrapper with the copy button), for a block that streams:
// returns the wrapper and its <code>.
export function codeBlock(info) {
  const pre = document.createElement("pre");
  const code = document.createElement("code");
  code.className = codeClass(info);
  pre.append(code);
  return { wrapper: addCopyButton(pre), code };
}

// Wraps `pre` (in place, when it has a parent) in a div with a Copy button; returns the wrapper.
function addCopyButton(pre) {
  const wrapper = document.createElement("div");
  wrapper.className = "code-block";
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy-code";
  button.textContent = "Copy";
  button.setAttribute("aria-label", "Copy code");
  button.addEventListener("click", () => copyText(pre.textContent, button));
  if (pre.parentNode) pre.replaceWith(wrapper);
  wrapper.append(button, pre);
  return wrapper;
}

// Copies `text`, then shows "Copied" on `button` for a moment (its class `copied` too) and says it in the status.
export async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    fallbackCopy(text); // the Clipboard API needs a secure context (https or localhost)
  }
  const status = document.getElementById("status"); // the page's polite live region: a screen reader says it
  if (status) status.textContent = "Copied to the clipboard.";
  if (!button.classList.contains("copied")) button.dataset.label = button.textContent;
  button.textContent = "Copied";
  button.classList.add("copied");
  clearTimeout(button.copiedTimer);
  button.copiedTimer = setTimeout(() => {
    button.textContent = button.dataset.label;
    button.classList.remove("copied");
  }, 1500);
}

function fallbackCopy(text) {
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}
