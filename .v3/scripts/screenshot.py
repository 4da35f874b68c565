"""Saves docs/screenshot.png: the chat UI in Debian's headless Chromium after a real two-turn conversation with
the default model (a server started here on a free port, with a small KV pool).

    .venv/bin/python scripts/screenshot.py [--out docs/screenshot.png] [--dark]

Needs ``pip install playwright`` and ``apt-get install -y chromium`` (tests/web_harness.py says why).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.server_harness import running_server
from tests.web_harness import (
    browser_missing,
    chromium,
    preset_settings,
    send_message,
    wait_for_reply,
)

TURNS = [
    "Write a Python function that returns the squares of a list of numbers, in a code block.",
    "Explain in two sentences what a list comprehension is.",
]
SYSTEM = "You are a concise programming assistant. Use markdown."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "screenshot.png")
    parser.add_argument("--dark", action="store_true", help="the dark colour scheme")
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    if reason := browser_missing():
        print(f"screenshot: {reason}", file=sys.stderr)
        return 1
    with running_server() as server, chromium() as browser:
        context = browser.new_context(
            viewport={"width": 1200, "height": 760}, color_scheme="dark" if args.dark else "light"
        )
        preset_settings(context, temperature=0.0, maxTokens=args.max_tokens, apiKey="")
        page = context.new_page()
        page.goto(server.url("/"))
        page.fill("#system-input", SYSTEM)
        for text in TURNS:
            send_message(page, text)
            wait_for_reply(page, timeout_ms=180_000)
        page.wait_for_timeout(300)  # the sidebar refresh after the turn
        page.evaluate(
            "() => { document.activeElement.blur(); document.getElementById('messages').scrollTop = 0; }"
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out))
    print(f"screenshot: {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
