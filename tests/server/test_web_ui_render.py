"""The chat UI renders replies while they stream in time that grows with what arrived (web/stream_render.js):
fed any reply in pieces, it ends with what rendering the whole reply at once gives; code blocks come out
highlighted and formulas drawn by KaTeX (both vendored, loaded from the server, no network); and a 2,000-line code
reply streams with no task holding the page for 100 ms. Headless Chromium against tests/fake_chat_server.py (no
model)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_chat_server import FakeChat, chunk, fake_chat_server, usage_chunk
from tests.web_harness import browser_fixture, open_page, send_message, wait_for_reply

browser = browser_fixture()

SAMPLES = {
    "paragraphs and a closed fence": "Intro line\nsecond line\n\n```python\ndef f(x):\n    '''doc\n    more'''\n"
    "    return x  # done\n```\n\nAfter the code.",
    "tight and loose lists": "- one\n- two\n\n- three, loose\n\n1. first\n2. second\n\ntext",
    "table then heading": "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\nHeading\n=======\n\n> quoted\n> more",
    "an unclosed fence": "Here:\n```js\nconst a = 1; /* open\ncomment */\nlet b = `x${a}`",
    "an indented tilde fence": "  ~~~c\n  int main() {\n    return 0;\n  }\n  ~~~\nafter",
    "math": "Inline $a^2+b^2$ and \\(x\\), money $5 and $10.\n\n$$\n\\sum_{i=1}^n i\n$$\n\n\\[E=mc^2\\]",
    "a reference link": "See [the docs][d] now.\n\n[d]: https://example.com/docs\n",
    "a fence inside a list": "1. step\n   ```sh\n   ls -la\n   ```\n2. next",
    "long backtick fence": "````md\n```\nnested\n```\n````\nend",
}


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeChat, str]]:
    chat = FakeChat()
    with fake_chat_server(chat) as url:
        yield chat, url


def _page(browser: Any, url: str) -> Iterator[Any]:
    page = open_page(browser, url + "/")
    yield page
    assert page.errors == []
    page.context.close()


@pytest.fixture
def page(browser: Any, fake: tuple[FakeChat, str]) -> Iterator[Any]:
    yield from _page(browser, fake[1])


@pytest.fixture(scope="module")
def shared_page(browser: Any, fake: tuple[FakeChat, str]) -> Iterator[Any]:
    """One page for the tests that only call the UI's modules."""
    yield from _page(browser, fake[1])


def cuts(text: str, seed: int) -> list[int]:
    """Random cut points in ``text``: pieces of 1 to 12 characters, as a model's tokens arrive."""
    rng = random.Random(seed)
    points, at = [], 0
    while at < len(text):
        at = min(len(text), at + rng.randint(1, 12))
        points.append(at)
    return points


@pytest.mark.parametrize("name", SAMPLES)
def test_a_streamed_reply_ends_as_the_whole_reply_renders(shared_page: Any, name: str) -> None:
    text = SAMPLES[name]
    result = shared_page.evaluate(
        """async ([text, points]) => {
        const { StreamRenderer } = await import('/stream_render.js');
        const { renderInto } = await import('/markdown.js');
        const streamed = document.createElement('div');
        const whole = document.createElement('div');
        document.body.append(streamed, whole);
        const renderer = new StreamRenderer(streamed);
        for (const point of points) renderer.update(text.slice(0, point));
        renderer.finish(text);
        renderInto(whole, text);
        const undrawn = '.math-inline:not([data-drawn]), .math-display:not([data-drawn])';
        for (let i = 0; i < 100 && document.querySelector(undrawn); i++) {
            await new Promise((resolve) => setTimeout(resolve, 50));
        }
        const shape = (box) => ({
            blocks: [...box.children].map((e) => e.tagName + '.' + e.className),
            text: [...box.children].map((e) => e.textContent),
            code: [...box.querySelectorAll('pre code')].map((e) => e.textContent),
            highlighted: box.querySelectorAll('pre [class^=hljs-]').length > 0,
            formulas: box.querySelectorAll('.katex').length,
            links: [...box.querySelectorAll('a')].map((a) => a.getAttribute('href')),
        });
        const out = { streamed: shape(streamed), whole: shape(whole) };
        streamed.remove();
        whole.remove();
        return out;
    }""",
        [text, cuts(text, seed=len(name))],
    )
    streamed, whole = result["streamed"], result["whole"]
    assert streamed == whole
    if "```" in text or "~~~" in text:
        assert whole["code"] and whole["highlighted"]
    if name == "math":
        assert whole["formulas"] == 4 and "$5 and $10" in whole["text"][0]  # money stays text


def long_code(lines: int) -> str:
    out = []
    for i in range(lines):
        if i % 7 == 0:
            out.append(f'def f_{i}(x):\n    """Step {i}: a docstring\n    over two lines."""\n')
        else:
            out.append(f'    total_{i} = compute(value={i}, name="item {i}")  # step {i}\n')
    return "".join(out)


@pytest.mark.serial  # it times frames: run alone (the soak's phase of `make test`)
def test_a_2000_line_code_reply_streams_highlighted_with_no_long_frame(
    page: Any, fake: tuple[FakeChat, str]
) -> None:
    chat, _ = fake
    code = long_code(1700)  # 2,000 lines with the docstrings' extra lines
    assert code.count("\n") >= 2000
    text = f"The program:\n\n```python\n{code}```\n\nIt computes $\\sum_i t_i$."
    pieces = [text[i : i + 40] for i in range(0, len(text), 40)]
    chat.script = [item for p in pieces for item in (chunk({"content": p}), 0.001)]
    chat.script += [chunk({}, "stop"), usage_chunk(12, len(pieces), 0)]
    chat.reply_to_store = {"role": "assistant", "content": text}
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.evaluate("""async () => {
        window.__frames = []; window.__longTasks = []; window.__highlighted = 0;
        let last = performance.now();
        const tick = (t) => { window.__frames.push(t - last); last = t; requestAnimationFrame(tick); };
        requestAnimationFrame(tick);
        new PerformanceObserver((list) => list.getEntries().forEach((e) => window.__longTasks.push(e.duration)))
            .observe({ type: 'longtask' });
        // count the characters highlighted: each line should be highlighted about once, not once a frame
        const hljs = (await import('/vendor/highlight/highlight.min.js')).default;
        const highlight = hljs.highlight.bind(hljs);
        hljs.highlight = (code, options) => { window.__highlighted += code.length; return highlight(code, options); };
    }""")
    send_message(page, "write a long program")
    reply = wait_for_reply(page, timeout_ms=120_000)
    seen = page.evaluate(
        "() => ({frames: window.__frames.slice(1), longTasks: window.__longTasks,"
        " highlighted: window.__highlighted})"
    )
    content = reply.locator(".content")
    assert content.locator("pre code").text_content() == code[:-1]  # (the newline before the fence)
    assert content.locator("pre .hljs-keyword").count() >= 1700 // 7  # every `def`
    assert content.locator(".katex").count() == 1
    assert seen["highlighted"] <= 2 * len(code), seen["highlighted"]
    assert len(seen["frames"]) > 20
    # no task held the page for 100 ms (a long task is one over 50 ms), and frames kept coming: the
    # compositor's own gaps under a loaded machine are not the page's work, so the frames are held to their median
    assert max(seen["longTasks"], default=0) < 100, sorted(seen["longTasks"])[-5:]
    assert sorted(seen["frames"])[len(seen["frames"]) // 2] < 34, sorted(seen["frames"])[-5:]
    reply.locator(".copy-code").click()
    assert page.evaluate("() => navigator.clipboard.readText()") == code[:-1]
    assert page.text_content("#status") == "Copied to the clipboard."  # (a screen reader says it)
