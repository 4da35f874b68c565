"""One log line per finished HTTP request (uvicorn's own access line is off): its request id, method, path,
status and time, and for a generation its prompt, cached and completion tokens, time to first token and finish
reasons. The line is written when the response has ended, so a stream's line comes at its end, with its numbers.

The request id is the client's ``X-Request-ID`` when it is a plain token (letters, digits, ``._-``, at most 64),
else a fresh one; it is sent back in ``X-Request-ID``. Health probes and scrapes are not logged. The path is logged
with its control characters escaped (a ``%0a`` in it cannot forge a second line), whatever formatter writes it.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.log_format import escape_controls

logger = logging.getLogger("pagedchat.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_QUIET = {"/health", "/ping", "/metrics"}


def request_id_of(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            candidate = value.decode("latin-1")
            if _REQUEST_ID.match(candidate):
                return candidate
    return uuid.uuid4().hex[:16]


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        request_id = request_id_of(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", ()),
                        (b"x-request-id", request_id.encode()),
                    ],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if scope["path"] not in _QUIET and logger.isEnabledFor(logging.INFO):
                fields = {
                    "request_id": request_id,
                    "status": status or 500,
                    "ms": round(1000 * (time.monotonic() - start), 1),
                    **generation_fields(state),
                }
                logger.info(
                    "%s %s %d",
                    escape_controls(scope["method"]),
                    escape_controls(scope["path"]),
                    status or 500,
                    extra=fields,
                )


def generation_fields(state: dict[str, Any]) -> dict[str, Any]:
    """The numbers of the request's generations (app/timed_stream.py's TimedStreams), summed over its prompts."""
    streams = state.get("generations") or []
    if not streams:
        return {}
    ttfts = [s.first_token_time - s.arrival for s in streams if s.first_token_time is not None]
    reasons = sorted({r for s in streams for r in s.finish_reasons})
    return {
        "prompt_tokens": sum(s.num_prompt_tokens for s in streams),
        "cached_tokens": sum(s.num_cached_tokens for s in streams),
        "completion_tokens": sum(s.num_completion_tokens for s in streams),
        "ttft_ms": round(1000 * min(ttfts), 1) if ttfts else None,
        "finish_reason": ",".join(reasons) if reasons else None,
    }
