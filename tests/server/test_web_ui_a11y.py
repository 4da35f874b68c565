"""The browser UI's accessibility (issue 53's "Access"). axe-core finds no serious or critical WCAG 2.1 A/AA
violation in the states a user sees (the new-chat draft with an error, a reply streaming, search results, an
open chat with markdown, reasoning, a tool call, math and a branch switch, the chat menu, the settings dialog,
the chat's settings dialog, a message being edited), in the light and the dark theme, at desktop and phone
width; text fields' edges stand out 3:1 (which axe does not check). For the keyboard and screen readers: the
header's ⋯ chat menu follows the ARIA menu-button pattern, the phone's chat drawer holds the focus while open,
deleting a chat keeps the focus in the list, a branch switch keeps it on the switch, search says how many chats
matched, the API key's field says why it is asked for.

axe-core is vendored for the tests only (tests/data/axe-core, not served by the app) and injected into the page;
the page's Content-Security-Policy allows only its own scripts, so the test contexts bypass it. Driven in
headless Chromium against the fake API (tests/fake_chat_server.py): no model needed."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_chat_server import FakeChat, chunk, fake_chat_server, usage_chunk
from tests.web_harness import (
    browser_fixture,
    open_page,
    preset_settings,
    send_message,
    wait_for_reply,
)

browser = browser_fixture()

AXE = Path(__file__).resolve().parents[1] / "data" / "axe-core" / "axe.min.js"
WCAG_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]
BLOCKING = {"serious", "critical"}
WAIT_MS = 15_000
# tall enough that the whole open chat shows without scrolling: axe cannot tell the contrast of text that a
# scrolled box clips ("partially obscured"), and would skip it
DESKTOP = {"width": 1280, "height": 1400}
PHONE = {"width": 320, "height": 2400}  # WCAG 1.4.10's reflow width: no sideways scrolling
ROOT_ID = "a11yroot0000000000001"
BRANCH_ID = "a11ybranch00000000001"
MISSING_ID = "a11ygone0000000000001"

REPLY = """Here is the script, the numbers and [the docs](https://example.org/docs).

```python
def forecast(city: str) -> str:
    return f"Sunny in {city}"
```

| city | °C |
| --- | --- |
| Paris | 21 |
| Oslo | 9 |

Use `forecast("Paris")`; the mean is $\\bar{t} = \\frac{1}{n}\\sum_i t_i$.
> It rarely rains.

$$\\int_0^1 x^2 \\, dx = \\frac{1}{3}$$
"""


def weather_turn() -> list[dict[str, Any]]:
    """A stored turn as GET /v1/sessions/{id} returns it: a reply that thought and called a tool, the tool's
    result, and the final answer in markdown with its usage."""
    usage = {"prompt_tokens": 52, "completion_tokens": 61, "cached_tokens": 16}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    return [
        {"role": "user", "content": "What is the weather in Paris? Show code."},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "The user wants the weather: call **get_weather**.",
            "tool_calls": [call],
            "finish_reason": "tool_calls",
            "usage": usage,
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "c": 21}'},
        {
            "role": "assistant",
            "content": REPLY,
            "finish_reason": "stop",
            "usage": usage,
            "timing": {"ttft_s": 0.12, "decode_tokens_per_s": 48.5},
        },
    ]


def seed(chat: FakeChat) -> None:
    """Two branches of one conversation (the second forked at turn 0, so its first message has a `< 2/2 >`
    switch), found by search with a snippet; two served models (so the model pickers show)."""
    chat.models = ["fake", "fake-large"]
    chat.add_session(ROOT_ID, weather_turn()[:1] + [{"role": "assistant", "content": "Sunny."}])
    chat.add_session(BRANCH_ID, weather_turn(), title="Weather in Paris")
    for session, turn in ((chat.sessions[ROOT_ID], None), (chat.sessions[BRANCH_ID], 0)):
        session |= {"title": "Weather in Paris", "source": "ui", "snippet": "…sunny in Paris…"}
        session |= {"parent_id": ROOT_ID if turn is not None else None, "forked_at_turn": turn}
    chat.sessions[BRANCH_ID]["created_at"] = chat.sessions[ROOT_ID]["created_at"] + 1
    chat.sessions[BRANCH_ID]["stats"] = {
        "num_turns": 1,
        "num_tokens": 113,
        "prompt_tokens": 52,
        "cached_tokens": 16,
    }


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeChat, str]]:
    chat = FakeChat()
    seed(chat)
    with fake_chat_server(chat) as base:
        yield chat, base


def pause_next_reply(chat: FakeChat) -> threading.Event:
    """The next turn's script: a reply that stops streaming midway until the returned Event is set."""
    paused = threading.Event()
    chat.script = [
        chunk({"role": "assistant", "content": "Sunny"}),
        paused,
        chunk({"content": " and warm."}, finish_reason="stop"),
        usage_chunk(prompt_tokens=12, completion_tokens=3, cached_tokens=0),
    ]
    chat.reply_to_store = {
        "role": "assistant",
        "content": "Sunny and warm.",
        "finish_reason": "stop",
    }
    return paused


def open_ui(browser: Any, url: str, theme: str, viewport: dict[str, int]) -> Any:
    page = open_page(browser, url, color_scheme=theme, viewport=viewport, bypass_csp=True)
    page.dialogs = []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    return page


def axe_violations(page: Any, scope: str | None = None) -> list[dict[str, Any]]:
    """axe-core's WCAG 2.1 A/AA violations on the page as it is now (in the element ``scope`` selects, else
    the whole page): rule id, impact and node targets."""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.add_script_tag(path=str(AXE))
    return page.evaluate(
        """async ([tags, scope]) => {
            const result = await axe.run(scope || document, {
                runOnly: { type: "tag", values: tags }, resultTypes: ["violations"],
            });
            return result.violations.map((v) => ({
                id: v.id, impact: v.impact,
                targets: v.nodes.map((n) => n.target.join(" ")),
            }));
        }""",
        [WCAG_TAGS, scope],
    )


def blocking(state: str, violations: list[dict[str, Any]]) -> list[str]:
    """One line per serious or critical violation: the state, rule id, impact and node targets."""
    return [
        f"{state}: {v['id']} ({v['impact']}) at {', '.join(v['targets'])}"
        for v in violations
        if v["impact"] in BLOCKING
    ]


def visit_states(page: Any, chat: FakeChat, phone: bool) -> Iterator[tuple[str, str | None]]:
    """Puts the page (opened at a chat that is gone) in each state a user sees, one after another; yields each
    state's name and the part of the page it changed (None: all of it), which is what axe then looks at."""
    page.wait_for_selector("#error", state="visible", timeout=WAIT_MS)
    page.wait_for_selector("#model-select", state="visible", timeout=WAIT_MS)
    yield "the new-chat draft (a model picker), an error shown", None

    paused = pause_next_reply(chat)
    send_message(page, "Weather in Oslo?")
    page.wait_for_function(
        "() => document.querySelector('.message.assistant.streaming .content')"
        "?.textContent.trim() === 'Sunny'",
        timeout=WAIT_MS,
    )
    yield "a reply streaming", ".main"

    paused.set()
    wait_for_reply(page, timeout_ms=WAIT_MS)

    if phone:
        page.click("#open-sidebar")
    page.fill("#chat-search", "sunny")
    result = page.locator(f'#search-results .search-result[data-id="{BRANCH_ID}"] a')
    result.wait_for(timeout=WAIT_MS)
    found = page.locator("#search-results .search-result").count()
    assert page.locator("#status").text_content() == f"{found} chats found."  # announced
    yield "search results", "#sidebar"

    result.click()
    page.wait_for_selector("#messages .tool-call .tool-result-text", timeout=WAIT_MS)
    page.wait_for_selector("#messages .branch-switch", timeout=WAIT_MS)
    page.wait_for_selector("#sidebar", state="hidden" if phone else "visible")
    assert page.locator("#messages .reasoning").first.evaluate("(d) => d.open") is False
    assert page.evaluate("() => document.documentElement.scrollWidth <= innerWidth")  # reflows
    # a tool call's card is a group named for its function (not one more landmark per call)
    assert page.get_by_role("group", name="Tool call get_weather").count() == 1
    yield "an open chat", None

    page.click("#chat-menu-button")
    page.wait_for_selector("#chat-menu", state="visible")
    yield "the chat menu open", "#chat-menu"

    page.keyboard.press("Escape")
    page.wait_for_selector("#chat-menu", state="hidden")
    page.click("#open-settings")
    page.wait_for_selector("#settings[open]")
    yield "the settings dialog open", "#settings"

    page.keyboard.press("Escape")
    page.wait_for_selector("#settings[open]", state="detached")
    page.click("#chat-menu-button")
    page.click("#menu-chat-settings")
    page.wait_for_selector("#chat-settings[open]")
    yield "the chat's settings dialog open", "#chat-settings"

    page.keyboard.press("Escape")
    page.wait_for_selector("#chat-settings[open]", state="detached")
    page.locator("#messages .message.user .edit").first.click()
    page.wait_for_selector("#messages .message-editor textarea")
    yield "a message being edited", ".message.editing"


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
@pytest.mark.parametrize("theme", ["light", "dark"])
def test_axe_finds_no_serious_violation(
    browser: Any, fake: tuple[FakeChat, str], theme: str, viewport: dict[str, int]
) -> None:
    chat, url = fake
    page = open_ui(browser, f"{url}/?s={MISSING_ID}", theme, viewport)
    assert page.evaluate("() => matchMedia('(prefers-color-scheme: dark)').matches") == (
        theme == "dark"
    )
    found: list[str] = []
    states = []
    for state, scope in visit_states(page, chat, phone=viewport is PHONE):
        states.append(state)
        found += blocking(state, axe_violations(page, scope))
    assert len(states) == 8
    assert not found, "\n".join(found)
    if viewport is DESKTOP:  # (where the sidebar's search box shows)
        assert_field_edges_stand_out(page)
    assert page.errors == [] and page.dialogs == [], (page.errors, page.dialogs)
    page.context.close()


def focused_id(page: Any) -> str:
    return page.evaluate("() => document.activeElement.id")


def test_chat_menu_follows_the_menu_button_pattern_from_the_keyboard(
    browser: Any, fake: tuple[FakeChat, str]
) -> None:
    page = open_ui(browser, f"{fake[1]}/?s={BRANCH_ID}", "light", DESKTOP)
    page.wait_for_selector("#messages .tool-call", timeout=WAIT_MS)
    button, menu = page.locator("#chat-menu-button"), page.locator("#chat-menu")
    assert button.get_attribute("aria-haspopup") == "menu" and menu.get_attribute("role") == "menu"
    items = menu.locator('[role="menuitem"]')
    ids = items.evaluate_all("(items) => items.map((i) => i.id)")
    assert len(ids) >= 6 and "menu-rename" in ids and ids[-1] == "menu-delete", ids
    # the items are reached with the arrows, not with Tab
    assert items.evaluate_all("(items) => items.map((i) => i.tabIndex)") == [-1] * len(ids)

    button.focus()
    page.keyboard.press("Enter")
    menu.wait_for(state="visible")
    assert button.get_attribute("aria-expanded") == "true"
    assert focused_id(page) == ids[0]
    last = len(ids) - 1
    steps = [
        ("ArrowDown", 1),
        ("ArrowDown", 2),
        ("ArrowUp", 1),
        ("ArrowUp", 0),
        ("ArrowUp", last),  # wraps to the last
        ("ArrowDown", 0),  # and back to the first
        ("End", last),
        ("Home", 0),
    ]
    for key, index in steps:
        page.keyboard.press(key)
        assert focused_id(page) == ids[index], key
    # the focused item shows it: the focus ring (an outline), which the menu's borderless items keep
    ring = page.evaluate("() => getComputedStyle(document.activeElement).outlineStyle")
    assert ring == "solid", ring

    page.keyboard.press("Escape")
    assert menu.is_hidden() and button.get_attribute("aria-expanded") == "false"
    assert focused_id(page) == "chat-menu-button"

    page.keyboard.press("ArrowUp")  # on the button: opens at the last item
    assert menu.is_visible() and focused_id(page) == ids[-1]
    page.keyboard.press("Tab")  # closes it; the focus moves on from the button
    assert menu.is_hidden() and button.get_attribute("aria-expanded") == "false"
    assert focused_id(page) == "open-settings"
    assert page.errors == [] and page.dialogs == [], (page.errors, page.dialogs)
    page.context.close()


def test_the_phone_drawer_holds_the_focus_until_closed(
    browser: Any, fake: tuple[FakeChat, str]
) -> None:
    page = open_ui(browser, fake[1] + "/", "light", PHONE)
    page.click("#open-sidebar")
    page.wait_for_selector("#sidebar", state="visible")
    where = (
        "() => { const e = document.activeElement;"
        " return e.closest('#sidebar') ? e.id || e.className : e.closest('.main') ? 'main' : 'page'; }"
    )
    reached: list[str] = []
    while reached.count("new-chat") < 2 and len(reached) < 60:  # round the drawer, back to its top
        page.keyboard.press("Tab")
        reached.append(page.evaluate(where))
    assert reached.count("new-chat") == 2, reached
    assert "main" not in reached, reached  # the chat behind the drawer is inert
    assert {"new-chat", "close-sidebar", "chat-search", "show-api-chats"} <= set(reached), reached

    page.mouse.click(PHONE["width"] - 20, PHONE["height"] // 2)  # a tap beside the drawer closes it
    page.wait_for_selector("#sidebar", state="hidden")
    assert page.evaluate("() => document.querySelector('.main').inert") is False
    page.click("#open-sidebar")
    page.wait_for_selector("#sidebar", state="visible")
    page.keyboard.press("Escape")
    page.wait_for_selector("#sidebar", state="hidden")
    assert focused_id(page) == "open-sidebar"
    assert page.errors == [] and page.dialogs == [], (page.errors, page.dialogs)
    page.context.close()


def test_deleting_a_chat_from_the_list_keeps_the_focus_in_the_list(
    browser: Any, fake: tuple[FakeChat, str]
) -> None:
    chat, url = fake
    doomed = "a11ydoomed00000000001"
    chat.add_session(doomed, [], title="A chat to delete")
    chat.sessions[doomed] |= {
        "source": "ui",
        "updated_at": chat.sessions[doomed]["created_at"] + 60,
    }
    page = open_page(browser, url + "/", bypass_csp=True)
    confirms: list[str] = []
    page.on("dialog", lambda dialog: (confirms.append(dialog.message), dialog.accept()))

    def delete(route: Any) -> None:  # (the fake API has no DELETE route)
        if route.request.method != "DELETE":
            return route.continue_()
        chat.sessions.pop(doomed)
        route.fulfill(json={"id": doomed, "object": "session.deleted", "deleted": True})

    page.route(f"**/v1/sessions/{doomed}", delete)
    items = page.locator("#session-list .session-item")
    items.first.wait_for(timeout=WAIT_MS)
    assert items.first.get_attribute("data-id") == doomed  # the newest: first
    after = items.nth(1).get_attribute("data-id")
    page.get_by_role("button", name="Delete “A chat to delete”").focus()
    page.keyboard.press("Enter")
    page.wait_for_selector(f'#session-list [data-id="{doomed}"]', state="detached")
    assert len(confirms) == 1 and "A chat to delete" in confirms[0]
    focused = page.evaluate("() => document.activeElement.closest('.session-item')?.dataset.id")
    assert focused == after  # the chat that followed it, not the top of the page
    assert page.errors == [], page.errors
    page.context.close()


def relative_luminance(css_rgb: str) -> float:
    """WCAG 2's relative luminance of a computed colour ("rgb(r, g, b)")."""
    channels = [int(c) / 255 for c in re.findall(r"\d+", css_rgb)[:3]]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    light, dark = sorted([relative_luminance(a), relative_luminance(b)], reverse=True)
    return (light + 0.05) / (dark + 0.05)


def assert_field_edges_stand_out(page: Any) -> None:
    """WCAG 1.4.11 (non-text contrast, which axe does not check): a text field's border is 3:1 against the
    field and against what surrounds it, for the message box (on the page) and the search box (on the
    sidebar)."""
    style = "(e, p) => getComputedStyle(e)[p]"
    for field, around in (("#composer-input", "body"), ("#chat-search", "#sidebar")):
        edge = page.locator(field).evaluate(style, "borderTopColor")
        for surface in (page.locator(field), page.locator(around)):
            ratio = contrast(edge, surface.evaluate(style, "backgroundColor"))
            assert ratio >= 3.0, (field, edge, round(ratio, 2))


def test_asked_for_an_api_key_the_key_field_is_described_by_the_reason(
    browser: Any, fake: tuple[FakeChat, str]
) -> None:
    from playwright.sync_api import expect

    context = browser.new_context()
    preset_settings(context, temperature=0.0, maxTokens=16, apiKey="")
    refused = {"error": {"message": "invalid API key", "type": "invalid_request_error"}}
    context.route("**/v1/models", lambda route: route.fulfill(status=401, json=refused))
    page = context.new_page()
    page.goto(fake[1] + "/")
    page.wait_for_selector("#settings[open]", timeout=WAIT_MS)
    page.wait_for_function("() => document.activeElement.id === 'api-key'")
    reason = page.locator("#settings-note").text_content()
    assert "API key" in reason
    expect(page.locator("#api-key")).to_have_accessible_description(reason)
    page.keyboard.press("Escape")  # opened without a reason, the field has no description
    page.click("#open-settings")
    expect(page.locator("#api-key")).to_have_accessible_description("")
    context.close()


def test_a_branch_switch_keeps_the_focus_on_the_switch(
    browser: Any, fake: tuple[FakeChat, str]
) -> None:
    page = open_ui(browser, f"{fake[1]}/?s={BRANCH_ID}", "light", DESKTOP)
    switch = page.locator("#messages .message.user .branch-switch").first
    switch.wait_for(timeout=WAIT_MS)
    assert switch.locator(".branch-position").inner_text() == "2/2"
    switch.get_by_role("button", name="Previous version").focus()
    page.keyboard.press("Enter")
    page.wait_for_function("(id) => location.search.includes(id)", arg=ROOT_ID)
    page.wait_for_selector("#messages .branch-position:text-is('1/2')", timeout=WAIT_MS)
    # at the first version "Previous" is disabled: its neighbour has the focus, not the message box
    label = page.evaluate("() => document.activeElement.getAttribute('aria-label')")
    assert label == "Next version"
    page.keyboard.press("Enter")
    page.wait_for_function("(id) => location.search.includes(id)", arg=BRANCH_ID)
    page.wait_for_selector("#messages .branch-position:text-is('2/2')", timeout=WAIT_MS)
    label = page.evaluate("() => document.activeElement.getAttribute('aria-label')")
    assert label == "Previous version"
    assert page.errors == [] and page.dialogs == [], (page.errors, page.dialogs)
    page.context.close()
