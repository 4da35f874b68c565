"""The serving path shared by every endpoint that generates: admission (503 when the engine is down, 429 when
the queue is full, 400 for requests the engine refuses), and per-request latency metrics."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.errors import APIError, EngineUnavailable
from app.metrics import ServerMetrics
from app.prompts import PromptRenderer
from app.request_body import ClientDisconnected
from app.protocol import ChatCompletionRequest
from app.sessions.outbox import TurnOutbox
from app.sessions.store import SessionStore
from app.settings import ServerSettings
from engine.async_engine import EngineDeadError
from engine.engine_client import EngineClient
from engine.request_stream import RequestStream
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

_RETRY_AFTER_S = "1"


class BackgroundTasks:
    """Tasks the server keeps referenced until they end (e.g. turns being stored after their stream), and waits
    for at shutdown."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


# a chat completion in a session (app/sessions/api.py): the stateless route hands it over without importing it
SessionChat = Callable[[Request, "Serving", ChatCompletionRequest, str, float], Awaitable[Response]]


@dataclass(slots=True, eq=False)
class Serving:
    """What a request handler needs, built once at start-up and kept on ``app.state.server``."""

    settings: ServerSettings
    engine: EngineClient
    prompts: PromptRenderer
    metrics: ServerMetrics
    model_name: str
    sessions: SessionStore
    outbox: TurnOutbox  # turns waiting for the session store to come back
    session_chat: SessionChat
    background: BackgroundTasks = field(default_factory=BackgroundTasks)
    started: int = 0  # unix time the server came up (the model card's "created")
    max_queue: int = 256  # this front's share of --max-queue (requests waiting for their first token)
    max_queue_per_tenant: int = 128  # this front's share of --max-queue-per-tenant
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # the model's (app/generation_config.py)

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"model: {requested!r} is not served here (this server serves "
                                f"{self.model_name!r})", param="model", code="model_not_found")

    @staticmethod
    def tenant(request: Request) -> str:
        """Who sent the request: a hash of its API key, or "" when the server has no keys (app/security.py)."""
        return request.scope.get("state", {}).get("tenant", "")

    @staticmethod
    def scheduling_tenant(request: Request | None) -> str:
        """Whose share of the engine a request takes: its API key's tenant, or without keys its client's address
        (behind a proxy of --forwarded-allow-ips, the address it forwards); "" for the server's own."""
        if request is None:
            return ""
        tenant = request.scope.get("state", {}).get("tenant", "")
        if tenant:
            return tenant
        client = request.scope.get("client")
        return f"addr:{client[0]}" if client else ""

    @staticmethod
    def is_admin(request: Request) -> bool:
        """The admin key (or a server without keys): may manage shared presets."""
        return bool(request.scope.get("state", {}).get("admin", False))

    def cache_salt(self, request: Request, requested: str | None) -> str | None:
        """The salt that keys a request's prefix blocks: with ``tenant_salt_from_api_key`` each API key is
        its own tenant, whose blocks no other key's requests can hit (a per-request salt narrows further)."""
        tenant = self.tenant(request) if self.settings.tenant_salt_from_api_key else ""
        if not tenant:
            return requested
        return f"{tenant}/{requested}" if requested is not None else tenant

    async def submit(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
                     arrival: float, request: Request | None = None, priority: int = 0) -> TimedStream:
        """Hand the request to the engine now, or raise the APIError that says why not. A response_format's
        schema is compiled first, off the event loop (once per request, whatever its n). With the HTTP
        ``request``, the engine shares its steps fairly between the request's tenant and others
        (``scheduling_tenant``), and the stream's numbers go to its access-log line (app/access_log.py)."""
        if not self.engine.healthy:
            raise EngineUnavailable()
        tenant = self.scheduling_tenant(request)
        self._check_queue(tenant)
        spec = params.structured_output
        if spec is not None and spec.grammar is None:
            try:
                compiled = await self.engine.compile_structured_output(spec)
                params = dataclasses.replace(params, structured_output=compiled)
            except ValueError as exc:
                raise APIError.from_value_error(exc) from None
            except EngineDeadError as exc:
                raise EngineUnavailable(f"the engine is not running: {exc}") from None
        if request is not None and await request.is_disconnected():  # (a connect-and-drop storm costs no engine work)
            raise ClientDisconnected()
        self._check_queue(tenant)  # (again, with no await before the submission: the compile above took time)
        try:
            stream = self.engine.generate(prompt_ids, params, cache_salt=cache_salt, tenant=tenant,
                                          priority=priority)
        except EngineDeadError as exc:
            raise EngineUnavailable(f"the engine is not running: {exc}") from None
        except ValueError as exc:
            raise APIError.from_value_error(exc) from None
        timed = TimedStream(stream, self.metrics, arrival, params.num_samples, len(prompt_ids))
        if request is not None:
            request.scope.setdefault("state", {}).setdefault("generations", []).append(timed)
        return timed

    def _check_queue(self, tenant: str) -> None:
        """429 when the queue (requests waiting for their first token) is full, or this tenant's part of it."""
        queued = self.engine.num_queued
        if queued >= self.max_queue:
            raise APIError(429, f"the server is busy: {queued} requests are waiting; retry shortly",
                           code="queue_full", headers={"Retry-After": _RETRY_AFTER_S})
        if self.engine.num_queued_for(tenant) >= self.max_queue_per_tenant:
            raise APIError(429, f"too many of your requests are waiting ({self.max_queue_per_tenant}); retry once "
                                "some have started", code="tenant_queue_full", headers={"Retry-After": _RETRY_AFTER_S})

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A background task the server keeps referenced (and waits for at shutdown)."""
        return self.background.spawn(coro)


class TimedStream:
    """A RequestStream that records time to first token, inter-token latency, end-to-end latency and queue
    time into the server's histograms. With several samples (n, best_of) the request's first token is its time
    to first token, intervals are measured within each sample, and the request ends with its last sample."""

    def __init__(self, stream: RequestStream, metrics: ServerMetrics, arrival: float, num_samples: int = 1,
                 num_prompt_tokens: int = 0) -> None:
        self.stream = stream
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0  # every sample's
        self.finish_reasons: set[str] = set()  # of the samples that ended ("abort" for those cut by a close)
        self._metrics = metrics
        self.arrival = arrival
        self.num_samples = num_samples
        self._num_open = num_samples
        self._sample_token_times: dict[int, float] = {}  # sample index -> when its latest token arrived
        self.last_token_time: float | None = None
        self.first_token_time: float | None = None
        self.last_output: RequestOutput | None = None
        self.failure: Exception | None = None  # what ended the stream early (the request failed, the engine died)
        # called once when the stream ends for any reason (finished, error, cancelled, closed unread): must
        # not block (it may run inside a cancelled task), may return a task the answer waits for before its
        # last event (sessions store the turn so, and the client's next message finds it stored)
        self.on_end: Callable[[TimedStream], asyncio.Task | None] | None = None
        # a session turn the store could not take in time: kept in memory, stored when the store is back (the
        # answer says so: "session_turn": "pending")
        self.turn_pending = False
        self._end_task: asyncio.Task | None = None

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self.stream:
                self._observe(output)
                self.last_output = output
                yield output
        except Exception as exc:
            self.failure = exc
            raise
        finally:
            await self.stream.aclose()
            self._ended()

    async def aclose(self) -> None:
        await self.stream.aclose()
        self._ended()

    def _ended(self) -> None:
        if self._num_open > 0:  # ended before every sample finished: closed (the client left) or failed
            self.finish_reasons.add("error" if self.failure is not None else "abort")
            self._num_open = 0
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            self._end_task = on_end(self)

    async def settled(self) -> None:
        """Wait for the work ``on_end`` started (after the last output)."""
        if self._end_task is not None:
            await asyncio.shield(self._end_task)

    def _observe(self, output: RequestOutput) -> None:
        now, count = time.monotonic(), len(output.token_ids_delta)
        if count:
            previous = self._sample_token_times.get(output.index)
            if previous is None:  # the sample's first token: no interval before it
                previous = now
                count -= 1
                if self.first_token_time is None:
                    self.first_token_time = now
                    self._metrics.observe_first_token(now - self.arrival, output.queue_time)
            if count:
                self._metrics.observe_tokens(now - previous, count)
            self._sample_token_times[output.index] = self.last_token_time = now
        self.num_completion_tokens += len(output.token_ids_delta)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finished:
            self.finish_reasons.add(output.finish_reason or "stop")
            self._num_open -= 1
            if not self._num_open:
                self._metrics.observe_finished(now - self.arrival)

    async def collect(self) -> list[RequestOutput]:
        """Read to the end: each sample's final output (the whole text and token ids), in ``index`` order."""
        finals = [output async for output in self if output.finished]
        assert len(finals) == self.num_samples
        await self.settled()
        return sorted(finals, key=lambda output: output.index)
