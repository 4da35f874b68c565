"""Logging for every process of the server (the fronts, the engine core, the runner): one format everywhere
(``--log-format text|json``), set up once per process.

``json``: one JSON object per line (time, level, logger, message, and the fields a record carries in ``extra``,
such as the access log's), for log collectors; ``text``: the usual line, with those fields as key=value.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

LOG_FORMATS = ("text", "json")
# what a LogRecord has of its own: anything else on it came in ``extra``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "color_message",
}


def configure_logging(level: str, fmt: str = "text", tag: str = "") -> None:
    """The root logger at ``level`` with one stderr handler in ``fmt``; ``tag`` (e.g. "front 1") marks every line."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(tag) if fmt == "json" else TextFormatter(tag))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


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
        return json.dumps(entry, default=str, ensure_ascii=False)


def _text(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text
