"""The browser UI's branches, search, export/import, copy and shortcuts (issue 53), in headless Chromium against
one real server with the default model: editing a message or regenerating a reply forks the chat (POST
/v1/sessions/{id}/fork) and the branches are switched with a `< i/n >` control derived from the server's links;
the sidebar's search box asks GET /v1/sessions?q=; the chat menu exports and imports.

Replies are 8 tokens long; the chats the tests need without the UI are made through the API."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_harness import RunningServer, server_fixture
from tests.web_harness import (
    REPLY_TIMEOUT_MS,
    browser_fixture,
    open_page,
    send_message,
    session_id_of,
    wait_for_reply,
)

server = server_fixture()
browser = browser_fixture()

TINY = {"temperature": 0.0, "maxTokens": 8, "apiKey": ""}
BLOCK_SIZE = 16  # engine/config.py's default: only whole blocks of a prompt are cached

pytestmark = pytest.mark.slow


def open_chat_page(browser: Any, url: str) -> Any:
    page = open_page(browser, url, TINY)
    page.dialogs = []
    return page


def close(page: Any) -> None:
    assert page.errors == [], page.errors
    page.context.close()


def get_session(server: RunningServer, session_id: str) -> dict[str, Any]:
    response = httpx.get(server.url(f"/v1/sessions/{session_id}"), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_branch(page: Any, position: str) -> None:
    """Wait until the first user message's switch shows ``position`` ("1/2")."""
    page.wait_for_selector(
        f"#messages .message.user >> nth=0 >> .branch-position:text-is('{position}')",
        timeout=20_000,
    )


def wait_for_replies(page: Any, count: int) -> Any:
    """Wait until the page shows ``count`` replies, the last one finished (a fork first shows the replies it
    kept, then streams its new one); return the last."""
    page.wait_for_function(
        "(n) => { const r = document.querySelectorAll('#messages .message.assistant');"
        " const last = r[r.length - 1];"
        " return r.length === n && !last.classList.contains('streaming')"
        " && last.querySelector('.stats').textContent !== ''; }",
        arg=count,
        timeout=REPLY_TIMEOUT_MS,
    )
    return page.locator("#messages .message.assistant").last


def chat_through_api(server: RunningServer, text: str, source: str | None = "ui") -> dict[str, Any]:
    """A session with one short turn, made through the API; its stored JSON."""
    body = {"source": source} if source else {}
    session = httpx.post(server.url("/v1/sessions"), json=body, timeout=10).json()
    turn = httpx.post(
        server.url(f"/v1/sessions/{session['id']}/messages"),
        json={"content": text, "max_tokens": 8, "temperature": 0.0},
        timeout=60,
    )
    assert turn.status_code == 200, turn.text
    return get_session(server, session["id"])


def test_editing_the_first_message_forks_and_both_branches_survive_a_reload(
    browser: Any, server: RunningServer
) -> None:
    page = open_chat_page(browser, server.url("/"))
    for text in ["Name a colour.", "Name a fruit.", "Name an animal."]:
        send_message(page, text)
        wait_for_reply(page)
    original = session_id_of(page)
    assert page.locator("#messages .message.user").count() == 3

    first = page.locator("#messages .message.user").first
    first.locator(".edit").click()
    page.fill("#messages .message-editor textarea", "Name a city.")
    page.press("#messages .message-editor textarea", "Enter")
    page.wait_for_function("(id) => !location.search.includes(id)", arg=original)
    reply = wait_for_replies(page, 1)
    fork = session_id_of(page)
    assert fork != original
    stored = get_session(server, fork)
    assert stored["parent_id"] == original and stored["forked_at_turn"] == 0
    assert [m["content"] for m in stored["messages"] if m["role"] == "user"] == ["Name a city."]
    # the cached tokens the UI shows for the fork's first turn are the server's
    usage = stored["messages"][-1]["usage"]
    assert (
        int(reply.locator(".stats").get_attribute("data-cached-tokens")) == usage["cached_tokens"]
    )
    # what the branches share at turn 0 is the template's start (the default model's system prompt: over a
    # block); its whole blocks come from the cache
    assert BLOCK_SIZE <= usage["cached_tokens"] < usage["prompt_tokens"], usage
    wait_for_branch(page, "2/2")
    assert page.locator("#messages .message").count() == 2

    page.get_by_role("button", name="Previous version").first.click()
    page.wait_for_function("(id) => location.search.includes(id)", arg=original)
    wait_for_branch(page, "1/2")
    assert page.locator("#messages .message.user").count() == 3

    page.reload()
    wait_for_branch(page, "1/2")  # the branches come from the server's links
    assert page.locator("#messages .message.user").count() == 3
    # one sidebar entry for the conversation, not one per branch
    assert page.locator(f'#session-list [data-id="{original}"]').count() == 1
    assert page.locator(f'#session-list [data-id="{fork}"]').count() == 0
    page.get_by_role("button", name="Next version").first.click()
    page.wait_for_function("(id) => location.search.includes(id)", arg=fork)
    wait_for_branch(page, "2/2")
    assert page.locator("#messages .message.user").first.locator(".content").inner_text() == (
        "Name a city."
    )
    # the sidebar's entry opens the branch opened last
    page.goto(server.url("/"))
    page.locator(f'#session-list [data-id="{original}"] .session-link').click()
    page.wait_for_function("(id) => location.search.includes(id)", arg=fork)
    close(page)


def test_regenerating_an_earlier_reply_forks_on_the_cached_prefix(
    browser: Any, server: RunningServer
) -> None:
    page = open_chat_page(browser, server.url("/"))
    for text in ["Count to three.", "Now count to five."]:
        send_message(page, text)
        wait_for_reply(page)
    original = get_session(server, session_id_of(page))
    page.locator("#messages .message.assistant").nth(1).locator(".regenerate").click()
    page.wait_for_function(
        "(id) => !location.search.includes(id)", arg=original["id"], timeout=20_000
    )
    reply = wait_for_replies(page, 2)
    fork = get_session(server, session_id_of(page))
    assert fork["parent_id"] == original["id"] and fork["forked_at_turn"] == 1
    assert [m["content"] for m in fork["messages"] if m["role"] == "user"] == [
        "Count to three.",
        "Now count to five.",
    ]
    # the first turn (its prompt and reply) is shared: all of its whole blocks come from the cache
    first = original["messages"][1]["usage"]
    shared = first["prompt_tokens"] + first["completion_tokens"]
    cached = int(reply.locator(".stats").get_attribute("data-cached-tokens"))
    assert cached >= shared - BLOCK_SIZE, (cached, shared)
    assert cached < int(reply.locator(".stats").get_attribute("data-prompt-tokens"))
    # the switch sits at the second turn's message
    page.wait_for_selector(
        "#messages .message.user >> nth=1 >> .branch-position:text-is('2/2')", timeout=20_000
    )
    assert page.locator("#messages .message.user").first.locator(".branch-switch").count() == 0
    close(page)


def test_search_finds_a_word_from_a_reply_in_another_chat(
    browser: Any, server: RunningServer
) -> None:
    target = chat_through_api(server, "Write one sentence about the sea.")
    reply = target["messages"][-1]["content"]
    words = [w for w in re.findall(r"[A-Za-z]{4,}", reply)]
    assert words, f"no word to search for in {reply!r}"
    word = words[0]
    page = open_chat_page(browser, server.url("/"))
    page.keyboard.press("Control+k")
    assert page.evaluate("() => document.activeElement.id") == "chat-search"
    page.keyboard.type(word.upper())  # case-insensitive
    result = page.locator(f'#search-results [data-id="{target["id"]}"]')
    result.wait_for(timeout=10_000)
    assert word.lower() in result.locator(".snippet").inner_text().lower()
    assert page.locator("#session-list").is_hidden()
    first_id = page.locator("#search-results .search-result").first.get_attribute("data-id")
    page.keyboard.press("Enter")
    page.wait_for_function("(id) => location.search.includes(id)", arg=first_id)
    page.wait_for_selector("#messages .message.assistant")

    # `/` focuses the message box when not typing; Ctrl+Shift+O starts a new chat
    page.evaluate("() => document.activeElement.blur()")
    assert page.evaluate("() => document.activeElement === document.body")
    page.keyboard.press("/")
    assert page.evaluate("() => document.activeElement.id") == "composer-input"
    page.keyboard.press("Control+Shift+O")
    page.wait_for_function("() => !location.search.includes('s=')")
    assert page.locator("#chat-title").inner_text() == "New chat"
    close(page)


def test_sidebar_keeps_api_chats_apart_and_the_menu_pins_and_renames(
    browser: Any, server: RunningServer
) -> None:
    ui_chat = httpx.post(server.url("/v1/sessions"), json={"source": "ui"}, timeout=10).json()
    api_chat = httpx.post(server.url("/v1/sessions"), json={"title": "from a script"}).json()
    page = open_chat_page(browser, server.url(f"/?s={ui_chat['id']}"))
    page.wait_for_selector(f'#session-list [data-id="{ui_chat["id"]}"]')
    assert page.locator(f'#session-list [data-id="{api_chat["id"]}"]').count() == 0
    page.get_by_label("Show API chats").check()
    page.wait_for_selector(f'#session-list [data-id="{api_chat["id"]}"]')
    page.get_by_label("Show API chats").uncheck()
    page.wait_for_selector(f'#session-list [data-id="{api_chat["id"]}"]', state="detached")

    page.once("dialog", lambda dialog: dialog.accept("kept chat"))
    page.get_by_role("button", name="Chat menu").click()
    page.get_by_role("menuitem", name="Rename", exact=True).click()
    page.wait_for_selector("#chat-title:text-is('kept chat')")
    page.get_by_role("button", name="Chat menu").click()
    page.get_by_role("menuitem", name="Pin", exact=True).click()
    item = page.locator(f'#session-list [data-id="{ui_chat["id"]}"]')
    item.locator(".pinned-mark").wait_for(state="visible")
    assert (
        page.locator("#session-list .session-item").first.get_attribute("data-id")
        == (ui_chat["id"])
    )
    stored = get_session(server, ui_chat["id"])
    assert stored["title"] == "kept chat" and stored["pinned"] is True
    close(page)


def test_export_json_then_import_gives_the_same_messages_and_replies_copy(
    browser: Any, server: RunningServer, tmp_path: Path
) -> None:
    chat = chat_through_api(server, "Say something short.", source=None)  # an API chat
    page = open_chat_page(browser, server.url(f"/?s={chat['id']}"))
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    reply = page.locator("#messages .message.assistant").first
    reply.wait_for()
    reply.locator(".copy-reply").click()
    page.wait_for_selector("#messages .message.assistant .copy-reply.copied:text-is('Copied')")
    assert page.evaluate("() => navigator.clipboard.readText()") == chat["messages"][-1]["content"]

    page.get_by_role("button", name="Chat menu").click()
    with page.expect_download() as download:
        page.get_by_role("menuitem", name="Export as Markdown").click()
    markdown = Path(download.value.path()).read_text()
    assert "Say something short." in markdown

    page.get_by_role("button", name="Chat menu").click()
    with page.expect_download() as download:
        page.get_by_role("menuitem", name="Export as JSON").click()
    exported_path = tmp_path / "chat.json"
    download.value.save_as(exported_path)
    exported = json.loads(exported_path.read_text())
    assert [m["content"] for m in exported["messages"]] == [m["content"] for m in chat["messages"]]

    page.set_input_files("#import-file", str(exported_path))
    page.wait_for_function(
        "(id) => /[?&]s=/.test(location.search) && !location.search.includes(id)", arg=chat["id"]
    )
    imported = get_session(server, session_id_of(page))
    assert imported["id"] != chat["id"] and imported["source"] == "ui"
    page.wait_for_selector(f'#session-list [data-id="{imported["id"]}"] [aria-current="page"]')
    assert [(m["role"], m["content"]) for m in imported["messages"]] == [
        (m["role"], m["content"]) for m in chat["messages"]
    ]
    page.wait_for_selector("#messages .message.assistant")
    shown = page.locator("#messages .message.assistant").first.get_attribute("data-text")
    assert shown == chat["messages"][-1]["content"]
    close(page)


def test_escape_stops_a_streaming_reply_from_anywhere_on_the_page(
    browser: Any, server: RunningServer
) -> None:
    page = open_page(browser, server.url("/"), {"temperature": 0.0, "maxTokens": 400, "apiKey": ""})
    page.dialogs = []
    send_message(page, "Write a very long essay about the history of the sea, with many chapters.")
    page.wait_for_function(
        "() => (document.querySelector('.message.assistant.streaming .content')"
        " || {}).textContent?.length > 10",
        timeout=60_000,
    )
    page.evaluate("() => document.activeElement.blur()")  # not from the message box only
    page.keyboard.press("Escape")
    reply = wait_for_reply(page, timeout_ms=10_000)
    assert "stopped" in reply.locator(".stats").inner_text()
    # the header's totals follow once the server has stored the stopped turn
    page.wait_for_selector("#session-stats:text-matches('^1 turns')", timeout=15_000)
    stored = get_session(server, session_id_of(page))
    assert stored["messages"][-1]["finish_reason"] == "abort"
    close(page)


def test_an_api_chat_opened_by_its_address_shows_its_branches(
    browser: Any, server: RunningServer
) -> None:
    parent = chat_through_api(server, "Say hi.", source=None)
    fork = httpx.post(server.url(f"/v1/sessions/{parent['id']}/fork"), json={"turn": 0}).json()
    turn = httpx.post(
        server.url(f"/v1/sessions/{fork['id']}/messages"),
        json={"content": "Say hello.", "max_tokens": 8, "temperature": 0.0},
        timeout=60,
    )
    assert turn.status_code == 200, turn.text
    page = open_chat_page(browser, server.url(f"/?s={fork['id']}"))
    wait_for_branch(page, "2/2")  # though the sidebar (the UI's chats) does not list it
    assert page.locator(f'#session-list [data-id="{parent["id"]}"]').count() == 0
    close(page)
