#!/usr/bin/env bash
# Vendors the browser UI's libraries into web/vendor/ (commit-ready, so serving needs no build step):
#   marked        markdown -> HTML                         (MIT)
#   DOMPurify     HTML sanitiser                           (MPL-2.0 OR Apache-2.0)
#   highlight.js  code highlighting, its common languages  (BSD-3-Clause; the @highlightjs/cdn-assets build)
#   KaTeX         TeX math -> HTML + MathML                (MIT; its woff2 fonts only: every browser the UI
#                                                           supports takes woff2, the first format its CSS lists)
# npm installs the pinned versions into a temporary directory; only the ES-module browser builds and the
# license files are copied. Re-run after changing a version below:  bash scripts/vendor_web.sh
set -euo pipefail

MARKED_VERSION="${MARKED_VERSION:-18.2.1}"
DOMPURIFY_VERSION="${DOMPURIFY_VERSION:-3.4.18}"
HIGHLIGHT_VERSION="${HIGHLIGHT_VERSION:-11.12.0}"
KATEX_VERSION="${KATEX_VERSION:-0.19.1}"

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/web/vendor"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

command -v npm >/dev/null || { echo "vendor_web: npm is needed (apt-get install -y npm)" >&2; exit 1; }
(cd "$tmp" && npm init -y >/dev/null 2>&1 \
    && npm install --no-audit --no-fund --ignore-scripts --loglevel=error \
        "marked@$MARKED_VERSION" "dompurify@$DOMPURIFY_VERSION" \
        "@highlightjs/cdn-assets@$HIGHLIGHT_VERSION" "katex@$KATEX_VERSION" >/dev/null)

mods="$tmp/node_modules"
rm -rf "$dest"
mkdir -p "$dest/marked" "$dest/dompurify" "$dest/highlight" "$dest/katex/fonts"

# The source-map comment is dropped because the maps are not vendored (a browser would fetch a 404).
# DOMPurify's .mjs is saved as .js: a module script needs a JavaScript MIME type, and not every mime table maps .mjs.
strip_map() { grep -v '^//# sourceMappingURL=' "$1" > "$2"; }
strip_map "$mods/marked/lib/marked.esm.js" "$dest/marked/marked.esm.js"
cp "$mods/marked/LICENSE" "$dest/marked/LICENSE"
strip_map "$mods/dompurify/dist/purify.es.mjs" "$dest/dompurify/purify.es.js"
cp "$mods/dompurify/LICENSE" "$dest/dompurify/LICENSE"
[ -f "$mods/dompurify/LICENSE-MPL" ] && cp "$mods/dompurify/LICENSE-MPL" "$dest/dompurify/LICENSE-MPL"

strip_map "$mods/@highlightjs/cdn-assets/es/highlight.min.js" "$dest/highlight/highlight.min.js"
cp "$mods/@highlightjs/cdn-assets/LICENSE" "$dest/highlight/LICENSE"
strip_map "$mods/katex/dist/katex.mjs" "$dest/katex/katex.js"
strip_map "$mods/katex/dist/katex.min.css" "$dest/katex/katex.min.css"
cp "$mods/katex/dist/fonts/"*.woff2 "$dest/katex/fonts/"
cp "$mods/katex/LICENSE" "$dest/katex/LICENSE"

cat > "$dest/VERSIONS" <<VERSIONS
marked $MARKED_VERSION (npm, lib/marked.esm.js) MIT
dompurify $DOMPURIFY_VERSION (npm, dist/purify.es.mjs, saved as purify.es.js) MPL-2.0 OR Apache-2.0
highlight.js $HIGHLIGHT_VERSION (npm @highlightjs/cdn-assets, es/highlight.min.js) BSD-3-Clause
katex $KATEX_VERSION (npm, dist/katex.mjs saved as katex.js, dist/katex.min.css, dist/fonts/*.woff2) MIT
VERSIONS
echo "vendor_web: marked $MARKED_VERSION, dompurify $DOMPURIFY_VERSION, highlight.js $HIGHLIGHT_VERSION," \
    "katex $KATEX_VERSION in ${dest#$root/}/"
