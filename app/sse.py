"""The one SSE writer: JSON chunks as ``data:`` events, then ``data: [DONE]``.

An error after the stream has started cannot change the HTTP status any more, so it is sent as an error
event in the OpenAI error shape, followed by ``[DONE]``. A client that disconnects cancels the producer,
which aborts its engine request (its KV blocks are free at the next engine step).

Each event costs one ``send``: the response runs two tasks per stream (the producer, and a watcher that hears the
client leave and sends a keep-alive comment after a quiet spell), and nothing per event besides. (sse-starlette,
used before, spent a sixth of the server's time at 128 streams on a cancel scope around every send.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.errors import APIError, EngineUnavailable
from engine.async_engine import EngineDeadError
from engine.request_stream import RequestFailedError

logger = logging.getLogger(__name__)

_PING_S = 15  # keeps proxies from closing a stream that is waiting in the queue


def sse_response(
    chunks: AsyncIterator[dict[str, Any]],
    headers: dict[str, str] | None = None,
    named: bool = False,
) -> EventStream:
    """``named``: each event also has an ``event:`` line, its chunk's ``type`` (the Responses API's events),
    and the stream ends without ``[DONE]``."""
    return EventStream(
        _events(chunks, named),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )


class EventStream(StreamingResponse):
    """``text/event-stream`` from an async iterator of encoded events (StreamingResponse's headers, no length;
    its own way of sending)."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        ping_s: float = _PING_S,
    ) -> None:
        super().__init__(events, headers=headers, media_type="text/event-stream")
        self._events = events
        self._ping_s = ping_s
        self._last_sent = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(self._watch(receive, send))
        try:
            await asyncio.wait((producer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                task.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
            await self._events.aclose()  # the engine request ends with it (aborted if unfinished)
        if producer.done() and not producer.cancelled() and producer.exception() is not None:
            raise producer.exception()

    async def _produce(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        async for event in self._events:
            self._last_sent = loop.time()
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch(self, receive: Receive, send: Send) -> None:
        """Return when the client disconnects; meanwhile a comment line after each quiet ``ping_s``."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self._ping_s)
            except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                if loop.time() - self._last_sent >= self._ping_s:
                    self._last_sent = loop.time()
                    await send(
                        {"type": "http.response.body", "body": b": ping\n\n", "more_body": True}
                    )
                continue
            if message["type"] == "http.disconnect":
                return


async def _events(
    chunks: AsyncIterator[dict[str, Any]], named: bool = False
) -> AsyncIterator[bytes]:
    """Encoded events: sse-starlette sends bytes as they are, which spares building an event object per token
    (a JSON text holds no raw line break, so one ``data:`` line carries it)."""
    error = "error" if named else None
    try:
        async for chunk in chunks:
            yield _event(dumps(chunk), chunk.get("type") if named else None)
    except APIError as exc:
        yield _event(dumps(exc.body()), error)
    except EngineDeadError as exc:
        yield _event(dumps(EngineUnavailable(f"the engine stopped: {exc}").body()), error)
    except RequestFailedError as exc:  # this request only: the engine and the other streams run on
        yield _event(
            dumps(APIError(500, f"the request failed: {exc}", code="request_failed").body()), error
        )
    except Exception as exc:
        logger.exception("stream failed")
        yield _event(dumps(APIError(500, f"internal error: {exc!r}").body()), error)
    if not named:
        yield _event(b"[DONE]")


def _event(data: bytes, name: str | None = None) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + data + b"\n\n"


def dumps(value: Any) -> bytes:
    """Compact JSON as UTF-8 bytes (msgspec: several times json.dumps' speed, on every token's event)."""
    return _encode(value)


_encode = msgspec.json.Encoder().encode
