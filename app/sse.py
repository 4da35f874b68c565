"""The one SSE writer: JSON chunks as ``data:`` events, then ``data: [DONE]``.

An error after the stream has started cannot change the HTTP status any more, so it is sent as an error
event in the OpenAI error shape, followed by ``[DONE]``. A client that disconnects cancels the producer,
which aborts its engine request (its KV blocks are free at the next engine step).
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from sse_starlette import EventSourceResponse

from app.errors import APIError, EngineUnavailable
from engine.async_engine import EngineDeadError, RequestFailedError

logger = logging.getLogger(__name__)

_PING_S = 15  # keeps proxies from closing a stream that is waiting in the queue


def sse_response(chunks: AsyncIterator[dict[str, Any]], headers: dict[str, str] | None = None
                 ) -> EventSourceResponse:
    return EventSourceResponse(_events(chunks), ping=_PING_S, sep="\n",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


async def _events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Encoded events: sse-starlette sends bytes as they are, which spares building an event object per token
    (a JSON text holds no raw line break, so one ``data:`` line carries it)."""
    try:
        async for chunk in chunks:
            yield _event(dumps(chunk))
    except APIError as exc:
        yield _event(dumps(exc.body()))
    except EngineDeadError as exc:
        yield _event(dumps(EngineUnavailable(f"the engine stopped: {exc}").body()))
    except RequestFailedError as exc:  # this request only: the engine and the other streams run on
        yield _event(dumps(APIError(500, f"the request failed: {exc}", code="request_failed").body()))
    except Exception as exc:
        logger.exception("stream failed")
        yield _event(dumps(APIError(500, f"internal error: {exc!r}").body()))
    yield _event(b"[DONE]")


def _event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def dumps(value: Any) -> bytes:
    """Compact JSON as UTF-8 bytes (msgspec: several times json.dumps' speed, on every token's event)."""
    return _encode(value)


_encode = msgspec.json.Encoder().encode
