"""Debian's Chromium driven by Playwright (from PyPI; its own browser downloads are never used), for the browser
UI's tests and scripts/screenshot.py.

CI installs ``apt-get install -y chromium`` and ``pip install playwright``; without either, the UI tests fail
with the reason. The flags keep headless Chromium from reaching out (without the background-networking ones its
connections get refused in a sandbox without network).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# web/api.js keeps the UI's settings under this localStorage key
SETTINGS_KEY = "pagedchat.settings"
REPLY_TIMEOUT_MS = 90_000
SHORT = {"temperature": 0.0, "maxTokens": 16, "apiKey": ""}


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if not CHROMIUM.exists() and not shutil.which("chromium"):
        return "Debian's chromium is not installed (apt-get install -y chromium)"
    return None


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium browser (playwright's Browser)."""
    from playwright.sync_api import sync_playwright

    executable = str(CHROMIUM) if CHROMIUM.exists() else shutil.which("chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def browser_fixture() -> Any:
    """A module-scoped pytest fixture yielding a headless Chromium; assign it to ``browser`` in the test
    module. CI installs both (.ci/run, dev extras): missing is a failure, not a skip."""

    @pytest.fixture(scope="module")
    def _browser() -> Iterator[Any]:
        if reason := browser_missing():
            pytest.fail(reason)
        with chromium() as browser:
            yield browser

    return _browser


def open_page(
    browser: Any, url: str, settings: dict[str, Any] | None = None, **context_options: Any
) -> Any:
    """A fresh browser context (its own localStorage) with the UI's settings stored, at ``url``, once the
    composer has the focus; page errors are collected in ``page.errors``."""
    context = browser.new_context(**context_options)
    preset_settings(context, **(settings or SHORT))
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.goto(url)
    page.wait_for_function(
        "() => document.querySelector('#composer-input') === document.activeElement"
    )
    return page


def preset_settings(context: Any, **settings: Any) -> None:
    """Store the UI's settings (temperature, maxTokens, apiKey) before any page of ``context`` loads."""
    context.add_init_script(
        f"localStorage.setItem({json.dumps(SETTINGS_KEY)}, {json.dumps(json.dumps(settings))})"
    )


def session_id_of(page: Any) -> str:
    """The id of the session the page shows (its address carries it: ``?s=ID``)."""
    match = re.search(r"[?&]s=([A-Za-z0-9_-]{22})", page.url)
    assert match, f"no session id in the URL {page.url}"
    return match.group(1)


def send_message(page: Any, text: str) -> None:
    """Type ``text`` into the composer and press Enter, as a person would."""
    mark_replies_seen(page)
    page.fill("#composer-input", text)
    page.press("#composer-input", "Enter")


def mark_replies_seen(page: Any) -> None:
    """Tag the replies on the page now, so wait_for_reply waits for a new one (not one already there)."""
    page.evaluate(
        "() => document.querySelectorAll('#messages .message.assistant')"
        ".forEach((r) => { r.dataset.seenByTest = '1'; })"
    )


def wait_for_reply(page: Any, timeout_ms: int = REPLY_TIMEOUT_MS) -> Any:
    """Wait until a reply newer than mark_replies_seen has finished streaming (its stats are written then);
    return its element."""
    page.wait_for_function(
        "() => { const r = [...document.querySelectorAll('#messages .message.assistant')].pop();"
        " return r && !r.dataset.seenByTest && !r.classList.contains('streaming')"
        " && r.querySelector('.stats').textContent !== ''; }",
        timeout=timeout_ms,
    )
    return page.locator("#messages .message.assistant").last


def record_reply_lengths(page: Any) -> None:
    """Start recording, at each change the page makes to the reply that is streaming, its text length (every
    render is seen, however fast the reply arrives: polling could miss a stream shorter than its period)."""
    page.evaluate("""() => {
        window.__replyLengths = [];
        window.__replyObserver = new MutationObserver(() => {
            const reply = document.querySelector('#messages .message.assistant.streaming .content');
            if (reply) window.__replyLengths.push(reply.textContent.length);
        });
        window.__replyObserver.observe(document.querySelector('#messages'),
            { childList: true, subtree: true, characterData: true });
    }""")


def recorded_reply_lengths(page: Any) -> list[int]:
    return page.evaluate(
        "() => { window.__replyObserver.disconnect(); return window.__replyLengths; }"
    )


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)
