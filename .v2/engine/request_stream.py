"""RequestStream: one request's outputs as an async iterator, fed by the engine on the event loop (async_engine.py)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from engine.output.output_processor import SampleState
from engine.output.outputs import RequestOutput


class RequestFailedError(RuntimeError):
    """This request ended with an error of its own (its sampling, grammar, detokenizing); the engine and the
    other requests run on."""


class RequestStream:
    """One request's outputs as an async iterator. The request is already submitted; reading every sample's
    final output ends it, and ``aclose()`` (or cancellation while waiting, or dropping the stream) aborts it.
    An error (one sample's failure, or the engine's) ends the stream and aborts the samples still running.

    The engine pushes the samples that changed; a read takes one sample's output with everything new since its
    last read, so a reader that is behind gets several steps' tokens in one output. ``stream_interval`` > 1: the
    reader is woken once that many tokens are ready (or a sample's first, or its end), for fewer, larger events."""

    def __init__(
        self,
        request_id: str,
        take: Callable[[SampleState], RequestOutput],
        release: Callable[[str, bool], None],
        loop: asyncio.AbstractEventLoop | None,
        num_samples: int = 1,
        stream_interval: int = 1,
    ) -> None:
        """``take``: the output processor's (a sample's news as one RequestOutput); ``release(request_id,
        finished)``: the engine's, called once when the stream ends (not finished: the request is aborted);
        ``loop``: the event loop the engine runs on (a stream collected elsewhere releases through it)."""
        self.request_id = request_id
        self._take = take
        self._release: Callable[[str, bool], None] | None = release
        self._loop = loop
        self._pending: deque[SampleState | BaseException] = deque()
        self._waiter: asyncio.Future | None = None
        self._interval = stream_interval
        self._unread_tokens = 0
        self._urgent = False  # a sample's first tokens, its end, or an error: wake the reader now
        self._open = num_samples  # samples whose final output has not been read

    def push(self, sample: SampleState) -> None:
        """``sample`` has news (called once per step and sample, on the event loop)."""
        if not sample.queued:
            sample.queued = True
            self._pending.append(sample)
        if self._interval > 1:
            # (a sum over samples: an estimate)
            self._unread_tokens = len(sample.token_ids) - sample.num_taken
            self._urgent |= sample.num_taken == 0 or sample.finish_reason is not None
            if not self._readable():
                return
        self._wake()

    def fail(self, error: BaseException) -> None:
        self._pending.append(error)
        self._urgent = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _readable(self) -> bool:
        return bool(self._pending) and (
            self._interval <= 1 or self._urgent or self._unread_tokens >= self._interval
        )

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._release is None and not self._pending:
            raise StopAsyncIteration
        while not self._readable():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            # cancelled while waiting: the request must not outlive its consumer
            except BaseException:
                self._close(finished=False)
                raise
            finally:
                self._waiter = None
        item = self._pending.popleft()
        pending = self._pending
        self._unread_tokens = 0
        self._urgent = (
            any(
                isinstance(i, BaseException) or i.num_taken == 0 or i.finish_reason is not None
                for i in pending
            )
            if pending
            else False
        )
        if not isinstance(item, BaseException):
            item.queued = False
            output = self._take(item)
            if output.error is None:
                if output.finished:
                    self._open -= 1
                    if not self._open:
                        self._close(finished=True)
                return output
            item = RequestFailedError(output.error)
        self._pending.clear()
        self._close(finished=self._open <= 1)  # other samples may still run: abort them
        raise item

    async def aclose(self) -> None:
        self._pending.clear()
        self._close(finished=False)

    def _close(self, finished: bool) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release(self.request_id, finished)

    def __del__(self) -> None:
        release, loop = getattr(self, "_release", None), getattr(self, "_loop", None)
        if release is not None and loop is not None and not loop.is_closed():
            # (a collected stream may be finalized on any thread: the release runs on the loop's)
            loop.call_soon_threadsafe(release, self.request_id, False)
