// TeX math in chat messages: marked extensions find $…$, \(…\) (inline) and $$…$$, \[…\] (display) and leave a
// placeholder holding the TeX as text; after sanitising, renderMath() draws each placeholder with KaTeX
// (vendored, loaded on the first formula). KaTeX builds DOM nodes and sets their styles through the CSSOM, so
// the page's CSP (no inline styles) holds; `trust: false` keeps \href, \url and \html… commands off.
import { escapeHtml } from "./html.js";

// The longest formula drawn; a longer one stays as its TeX source.
const MAX_TEX_CHARS = 4000;
const KATEX_OPTIONS = {
  throwOnError: false, // a formula with an error is shown as its source, in the error colour
  trust: false,
  strict: "ignore",
  maxSize: 20, // em: \rule and \kern cannot cover the page
  maxExpand: 500, // macro expansions: a macro bomb ends quickly
  output: "htmlAndMathml", // MathML for screen readers
};

let katex = null;
let loading = null;

const placeholder = (tag, cls, tex) => `<${tag} class="${cls}">${escapeHtml(tex)}</${tag}>`;
// $…$ is inline math when the $ is not followed by a space, the closing $ is not preceded by a space nor
// followed by a digit (so "$5 and $10" stays money), and the formula fits on one line.
const DOLLAR = /^\$(?!\s)((?:\\.|[^\\$\n])+?)(?<!\s)\$(?!\d)/;
const PAREN = /^\\\(([\s\S]+?)\\\)/;
const DOUBLE_INLINE = /^\$\$([^\n]+?)\$\$/;
const BRACKET_INLINE = /^\\\[([\s\S]+?)\\\]/;

const inlineMath = {
  name: "mathInline",
  level: "inline",
  start(src) {
    const at = src.search(/\$|\\[([]/);
    return at < 0 ? undefined : at;
  },
  tokenizer(src) {
    for (const [re, display] of [[DOUBLE_INLINE, true], [BRACKET_INLINE, true], [PAREN, false], [DOLLAR, false]]) {
      const match = re.exec(src);
      if (match) return { type: "mathInline", raw: match[0], text: match[1].trim(), display };
    }
    return undefined;
  },
  renderer: ({ text, display }) => placeholder("span", display ? "math-display" : "math-inline", text),
};

// A display formula on lines of its own: $$ … $$ or \[ … \].
const BLOCK = /^ {0,3}(?:\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\]) *(?:\n+|$)/;

const blockMath = {
  name: "mathBlock",
  level: "block",
  start(src) {
    const at = src.search(/^ {0,3}(?:\$\$|\\\[)/m);
    return at < 0 ? undefined : at;
  },
  tokenizer(src) {
    const match = BLOCK.exec(src);
    if (match) return { type: "mathBlock", raw: match[0], text: (match[1] ?? match[2]).trim() };
    return undefined;
  },
  renderer: ({ text }) => placeholder("div", "math-display", text) + "\n",
};

export const mathExtensions = [blockMath, inlineMath];

// Draws the placeholders under `root` (a fragment or an element); the first call loads KaTeX, then draws every
// placeholder still in the document.
export function renderMath(root) {
  const found = root.querySelectorAll(".math-inline:not([data-drawn]), .math-display:not([data-drawn])");
  if (found.length === 0) return;
  if (katex) return void found.forEach(draw);
  load().then(() => katex && document.querySelectorAll(".math-inline, .math-display").forEach(draw));
}

function draw(element) {
  if (element.dataset.drawn) return;
  element.dataset.drawn = "1";
  const tex = element.textContent;
  if (tex.length > MAX_TEX_CHARS) return;
  const displayMode = element.classList.contains("math-display");
  element.replaceChildren();
  katex.render(tex, element, { ...KATEX_OPTIONS, displayMode });
  element.setAttribute("data-tex", tex); // the source, for copying
}

function load() {
  if (!loading) {
    addStylesheet();
    loading = import("./vendor/katex/katex.js")
      .then((module) => {
        katex = module.default;
      })
      .catch(() => {}); // not loaded: the formulas stay as their TeX source
  }
  return loading;
}

function addStylesheet() {
  if (document.querySelector("link[data-katex]")) return;
  const link = document.createElement("link");
  link.rel = "stylesheet";
  link.href = new URL("./vendor/katex/katex.min.css", import.meta.url).href;
  link.dataset.katex = "1";
  document.head.append(link);
  return link;
}

// KaTeX's stylesheet and its common fonts, fetched while the page is idle: a web font arriving makes the browser
// lay out all the page's text again, which after a long reply is a long frame; before it, it is nothing.
export function preloadMath() {
  const link = addStylesheet();
  if (!link) return;
  link.addEventListener("load", () => {
    for (const face of PRELOADED_FONTS) document.fonts.load(face).catch(() => {});
  });
}

const PRELOADED_FONTS = [
  "1em KaTeX_Main", "bold 1em KaTeX_Main", "italic 1em KaTeX_Main", "italic 1em KaTeX_Math", "1em KaTeX_AMS",
  "1em KaTeX_Size1", "1em KaTeX_Size2", "1em KaTeX_Size3", "1em KaTeX_Size4",
];
