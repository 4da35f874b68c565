"""Log forging: a URL path carrying ``%0a``, ``%0d``, an ANSI escape or ``%00`` (decoded by the HTTP server before
the app sees it) is written as one access line with those characters escaped, in text and in JSON lines; a
traceback keeps its own line breaks."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from app.access_log import AccessLog
from engine.log_format import JsonFormatter, TextFormatter

# what a client sends, percent-encoded, and what the app sees after decoding
FORGED_URL = (
    "/v1/x%0a2026-11-28 00:00:00 INFO pagedchat.access: GET /admin 200%0d%1b[2J%00%c2%9b31m"
)
FORGED_PATH = "/v1/x\n2026-11-28 00:00:00 INFO pagedchat.access: GET /admin 200\r\x1b[2J\x00\x9b31m"
# every character a terminal or a line-based reader acts on
CONTROLS = [chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]] + ["\u2028", "\u2029", "\u202e"]


def controls_in(text: str) -> list[str]:
    return [c for c in text if c in CONTROLS]


@pytest.fixture(params=[TextFormatter, JsonFormatter])
def written(request: pytest.FixtureRequest) -> Iterator[io.StringIO]:
    """What the access logger writes through the server's formatter (text or JSON)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(request.param())
    access = logging.getLogger("pagedchat.access")
    access.addHandler(handler)
    level = access.level
    access.setLevel(logging.INFO)
    try:
        yield out
    finally:
        access.removeHandler(handler)
        access.setLevel(level)


def request_forged_path() -> None:
    app = AccessLog(PlainTextResponse("not found", status_code=404))
    assert TestClient(app).get(FORGED_URL).status_code == 404


def test_a_forged_path_is_one_access_line_without_control_characters(written: io.StringIO):
    request_forged_path()
    text = written.getvalue()
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    assert len(lines) == 1, lines
    assert controls_in(lines[0]) == []
    # the path is still there to read, each control character as its escape
    message = json.loads(lines[0])["message"] if lines[0].startswith("{") else lines[0]
    escaped = (
        "/v1/x\\n2026-11-28 00:00:00 INFO pagedchat.access: GET /admin 200\\r\\x1b[2J\\x00\\x9b31m"
    )
    assert f"GET {escaped} 404" in message


@pytest.mark.parametrize("formatter", [TextFormatter, JsonFormatter])
def test_any_logged_string_is_escaped_in_the_message_and_the_fields(formatter: type):
    record = logging.LogRecord(
        "pagedchat", logging.WARNING, __file__, 1, "%s", (FORGED_PATH,), None
    )
    record.field = "a\u2028b\x1b[0m"
    line = formatter().format(record)
    assert "\n" not in line and controls_in(line) == []
    if formatter is JsonFormatter:  # still JSON, with the same strings in it
        entry = json.loads(line)
        assert entry["message"] == FORGED_PATH and entry["field"] == "a\u2028b\x1b[0m"


def test_a_traceback_keeps_its_line_breaks_and_loses_its_escapes():
    try:
        raise ValueError("bad \x1b[31mred\x1b[0m")
    except ValueError:
        record = logging.LogRecord(
            "pagedchat", logging.ERROR, __file__, 1, "failed", None, sys.exc_info()
        )
    line = TextFormatter().format(record)
    assert line.count("\n") >= 2 and "Traceback" in line
    assert "\x1b" not in line and "\\x1b[31mred" in line
