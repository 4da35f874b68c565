// Markdown for chat messages, rendered so that neither the model nor a user can inject HTML or script:
// marked turns markdown into HTML with raw HTML escaped (shown as the text it is), then DOMPurify keeps only
// the tags markdown produces and drops unsafe URLs (javascript:, data: ...) before anything reaches the DOM.
import { Marked } from "./vendor/marked/marked.esm.js";
import DOMPurify from "./vendor/dompurify/purify.es.js";

const escapeHtml = (text) =>
  text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);

const marked = new Marked({
  gfm: true,
  breaks: true, // chat text uses single newlines as line breaks
  renderer: {
    html: ({ text }) => escapeHtml(text),
    // no images: a remote image in a reply would be fetched unasked (a tracking pixel); show a link instead
    image: ({ href, text }) => `<a href="${escapeHtml(href || "")}">${escapeHtml(text || href || "image")}</a>`,
  },
});

const ALLOWED_TAGS = [
  "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del", "code", "pre", "blockquote",
  "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td",
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

// A DocumentFragment of sanitised HTML for `text` (markdown).
export function renderMarkdown(text) {
  return DOMPurify.sanitize(marked.parse(text), PURIFY);
}

// Replaces the children of `element` by the rendering of `text`, with a copy button on each code block.
export function renderInto(element, text) {
  const fragment = renderMarkdown(text);
  for (const pre of fragment.querySelectorAll("pre")) addCopyButton(pre);
  element.replaceChildren(fragment);
}

function addCopyButton(pre) {
  const wrapper = document.createElement("div");
  wrapper.className = "code-block";
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy-code";
  button.textContent = "Copy";
  button.setAttribute("aria-label", "Copy code");
  button.addEventListener("click", () => copyText(pre.textContent, button));
  pre.replaceWith(wrapper);
  wrapper.append(button, pre);
}

// Copies `text`, then shows "Copied" on `button` for a moment (its class `copied` too).
export async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    fallbackCopy(text); // the Clipboard API needs a secure context (https or localhost)
  }
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
