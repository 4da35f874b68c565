"""AsyncEngine: the LLMEngine on a background thread, bridged to asyncio.

The event loop never runs engine work: ``generate`` validates, puts the request on a thread-safe inbox and
awaits a per-request asyncio.Queue. The engine thread drains the inbox between steps, steps, and hands
each step's outputs back with ``loop.call_soon_threadsafe``. A consumer that stops iterating (disconnect,
cancellation) aborts its request, so its blocks are free at the next step. An exception in the engine
thread reaches every waiting consumer, and ``healthy`` turns False.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable, Sequence as SequenceOf, TypeVar

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.metrics import EngineStats
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

_STATS_PERIOD_S = 0.05  # stats snapshots are refreshed at most this often while busy (and when idle)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (an error, or stop()); no request can be served."""


class RequestFailedError(RuntimeError):
    """This request ended with an error of its own (its sampling, grammar, detokenizing); the engine and the
    other requests run on."""


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, **options: Any) -> None:
        self.config = config or EngineConfig(**options)
        self.engine: LLMEngine | None = None
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stats: EngineStats | None = None
        self._stats_time = 0.0
        self._queued: set[str] = set()
        self._calls: set[asyncio.Future] = set()  # call()s not answered yet (failed if the engine dies)

    async def start(self) -> None:
        """Load the model and size the KV cache (off the event loop), then start the engine thread."""
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(LLMEngine, self.config)
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="pagedchat-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._inbox.put(("stop",))
        await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineDeadError("engine stopped"))

    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread is not None and self._thread.is_alive()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer if self.engine else None

    def stats(self) -> EngineStats:
        if self._stats is None:
            raise EngineDeadError("engine not started")
        return self._stats

    @property
    def num_queued(self) -> int:
        """Requests submitted that have not produced their first output yet (waiting or in prefill)."""
        return len(self._queued)

    def generate(self, prompt_token_ids: SequenceOf[int], params: SamplingParams,
                 request_id: str | None = None, cache_salt: str | None = None) -> RequestStream:
        """Submit a request now (ValueError on bad input, EngineDeadError when down) and return its stream of
        outputs (deltas; with n > 1 or best_of, every sample's, told apart by ``index``) until each sample's
        has ``finished``. Closing the stream early aborts the request."""
        self._check_alive()
        self.engine.validate_request(prompt_token_ids, params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        queue_: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue_
        self._queued.add(request_id)
        self._inbox.put(("add", request_id, list(prompt_token_ids), params, cache_salt))
        return RequestStream(self, request_id, queue_, params.num_samples)

    async def pin_prefix(self, pin_id: str, token_ids: SequenceOf[int], cache_salt: str | None = None,
                         max_pinned_blocks: int = 0) -> int:
        """Compute ``token_ids`` once (a one-token request) and pin their full blocks against eviction, so
        every later request starting with them hits the cache; returns the number of blocks pinned."""
        params = SamplingParams(temperature=0.0, max_tokens=1)
        async for _ in self.generate(token_ids, params, request_id=f"pin-{pin_id}-{uuid.uuid4().hex[:8]}",
                                     cache_salt=cache_salt):
            pass
        return await self.call(lambda engine: engine.pin_prefix(pin_id, token_ids, cache_salt, max_pinned_blocks))

    async def unpin_prefix(self, pin_id: str) -> None:
        await self.call(lambda engine: engine.unpin_prefix(pin_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (the only thread that may touch it)."""
        self._check_alive()
        future: asyncio.Future[T] = self._loop.create_future()
        self._calls.add(future)
        future.add_done_callback(self._calls.discard)
        self._inbox.put(("call", fn, future))
        return await future

    async def abort(self, request_id: str) -> None:
        """End a request; its stream receives a final output with finish_reason ``abort``."""
        self._inbox.put(("abort", request_id))

    def _release(self, request_id: str, finished: bool) -> None:
        """A stream is done with (read to the end, closed or dropped): forget it, abort if unfinished."""
        self._streams.pop(request_id, None)
        self._queued.discard(request_id)
        if not finished:
            self._inbox.put(("abort", request_id))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error!r}") from self._error
        if not self.healthy:
            raise EngineDeadError("engine is not running")

    # engine thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while self._handle_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    self._publish(engine.step())
                self._refresh_stats(force=not engine.has_unfinished_requests())
        except BaseException as exc:  # noqa: BLE001 - every consumer must hear of it
            logger.exception("engine thread failed")
            self._error = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued adds/aborts; False once asked to stop."""
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command[0] == "stop":
                return False
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "call":
                self._call(*command[1:])
            else:
                self._publish(self.engine.abort_request(command[1]))

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None) -> None:
        try:
            self.engine.add_request(request_id, prompt_ids, params, cache_salt=cache_salt)
        except ValueError as exc:  # this request's fault only: tell its consumer, keep serving
            self._loop.call_soon_threadsafe(self._deliver_error, request_id, exc)
        except Exception as exc:  # noqa: BLE001 - add_request registers nothing before it can fail
            logger.exception("request %s could not be added", request_id)
            error = RequestFailedError(f"{type(exc).__name__}: {exc}")
            self._loop.call_soon_threadsafe(self._deliver_error, request_id, error)

    def _call(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - the caller's problem, raised in the caller
            self._loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            self._loop.call_soon_threadsafe(_settle, future, result, None)
        self._refresh_stats(force=True)

    def _refresh_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= _STATS_PERIOD_S:
            self._stats, self._stats_time = self.engine.stats(), now

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    # event loop -------------------------------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._queued.discard(output.request_id)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output if output.error is None else RequestFailedError(output.error))

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        error = exc
        if not isinstance(exc, EngineDeadError):
            error = EngineDeadError(f"engine failed: {exc!r}")
            error.__cause__ = exc
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in list(self._calls):
            _settle(future, None, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class RequestStream:
    """One request's outputs as an async iterator. The request is already submitted; reading every sample's
    final output ends it, and ``aclose()`` (or cancellation while waiting, or dropping the stream) aborts it.
    An error (one sample's failure, or the engine's) ends the stream and aborts the samples still running."""

    def __init__(self, engine: AsyncEngine, request_id: str,
                 queue_: asyncio.Queue[RequestOutput | BaseException], num_samples: int = 1) -> None:
        self.request_id = request_id
        self._engine: AsyncEngine | None = engine
        self._queue = queue_
        self._open = num_samples  # samples whose final output has not been read

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._engine is None:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled while waiting: the request must not outlive its consumer
            self._close(finished=False)
            raise
        if isinstance(item, BaseException):
            self._close(finished=self._open <= 1)  # other samples may still run: abort them
            raise item
        if item.finished:
            self._open -= 1
            if not self._open:
                self._close(finished=True)
        return item

    async def aclose(self) -> None:
        self._close(finished=False)

    def _close(self, finished: bool) -> None:
        if self._engine is not None:
            self._engine._release(self.request_id, finished)
            self._engine = None

    def __del__(self) -> None:
        if getattr(self, "_engine", None) is not None:
            self._engine._release(self.request_id, finished=False)  # the inbox is thread-safe
