"""The chat UI's choices per chat (web/chat_settings.js): a model picker when the server serves several names,
and a chat's own system prompt (stored by the server through PATCH /v1/sessions/{id}) and sampling (kept in the
browser) that the chat's next turns use, a branch inherits, and "Use the defaults" drops. Headless Chromium against
tests/fake_chat_server.py (no model)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_chat_server import FakeChat, chunk, fake_chat_server, usage_chunk
from tests.web_harness import (
    browser_fixture,
    mark_replies_seen,
    open_page,
    send_message,
    wait_for_reply,
)

browser = browser_fixture()

DEFAULTS = {"temperature": 0.7, "maxTokens": 64, "apiKey": ""}


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeChat, str]]:
    chat = FakeChat(models=["small", "large"])
    chat.script = [chunk({"content": "Fine."}), chunk({}, "stop"), usage_chunk(9, 2, 0)]
    chat.reply_to_store = {"role": "assistant", "content": "Fine."}
    with fake_chat_server(chat) as url:
        yield chat, url


@pytest.fixture
def page(browser: Any, fake: tuple[FakeChat, str]) -> Iterator[Any]:
    page = open_page(browser, fake[1] + "/", settings=DEFAULTS)
    yield page
    assert page.errors == []
    page.context.close()


def sampling(turn: dict[str, Any]) -> dict[str, Any]:
    return {k: turn.get(k) for k in ("model", "temperature", "top_p", "max_tokens")}


def test_the_model_picker_and_a_chats_own_settings_reach_its_turns(
    page: Any, fake: tuple[FakeChat, str]
) -> None:
    chat, _ = fake
    page.wait_for_selector("#model-row:not([hidden])")
    assert page.locator("#model-select option").all_text_contents() == ["small", "large"]
    page.select_option("#model-select", "large")
    send_message(page, "hello")
    wait_for_reply(page)
    assert sampling(chat.turns[-1]) == {
        "model": "large",
        "temperature": 0.7,
        "top_p": None,
        "max_tokens": 64,
    }

    page.click("#chat-menu-button")
    page.click("#menu-chat-settings")
    assert page.input_value("#chat-model") == "large"
    assert page.input_value("#chat-system") == ""
    page.fill("#chat-system", "Answer in one word.")
    page.fill("#chat-temperature", "0.3")
    page.fill("#chat-top-p", "0.9")
    page.fill("#chat-max-tokens", "100")
    page.click("#chat-settings-save")
    page.wait_for_selector("#chat-settings", state="hidden")
    assert chat.patches[-1] == {"system": "Answer in one word."}
    assert page.text_content("#system-text") == "Answer in one word."

    send_message(page, "again")
    wait_for_reply(page)
    assert sampling(chat.turns[-1]) == {
        "model": "large",
        "temperature": 0.3,
        "top_p": 0.9,
        "max_tokens": 100,
    }

    # a branch (regenerating the first reply forks before it) starts with the chat's settings
    mark_replies_seen(page)
    page.locator("#messages .message.assistant").first.locator(".regenerate").click()
    wait_for_reply(page)
    assert chat.turns[-1]["content"] == "hello"
    assert sampling(chat.turns[-1]) == {
        "model": "large",
        "temperature": 0.3,
        "top_p": 0.9,
        "max_tokens": 100,
    }

    page.reload()  # kept: the system prompt by the server, the sampling by the browser
    page.wait_for_selector("#system-view:not([hidden])")
    page.click("#chat-menu-button")
    page.click("#menu-chat-settings")
    assert page.input_value("#chat-max-tokens") == "100"
    assert page.input_value("#chat-model") == "large"
    page.click("#chat-settings-reset")  # the ⚙ defaults, the primary model
    page.fill("#chat-system", "")
    page.select_option("#chat-model", "small")
    page.click("#chat-settings-save")
    page.wait_for_selector("#chat-settings", state="hidden")
    assert chat.patches[-1] == {"system": None}
    assert page.locator("#system-view").is_hidden()
    send_message(page, "third")
    wait_for_reply(page)
    assert sampling(chat.turns[-1]) == {
        "model": None,
        "temperature": 0.7,
        "top_p": None,
        "max_tokens": 64,
    }


def test_a_single_model_hides_the_picker_and_a_refused_change_is_shown(
    page: Any, fake: tuple[FakeChat, str]
) -> None:
    chat, url = fake
    chat.models = ["only"]
    try:
        page.reload()
        page.wait_for_function("() => document.querySelector('#model-select').options.length === 1")
        assert page.locator("#model-row").is_hidden()
        send_message(page, "hi")
        wait_for_reply(page)
        assert "model" not in chat.turns[-1]
        page.click("#chat-menu-button")
        page.click("#menu-chat-settings")
        assert page.locator("#chat-model-row").is_hidden()
        # the server refuses the prompt (as pagedchat does for one past --max-system-prompt-chars)
        page.fill("#chat-system", "x" * 40_000)
        chat.refuse_patch = (400, "system is longer than 32768 characters")
        page.click("#chat-settings-save")
        page.wait_for_selector("#chat-settings-error:not([hidden])")
        assert "32768" in page.text_content("#chat-settings-error")
        assert page.locator("#chat-settings").is_visible()  # kept open, the text kept
        assert len(page.input_value("#chat-system")) == 40_000
    finally:
        chat.models = ["small", "large"]
        chat.refuse_patch = None
