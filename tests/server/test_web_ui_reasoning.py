"""The browser UI shows a reply's reasoning (a collapsed block above it, streamed) and its tool calls (a card
each under it, with the tool's result on its call's card), live and from a stored session; hostile text in any
of them stays text. Driven in headless Chromium against a fake API (tests/fake_chat_server.py) that streams
OpenAI's chunk shapes: no model needed."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_chat_server import FakeChat, chunk, fake_chat_server, usage_chunk
from tests.web_harness import browser_fixture, open_page, send_message, wait_for_reply

browser = browser_fixture()

HOSTILE = "<img src=x onerror=alert(1)> [x](javascript:alert(1)) <script>alert(2)</script>"
WAIT_MS = 15_000


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeChat, str]]:
    chat = FakeChat()
    with fake_chat_server(chat) as url:
        yield chat, url


@pytest.fixture
def page(browser: Any, fake: tuple[FakeChat, str]) -> Iterator[Any]:
    page = open_page(browser, fake[1] + "/")
    page.dialogs = []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    yield page
    assert page.errors == [] and page.dialogs == [], (page.errors, page.dialogs)
    page.context.close()


def assert_inert(page: Any) -> None:
    messages = page.locator("#messages")
    assert messages.locator("img, script, iframe, svg").count() == 0
    hrefs = messages.evaluate(
        "(m) => [...m.querySelectorAll('[href]')].map((a) => a.getAttribute('href'))"
    )
    assert not [h for h in hrefs if "javascript" in h.lower()], hrefs
    handlers = messages.evaluate(
        "(m) => [...m.querySelectorAll('*')].flatMap((e) => e.getAttributeNames())"
        ".filter((a) => a.startsWith('on'))"
    )
    assert handlers == []


def call_fragment(index: int, arguments: str, call_id: str = "", name: str = "") -> dict[str, Any]:
    """A delta.tool_calls fragment: a call's first one carries its id and name."""
    fragment: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        fragment |= {"id": call_id, "type": "function"}
        fragment["function"]["name"] = name
    return chunk({"tool_calls": [fragment]})


def test_reasoning_streams_collapsed_then_tool_calls_stream_into_cards(
    page: Any, fake: tuple[FakeChat, str]
) -> None:
    chat, _ = fake
    thinking_seen, partial_call_seen = threading.Event(), threading.Event()
    reasoning = ["The user wants the weather. ", HOSTILE, " so **Paris** it is."]
    weather_args = ['{"city": "Par', 'is", "unit": "C"}']
    time_args = ['{"tz":', ' "Europe/Paris"}']
    chat.script = [
        chunk({"role": "assistant", "content": ""}),
        *[chunk({"reasoning_content": text}) for text in reasoning],
        thinking_seen,
        chunk({"content": "Let me check."}),
        call_fragment(0, "", "call_w", "get_weather"),
        call_fragment(0, weather_args[0]),
        partial_call_seen,
        call_fragment(0, weather_args[1]),
        call_fragment(1, time_args[0], "call_t", "get_time"),
        call_fragment(1, time_args[1]),
        chunk({}, finish_reason="tool_calls"),
        usage_chunk(prompt_tokens=40, completion_tokens=25, cached_tokens=8),
    ]
    chat.reply_to_store = {"role": "assistant", "content": "Let me check."}
    send_message(page, "Weather in Paris?")

    reply = page.locator("#messages .message.assistant.streaming")
    block = reply.locator(".reasoning")
    page.wait_for_function(
        "() => (document.querySelector('.message.assistant.streaming .reasoning-text') || {})"
        ".textContent?.includes('Paris it is.')",
        timeout=WAIT_MS,
    )
    assert block.is_visible() and block.evaluate("(d) => d.open") is False
    assert block.locator(".reasoning-summary").inner_text() == "Thinking…"
    assert reply.locator(".content").inner_text() == ""
    assert page.locator("#stop").is_visible()
    # shown as text: the hostile markup is in the block's text, not in its elements
    assert "<img src=x onerror=alert(1)>" in block.evaluate("(d) => d.textContent")
    assert_inert(page)

    thinking_seen.set()
    page.wait_for_selector(".message.assistant.streaming .tool-call", timeout=WAIT_MS)
    page.wait_for_function(
        "(raw) => document.querySelector('.tool-call .tool-call-arguments').textContent === raw",
        arg=weather_args[0],
        timeout=WAIT_MS,
    )
    assert re.fullmatch(r"Thought for \d+ s", block.locator(".reasoning-summary").inner_text())
    card = reply.locator(".tool-call").first
    assert card.locator(".tool-call-name").inner_text() == "get_weather"
    assert card.get_attribute("data-complete") is None  # still streaming: raw text

    partial_call_seen.set()
    done = wait_for_reply(page, timeout_ms=WAIT_MS)
    cards = done.locator(".tool-call")
    assert cards.count() == 2
    for i, (name, call_id, parts) in enumerate(
        [("get_weather", "call_w", weather_args), ("get_time", "call_t", time_args)]
    ):
        card = cards.nth(i)
        assert card.locator(".tool-call-name").inner_text() == name
        assert card.get_attribute("data-call-id") == call_id
        assert card.get_attribute("data-complete") == "true"
        pretty = json.dumps(json.loads("".join(parts)), indent=2)
        assert card.locator(".tool-call-arguments").text_content() == pretty
    assert done.get_attribute("data-text") == "Let me check."
    assert done.locator(".reasoning").get_attribute("data-text") == "".join(reasoning)
    assert done.locator(".reasoning").evaluate("(d) => d.open") is False
    stats = done.locator(".stats").inner_text()
    assert "25 tokens" in stats and "prompt 40 tokens (8 cached)" in stats, stats
    assert done.locator(".regenerate").is_visible()
    done.locator(".reasoning-summary").click()  # opens on a click
    assert done.locator(".reasoning-text").is_visible()
    assert_inert(page)


def stored_tool_turn() -> list[dict[str, Any]]:
    """A conversation as GET /v1/sessions/{id} returns it: a reply that thought and called two tools, their
    results (one hostile, one answering no call of that reply), and the final answer."""
    usage = {"prompt_tokens": 30, "completion_tokens": 12, "cached_tokens": 0}
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        },
        {
            "id": "call_2",
            "type": "function",
            "function": {"name": HOSTILE, "arguments": "not json {"},
        },
    ]
    return [
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two tools. " + HOSTILE,
            "tool_calls": calls,
            "finish_reason": "tool_calls",
            "usage": usage,
        },
        {"role": "tool", "tool_call_id": "call_2", "content": '{"time":"12:00"}'},
        {"role": "tool", "tool_call_id": "call_1", "content": HOSTILE},
        {"role": "tool", "tool_call_id": "call_elsewhere", "content": "an orphan result"},
        {
            "role": "assistant",
            "content": "Sunny, and noon.",
            "finish_reason": "stop",
            "usage": usage,
        },
    ]


def test_a_stored_reply_shows_its_reasoning_calls_and_results_inert(
    page: Any, fake: tuple[FakeChat, str]
) -> None:
    chat, url = fake
    chat.add_session("storedtoolsession0001", stored_tool_turn(), title="tools")
    page.goto(f"{url}/?s=storedtoolsession0001")  # as a reload finds it
    page.wait_for_selector("#messages .message.assistant .tool-call", timeout=WAIT_MS)

    roles = page.locator("#messages .message").evaluate_all("(ms) => ms.map((m) => m.dataset.role)")
    assert roles == ["user", "assistant", "tool", "assistant"]  # results sit on their calls' cards
    first = page.locator("#messages .message.assistant").first
    block = first.locator(".reasoning")
    assert block.is_visible() and block.evaluate("(d) => d.open") is False
    assert block.locator(".reasoning-summary").inner_text() == "Thoughts"
    assert block.get_attribute("data-text") == "Two tools. " + HOSTILE
    assert first.get_attribute("data-text") == ""

    cards = first.locator(".tool-call")
    assert cards.count() == 2
    weather, hostile = cards.nth(0), cards.nth(1)
    assert weather.locator(".tool-call-arguments").text_content() == json.dumps(
        {"city": "Paris"}, indent=2
    )
    assert weather.locator(".tool-result-text").text_content() == HOSTILE
    assert hostile.locator(".tool-call-name").text_content() == HOSTILE
    assert hostile.locator(".tool-call-arguments").text_content() == "not json {"
    assert hostile.get_attribute("data-invalid-arguments") == "true"
    assert hostile.locator(".tool-result-text").text_content() == json.dumps(
        {"time": "12:00"}, indent=2
    )
    orphan = page.locator("#messages .message.tool")
    assert orphan.locator(".content").inner_text() == "an orphan result"
    last = page.locator("#messages .message.assistant").last
    assert last.locator(".reasoning").is_hidden() and last.locator(".tool-calls").is_hidden()
    assert last.locator(".regenerate").is_visible()
    assert "prompt 30 tokens" in last.locator(".stats").inner_text()
    page.wait_for_timeout(200)  # let any injected handler fire
    assert_inert(page)
