"""The browser chat UI (web/), driven in Debian's headless Chromium through Playwright against a real server
with the default model: streaming, stop, reload, safe markdown, errors, the sessions sidebar.

Replies are kept short (max_tokens 16-32) except where a reply must outlast a few samples."""

from __future__ import annotations

import functools
import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_harness import RunningServer, running_server, server_fixture, wait_until_idle
from tests.web_harness import (
    REPLY_TIMEOUT_MS,
    SHORT,
    browser_fixture,
    mark_replies_seen,
    open_page,
    record_reply_lengths,
    recorded_reply_lengths,
    send_message,
    session_id_of,
    wait_for_reply,
    wait_until,
)

WEB_DIR = Path(__file__).resolve().parents[2] / "web"

server = server_fixture()
browser = browser_fixture()


@pytest.fixture
def page(browser: Any, server: RunningServer) -> Iterator[Any]:
    page = open_page(browser, server.url("/"))
    yield page
    assert page.errors == [], page.errors
    page.context.close()


# static serving and sanitising: no model needed ------------------------------------------------------


def test_ui_is_served_at_root_without_a_build_step() -> None:
    from starlette.testclient import TestClient

    from app.server import create_app

    client = TestClient(create_app())  # not entered: no lifespan, so no engine; static files only
    index = client.get("/")
    assert index.status_code == 200 and index.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="app.js">' in index.text
    for path in [
        "/app.js",
        "/api.js",
        "/markdown.js",
        "/alternatives.js",
        "/reasoning.js",
        "/tool_calls.js",
        "/vendor/marked/marked.esm.js",
        "/vendor/dompurify/purify.es.js",
    ]:
        response = client.get(path)
        assert response.status_code == 200, path
        # module scripts need it
        assert response.headers["content-type"].startswith("text/javascript"), path
    assert client.get("/style.css").headers["content-type"].startswith("text/css")
    for license_file in ["vendor/marked/LICENSE", "vendor/dompurify/LICENSE"]:
        assert (WEB_DIR / license_file).stat().st_size > 500


@pytest.fixture(scope="module")
def static_web() -> Iterator[str]:
    """web/ from the standard library's file server: enough for the markdown module, no model loaded."""
    handler = functools.partial(_QuietHandler, directory=str(WEB_DIR))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


HOSTILE_MARKDOWN = {
    "img onerror": "<img src=x onerror=alert(1)>",
    "script tag": "<script>alert(1)</script>",
    "javascript link": "[x](javascript:alert(1))",
    "obfuscated javascript link": "[x](JaVaScRiPt:alert(1)) [y](  javascript:alert(1)) [z](java&#x09;script:alert(1))",
    "data link": "[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    "markdown image": "![pixel](http://example.invalid/track.png)",
    "svg onload": "<svg onload=alert(1)><circle r=5></circle></svg>",
    "iframe": '<iframe src="javascript:alert(1)"></iframe>',
    "autolink": "<javascript:alert(1)>",
    "html attribute in code": '`<b onclick="alert(1)">` and\n```html\n<img src=x onerror=alert(1)>\n```',
    "fence info string": '```"><img src=x onerror=alert(1)>\nx\n```',
    "math href": "$\\href{javascript:alert(1)}{x}$ and $$\\url{javascript:alert(1)}$$",
    "math html commands": "\\(\\htmlClass{x}{y} \\htmlData{onclick=alert(1)}{z} \\includegraphics{x.png}\\)",
    "math in display": "\\[\\text{<img src=x onerror=alert(1)>}\\]",
}


@pytest.mark.parametrize("name", HOSTILE_MARKDOWN)
def test_markdown_rendering_never_yields_html_or_script(
    browser: Any, static_web: str, name: str
) -> None:
    page = browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    # a same-origin page from which to import the module
    page.goto(static_web + "/index.html#no-app")
    result = page.evaluate(
        """async (text) => {
        const { renderInto } = await import('/markdown.js');
        const box = document.createElement('div');
        document.body.append(box);
        renderInto(box, text);
        // math is drawn once KaTeX has loaded
        const undrawn = '.math-inline:not([data-drawn]), .math-display:not([data-drawn])';
        for (let i = 0; i < 100 && box.querySelector(undrawn); i++) {
            await new Promise((resolve) => setTimeout(resolve, 50));
        }
        await new Promise((resolve) => setTimeout(resolve, 200));  // let any injected handler fire
        return {
            tags: [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()),
            hrefs: [...box.querySelectorAll('[href]')].map((e) => e.getAttribute('href')),
            handlers: [...box.querySelectorAll('*')].flatMap((e) => e.getAttributeNames())
                .filter((a) => a.startsWith('on')),
            text: box.textContent,
            formulas: box.querySelectorAll('.katex').length,
        };
    }""",
        HOSTILE_MARKDOWN[name],
    )
    if name.startswith("math"):  # KaTeX drew them (its untrusted commands as error text)
        assert result["formulas"] > 0, result
    forbidden = {"img", "script", "svg", "iframe", "object", "embed", "style", "form", "input"}
    assert not forbidden & set(result["tags"]), result
    safe_href = re.compile(r"^(https?:|mailto:|#|/)", re.IGNORECASE)
    assert not [h for h in result["hrefs"] if not safe_href.match(h.strip())], result
    assert result["handlers"] == [] and dialogs == []
    page.close()


def test_raw_html_is_shown_as_the_text_it_is(browser: Any, static_web: str) -> None:
    page = browser.new_page()
    page.goto(static_web + "/index.html#no-app")
    html = page.evaluate("""async () => {
        const { renderInto } = await import('/markdown.js');
        const box = document.createElement('div');
        renderInto(box, 'see <img src=x onerror=alert(1)> and **bold**\\n\\n```py\\nprint(1)\\n```');
        return box.innerHTML;
    }""")
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<strong>bold</strong>" in html
    assert '<code class="hljs language-py"><span class="hljs-built_in">print</span>(' in html
    assert 'class="copy-code"' in html
    page.close()


# a real server and the default model -------------------------------------------------------------------


@pytest.mark.slow
def test_new_chat_streams_the_reply_token_by_token_then_shows_stats(
    browser: Any, server: RunningServer
) -> None:
    # 64 tokens: a few frames' worth even on a busy machine (each frame renders what arrived since the last)
    page = open_page(browser, server.url("/"), {"temperature": 0.0, "maxTokens": 64, "apiKey": ""})
    assert page.locator("#draft-options").is_visible()
    record_reply_lengths(page)
    send_message(page, "Tell me a short story about a lighthouse keeper.")
    reply = wait_for_reply(page)
    lengths = recorded_reply_lengths(page)
    # new maxima of the text length seen while streaming (markdown may briefly shorten it: "**b" -> <b>)
    growing = [n for i, n in enumerate(lengths) if n > max([0, *lengths[:i]])]
    assert len(growing) >= 3, f"too few growing lengths seen while the reply streamed: {lengths}"
    assert reply.locator(".content").inner_text().strip()

    stats = reply.locator(".stats")
    assert re.search(
        r"first token \d+ ms · [\d.]+ tokens/s · \d+ tokens · prompt \d+ tokens \(\d+ cached\)",
        stats.inner_text(),
    ), stats.inner_text()
    session = httpx.get(server.url(f"/v1/sessions/{session_id_of(page)}"), timeout=10).json()
    assert (
        int(stats.get_attribute("data-prompt-tokens"))
        == session["messages"][-1]["usage"]["prompt_tokens"]
    )
    assert (
        page.locator(f'#session-list [data-id="{session["id"]}"] [aria-current="page"]').count()
        == 1
    )
    assert page.errors == []
    page.context.close()


def test_a_reply_cut_at_the_token_limit_says_so_and_continue_asks_for_more(
    page: Any, server: RunningServer
) -> None:
    # 16 tokens: it is cut
    send_message(page, "Tell me a long story about a lighthouse keeper and the sea.")
    reply = wait_for_reply(page)
    assert "cut at the token limit" in reply.locator(".stats").inner_text()
    assert reply.locator(".continue").is_visible()
    mark_replies_seen(page)
    reply.locator(".continue").click()
    wait_for_reply(page)
    session = httpx.get(server.url(f"/v1/sessions/{session_id_of(page)}"), timeout=10).json()
    assert [m["role"] for m in session["messages"]] == ["user", "assistant", "user", "assistant"]
    assert (
        session["messages"][2]["content"] == "Continue."
        and session["messages"][1]["finish_reason"] == "length"
    )
    replies = page.locator(".message.assistant")
    assert not replies.first.locator(".continue").is_visible()  # only the last reply offers it
    assert replies.last.locator(".continue").is_visible()  # (cut again at 16 tokens)
    page.reload()
    page.wait_for_selector(".message.assistant .stats:has-text('cut at the token limit')")
    last = page.locator(".message.assistant").last
    assert last.locator(".continue").is_visible()


@pytest.mark.slow
def test_stop_ends_the_stream_keeps_the_partial_reply_and_frees_the_request(
    browser: Any, server: RunningServer
) -> None:
    page = open_page(browser, server.url("/"), {"temperature": 0.0, "maxTokens": 400, "apiKey": ""})
    send_message(page, "Write a very long essay about the history of the sea, with many chapters.")
    reply = page.locator("#messages .message.assistant.streaming .content")
    page.wait_for_function(
        "() => (document.querySelector('.message.assistant.streaming .content')"
        " || {}).textContent?.length > 10",
        timeout=60_000,
    )
    assert page.locator("#stop").is_visible() and not page.locator("#send").is_visible()
    page.click("#stop")

    finished = wait_for_reply(page, timeout_ms=10_000)
    partial = finished.get_attribute("data-text")  # the markdown as streamed
    assert partial and finished.locator(".content").inner_text().strip()
    assert "stopped" in finished.locator(".stats").inner_text()
    assert page.locator("#send").is_visible() and reply.count() == 0
    # the header's totals count the stopped turn (stored a moment after its stream ended)
    page.wait_for_selector("#session-stats:text-matches('^1 turns')", timeout=15_000)
    metrics = wait_until_idle(server, timeout=15)
    assert metrics.running == 0

    stored = httpx.get(server.url(f"/v1/sessions/{session_id_of(page)}"), timeout=10).json()[
        "messages"
    ][-1]
    assert stored["finish_reason"] == "abort"
    # the server kept what was shown (and what it made meanwhile)
    assert stored["content"].startswith(partial)
    assert page.errors == []
    page.context.close()


@pytest.mark.slow
def test_reload_brings_the_session_back_and_the_second_turn_hits_the_cache(page: Any) -> None:
    requests: list[Any] = []
    page.on("request", lambda request: requests.append(request))
    send_message(page, "Name three colours of the rainbow.")
    first = wait_for_reply(page).locator(".content").inner_text()
    session_id = session_id_of(page)

    page.reload()
    page.wait_for_selector("#messages .message.assistant")
    assert session_id_of(page) == session_id
    assert (
        page.locator("#messages .message.user .content").inner_text()
        == "Name three colours of the rainbow."
    )
    assert page.locator("#messages .message.assistant .content").inner_text() == first
    # from the stored usage
    assert "prompt" in page.locator("#messages .message.assistant .stats").inner_text()

    send_message(page, "And three more?")
    second = wait_for_reply(page)
    assert page.locator("#messages .message.assistant").count() == 2
    assert int(second.locator(".stats").get_attribute("data-cached-tokens")) > 0
    assert re.search(r"\((\d+) cached\)", second.locator(".stats").inner_text()).group(1) != "0"
    assert_session_requests_carry_the_id(requests, session_id, "And three more?")

    page.click("#new-chat")  # back and forward move between the draft and the session
    assert "s=" not in page.url and page.locator("#messages .message").count() == 0
    page.go_back()
    page.wait_for_function("() => document.querySelectorAll('#messages .message').length === 4")
    assert session_id_of(page) == session_id


def assert_session_requests_carry_the_id(
    requests: list[Any], session_id: str, last_text: str
) -> None:
    """Every session-scoped request had ``X-Session-ID`` (a load balancer routes by it); a turn streams with
    usage and the settings' sampling fields."""
    scoped = [r for r in requests if f"/v1/sessions/{session_id}" in r.url]
    assert {r.method for r in scoped} >= {"GET", "POST"}
    assert all(r.headers.get("x-session-id") == session_id for r in scoped), [
        (r.method, r.url) for r in scoped
    ]
    turn = [r for r in scoped if r.method == "POST" and r.url.endswith("/messages")][
        -1
    ].post_data_json
    assert turn == {
        "content": last_text,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": SHORT["temperature"],
        "max_tokens": SHORT["maxTokens"],
    }


@pytest.mark.slow
def test_hostile_user_message_renders_inert(page: Any) -> None:
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    hostile = "<img src=x onerror=alert(1)> and [x](javascript:alert(1))"
    send_message(page, hostile)
    wait_for_reply(page)
    page.wait_for_timeout(200)
    messages = page.locator("#messages")
    assert messages.locator("img, script, iframe, svg").count() == 0
    hrefs = messages.evaluate(
        "(m) => [...m.querySelectorAll('[href]')].map((a) => a.getAttribute('href'))"
    )
    assert not [h for h in hrefs if "javascript" in h.lower()], hrefs
    assert "<img src=x onerror=alert(1)>" in messages.locator(".message.user .content").inner_text()
    assert dialogs == []

    page.reload()  # the stored copy renders the same way
    page.wait_for_selector("#messages .message.user")
    assert page.locator("#messages img").count() == 0 and dialogs == []


@pytest.mark.slow
def test_regenerate_replaces_the_last_reply(page: Any, server: RunningServer) -> None:
    send_message(page, "Say hello.")
    wait_for_reply(page)
    mark_replies_seen(page)
    page.locator("#messages .message.assistant .regenerate").click()
    wait_for_reply(page)
    assert page.locator("#messages .message").count() == 2
    stored = httpx.get(server.url(f"/v1/sessions/{session_id_of(page)}"), timeout=10).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    assert (
        page.locator("#messages .message.assistant .content").inner_text()
        == stored["messages"][1]["content"]
    )


@pytest.mark.slow
def test_regenerate_three_streams_alternatives_side_by_side_and_keeps_the_stored_reply(
    browser: Any, server: RunningServer
) -> None:
    """Three choices of one /v1/chat/completions request (n=3, the session's messages, no session id) fill three
    columns at once; nothing is saved, so the chat and its stored reply stay as they were."""
    page = open_page(browser, server.url("/"), {"temperature": 1.0, "maxTokens": 24, "apiKey": ""})
    requests: list[Any] = []
    page.on("request", lambda request: requests.append(request))
    send_message(page, "Name a fruit and say why you like it.")
    reply = wait_for_reply(page)
    shown = reply.locator(".content").inner_text()
    page.evaluate("""() => {
        window.__columns = [];
        window.__sampler = setInterval(() => window.__columns.push(
            [...document.querySelectorAll('.alternative')].map((c) => [c.querySelector('.content').textContent.length,
                                                                    c.classList.contains('streaming')])), 20);
    }""")
    reply.locator(".regenerate-alternatives").click()
    assert page.locator("#stop").is_visible()
    page.wait_for_function(
        "() => document.querySelectorAll('.alternative[data-finish-reason]').length === 3"
        " && document.querySelector('.alternatives-usage').textContent !== ''",
        timeout=REPLY_TIMEOUT_MS,
    )
    samples = page.evaluate("() => { clearInterval(window.__sampler); return window.__columns; }")

    columns = page.locator(".alternatives .alternative")
    assert columns.count() == 3
    texts = [columns.nth(i).get_attribute("data-text") for i in range(3)]
    assert all(t and t.strip() for t in texts) and len(set(texts)) > 1, texts
    # streamed together: a moment when every column had text while some were still streaming
    assert any(
        all(n > 0 for n, _ in s) and any(busy for _, busy in s) for s in samples if len(s) == 3
    ), samples
    boxes = [columns.nth(i).bounding_box() for i in range(3)]
    assert (
        len({round(b["y"]) for b in boxes}) == 1 and boxes[0]["x"] < boxes[1]["x"] < boxes[2]["x"]
    )
    # the session's prompt
    assert int(page.locator(".alternatives-usage").get_attribute("data-cached-tokens")) > 0

    ask = [r for r in requests if r.url.endswith("/v1/chat/completions")]
    assert len(ask) == 1 and "x-session-id" not in ask[0].headers
    body = ask[0].post_data_json
    assert body["n"] == 3 and body["stream"] is True
    assert body["messages"] == [
        {"role": "user", "content": "Name a fruit and say why you like it."}
    ]

    # the session API cannot store one
    assert page.locator(".alternatives button", has_text="Keep").count() == 0
    stored = httpx.get(server.url(f"/v1/sessions/{session_id_of(page)}"), timeout=10).json()[
        "messages"
    ]
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert reply.locator(".content").inner_text() == shown
    page.locator(".close-alternatives").click()
    assert (
        page.locator(".alternatives").count() == 0
        and reply.locator(".regenerate-alternatives").is_visible()
    )
    assert page.errors == []
    page.context.close()


@pytest.mark.slow
def test_refused_alternatives_show_the_error_and_leave_the_reply(page: Any) -> None:
    error = {
        "error": {"message": "simulated refusal", "type": "error", "param": None, "code": None}
    }
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=429,
            content_type="application/json",
            body=json.dumps(error),
            headers={"Retry-After": "3"},
        ),
    )
    send_message(page, "Say hello.")
    reply = wait_for_reply(page)
    reply.locator(".regenerate-alternatives").click()
    page.wait_for_selector("#error:not([hidden])")
    assert "busy" in page.locator("#error-text").inner_text()
    assert (
        page.locator(".alternatives").count() == 0
        and reply.locator(".regenerate-alternatives").is_visible()
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("status", "words"), [(429, "busy"), (503, "cannot answer"), (401, "Not authorised")]
)
def test_refused_message_shows_the_error_and_keeps_the_typed_text(
    page: Any, status: int, words: str
) -> None:
    error = {
        "error": {"message": "simulated refusal", "type": "error", "param": None, "code": None}
    }
    page.route(
        "**/v1/sessions/*/messages",
        lambda route: route.fulfill(
            status=status,
            content_type="application/json",
            body=json.dumps(error),
            headers={"Retry-After": "3"},
        ),
    )
    send_message(page, "this text must survive")
    page.wait_for_selector("#error:not([hidden])")
    assert words in page.locator("#error-text").inner_text()
    assert "simulated refusal" in page.locator("#error-text").inner_text()
    assert page.locator("#composer-input").input_value() == "this text must survive"
    assert page.locator("#messages .message").count() == 0  # the refused turn is not shown as sent
    assert page.locator("#settings").evaluate("(d) => d.open") == (status == 401)


@pytest.mark.slow
def test_sidebar_lists_renames_and_deletes_sessions(browser: Any, server: RunningServer) -> None:
    made = [
        httpx.post(
            server.url("/v1/sessions"),
            json={"title": f"sidebar chat {i}", "source": "ui"},  # the sidebar lists the UI's chats
            timeout=10,
        ).json()
        for i in range(2)
    ]
    page = open_page(browser, server.url("/"))
    page.wait_for_selector(f'#session-list [data-id="{made[1]["id"]}"]')
    titles = page.locator("#session-list .session-title").all_inner_texts()
    assert titles.index("sidebar chat 1") < titles.index("sidebar chat 0")  # newest first

    item = page.locator(f'#session-list [data-id="{made[0]["id"]}"]')
    item.locator(".rename").click()
    page.fill("#session-list .rename-input", "renamed chat")
    page.press("#session-list .rename-input", "Enter")
    page.wait_for_selector("#session-list .session-title:text-is('renamed chat')")
    assert (
        httpx.get(server.url(f"/v1/sessions/{made[0]['id']}"), timeout=10).json()["title"]
        == "renamed chat"
    )

    item.locator(".session-link").click()
    page.wait_for_function("(id) => location.search.includes(id)", arg=made[0]["id"])
    # (the address changes first; the title once the session is read)
    page.wait_for_selector("#chat-title:text-is('renamed chat')")
    page.once("dialog", lambda dialog: dialog.accept())
    item.locator(".delete").click()
    wait_until(lambda: item.count() == 0, 10, "the deleted session to leave the list")
    assert httpx.get(server.url(f"/v1/sessions/{made[0]['id']}"), timeout=10).status_code == 404
    assert "s=" not in page.url and page.locator("#chat-title").inner_text() == "New chat"
    assert page.errors == []
    page.context.close()


def test_the_sidebar_says_when_chats_live_only_in_memory(
    browser: Any, server: RunningServer
) -> None:
    durable = open_page(browser, server.url("/"))  # the default store: a SQLite file
    durable.wait_for_function("() => fetch('/health').then(r => r.ok)")
    durable.wait_for_timeout(300)
    assert durable.locator("#sessions-volatile").is_hidden()
    durable.context.close()
    with running_server("--session-store", "memory") as volatile_server:
        page = open_page(browser, volatile_server.url("/"))
        page.wait_for_selector("#sessions-volatile", state="visible")
        assert "gone when it restarts" in page.locator("#sessions-volatile").inner_text()
        assert page.errors == []
        page.context.close()


@pytest.mark.slow
def test_phone_width_hides_the_sidebar_behind_a_button(browser: Any, server: RunningServer) -> None:
    page = open_page(browser, server.url("/"), viewport={"width": 390, "height": 800})
    assert not page.locator("#sidebar").is_visible()
    page.click("#open-sidebar")
    page.wait_for_selector("#sidebar", state="visible")
    assert page.locator("#open-sidebar").get_attribute("aria-expanded") == "true"
    assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
    page.context.close()
