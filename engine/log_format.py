"""Logging for every process of the server (the fronts, the engine core, the runner): one format everywhere
(``--log-format text|json``), set up once per process.

``json``: one JSON object per line (time, level, logger, message, and the fields a record carries in ``extra``,
such as the access log's), for log collectors; ``text``: the usual line, with those fields as key=value.

Every logged string is written with its control characters escaped (``\\n``, ``\\x1b``, ``\\u2028``): a client's
text (a URL path with ``%0a``, an ANSI escape, a NUL) can neither forge a second line nor drive the terminal that
shows the log. A traceback keeps its own line breaks.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

LOG_FORMATS = ("text", "json")
# what a LogRecord has of its own: anything else on it came in ``extra``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",
}
# besides C0 controls: DEL, C1 controls (0x9b alone starts an ANSI sequence on some terminals), the Unicode line
# and paragraph separators, and the bidirectional overrides that reorder how a line reads; json.dumps escapes C0 only
_BEYOND_C0 = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x1f{_BEYOND_C0}]")
_CONTROL_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_BEYOND_C0}]")
_JSON_UNSAFE = re.compile(f"[{_BEYOND_C0}]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def configure_logging(level: str, fmt: str = "text", tag: str = "") -> None:
    """The root logger at ``level`` with one stderr handler in ``fmt``; ``tag`` (e.g. "front 1") marks every line."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(tag) if fmt == "json" else TextFormatter(tag))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def escape_controls(text: str) -> str:
    """``text`` with each control character written as an escape: one logged string stays on one line, and
    shows as text on a terminal."""
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match[0]
    return _SHORT.get(char) or (
        f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
    )


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    def __init__(self, tag: str = "") -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s" + (f" [{tag}]" if tag else "") + ": %(message)s"
        )

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = extra_fields(record)
        return line + "".join(f" {k}={_text(v)}" for k, v in fields.items()) if fields else line

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return _CONTROL_BUT_NEWLINE.sub(_escape, super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _CONTROL_BUT_NEWLINE.sub(_escape, super().formatStack(stack_info))


class JsonFormatter(logging.Formatter):
    def __init__(self, tag: str = "") -> None:
        super().__init__()
        self._tag = tag

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self._tag:
            entry["process"] = self._tag
        entry.update(extra_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        line = json.dumps(entry, default=str, ensure_ascii=False)
        # (outside strings a JSON line has no such characters: each becomes the string escape \\uXXXX)
        return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m[0]):04x}", line)


def _text(value: Any) -> str:
    text = escape_controls(str(value))
    return json.dumps(text) if (" " in text or not text) else text
