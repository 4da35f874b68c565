// `text` as HTML text: its markup characters escaped (for the strings web/markdown.js, math.js and
// code_highlight.js write as HTML).
const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
