"""AsyncEngine: the front's handle on an engine core running in its own process.

The core (engine/runtime/core_process.py) schedules and steps at the device's pace; this side, on the server's
event loop, validates and submits requests, turns each step's token-id deltas into RequestOutputs
(engine/output/output_processor.py: detokenizing, stop strings, logprobs) and hands them to per-request streams.
A stream that is behind gets everything ready for it as one output (never more than one per step). A consumer
that stops iterating (disconnect, cancellation) aborts its request in the core, whose blocks are free at its next
step. If the core fails or its process dies, every waiting consumer gets EngineDeadError and ``healthy`` turns
False; if this process ends, the core ends with it.

By default the engine starts its own core. Given a ``CoreEndpoint`` (``--api-server-count``: several front
processes share one core, started by the process that runs them), it attaches to that core as one of its clients
instead: the core's life is then its starter's, and this side only watches it (a pidfd: its exit is seen at once).
The sockets and the process are core_connection.py's; the requests, their streams and the core's outputs are here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.core.core_info import CoreInfo, check_priority, check_request
from engine.runtime.core_messages import (
    AbortRequest,
    AddFailed,
    AddRequest,
    CoreFailed,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)
from engine.runtime.core_process import CoreEndpoint
from engine.core.metrics import EngineStats
from engine.core_connection import CoreConnection
from engine.grammar_side import GrammarSide
from engine.grammar_worker import GrammarWorkers
from engine.output.output_processor import OutputProcessor
from engine.prefix_cache_calls import PrefixCacheCalls
from engine.request_stream import RequestFailedError, RequestStream
from engine.sampling_params import SamplingParams, StructuredOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _tokenizer(path: Path | str | None) -> Any | None:
    """The model's tokenizer: the prompt thread's and the detokenizer's (its settings fixed at load, so that
    neither mutates it: tokenizer_files.fix_settings)."""
    # (here: the model code is the core's, not imported by the front)
    from engine.worker.tokenizer_files import load_tokenizer

    return load_tokenizer(path)


class EngineDeadError(RuntimeError):
    """The engine core stopped (an error, its process died, or stop()); no request can be served."""


class AsyncEngine(PrefixCacheCalls):
    def __init__(
        self,
        config: EngineConfig | None = None,
        endpoint: CoreEndpoint | None = None,  # None: start our own core
        log_format: str = "text",
        **options: Any,
    ) -> None:
        self.config = config or EngineConfig(**options)
        self.tokenizer: Any | None = None
        self.info: CoreInfo | None = None
        self._core = CoreConnection(self.config, endpoint, log_format)
        self._reader: asyncio.Task | None = None
        self._processor: OutputProcessor | None = None
        self._grammars: Any | None = None
        # compile workers, their zygote, the core's matcher server
        self._grammar_side = GrammarSide()
        self._streams: dict[str, RequestStream] = {}
        self._queued: dict[str, str] = {}  # request id -> tenant, until its first output
        self._queued_by_tenant: Counter[str] = Counter()
        # call()s not answered yet (failed if the engine dies)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stats: EngineStats | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # life cycle ------------------------------------------------------------------------------------

    async def start(self, grammar_workers: int = 0) -> None:
        """Start the core process (or attach to the given one) and wait until it has loaded the model and sized
        the KV cache; ValueError for a configuration mistake (a bad option, a missing model), EngineStartError for
        anything else. ``grammar_workers``: how many to start now (``start_grammar_workers`` warms them)."""
        self._loop = asyncio.get_running_loop()
        self._core.open()
        # the tokenizer loads (and the grammar workers start) while the core loads the model, where its directory
        # is known
        known = self._known_model_dir()
        early = None if known is None else asyncio.ensure_future(self._tokenizer_loading(known))
        # (one zygote: the workers fork from it once it has built the tokenizer's grammar form, and so does the
        # matcher server that holds the core's grammar state)
        self._grammar_side.start(known, grammar_workers)
        try:
            ready = await self._core.wait_ready()
            self.info, self._stats = ready.info, ready.stats
            ready.info.apply_to(self.config)
            path = ready.info.model_path
            if early is not None and path is not None and Path(path) == known:
                self.tokenizer = await early
            else:
                if early is not None:
                    early.cancel()
                self.tokenizer = await asyncio.to_thread(_tokenizer, path)
        except BaseException:
            # (a failed tokenizer load too: the core, started, must not outlive this start)
            if early is not None:
                early.cancel()
            await self._close()
            raise
        self._processor = OutputProcessor(self.tokenizer, ready.info)
        self._loop.add_reader(self._core.process.sentinel, self._core_exited)
        self._reader = self._loop.create_task(self._read_outputs(), name="pagedchat-engine-outputs")
        # the core's grammar matchers go to the zygote's server (it then builds no tokenizer of its own)
        await self.call("use_grammar_matchers", self._grammar_side.matchers_path)

    @staticmethod
    def _tokenizer_loading(path: Path) -> Awaitable[Any]:
        """The tokenizer of ``path``: the load ``pagedchat serve`` started early, or one started now."""
        from engine.worker.tokenizer_files import take_early_tokenizer

        started = take_early_tokenizer(path)
        return asyncio.wrap_future(started) if started else asyncio.to_thread(_tokenizer, path)

    def _known_model_dir(self) -> Path | None:
        """The model's directory when it is there before the core says so (never for dummy weights)."""
        from engine.worker.model_sources import known_model_dir

        return known_model_dir(
            self.config.model, Path(self.config.cache_dir), self.config.load_format
        )

    async def stop(self) -> None:
        """Stop the core (it finishes nothing: call after the requests worth finishing have finished). An attached
        engine only lets go of its core: the core's starter stops it."""
        if self._core.process is None or self._stopping:
            return
        self._stopping = True
        await self._core.stop()
        self._fail_all(EngineDeadError("engine stopped"))
        await self._close()

    async def _close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._loop is not None and self._core.process is not None:
            self._loop.remove_reader(self._core.process.sentinel)
        self._core.close()
        self._grammar_side.close()

    @property
    def healthy(self) -> bool:
        return (
            self._error is None
            and not self._stopping
            and self._core.process is not None
            and self._processor is not None
            and self._core.process.is_alive()
        )

    @property
    def core_pid(self) -> int | None:
        return self._core.process.pid if self._core.process is not None else None

    def stats(self) -> EngineStats:
        if self._stats is None:
            raise EngineDeadError("engine not started")
        return self._stats

    @property
    def num_queued(self) -> int:
        """Requests submitted that have not produced their first output yet (waiting or in prefill)."""
        return len(self._queued)

    def num_queued_for(self, tenant: str) -> int:
        """Of ``num_queued``, those ``tenant`` submitted."""
        return self._queued_by_tenant.get(tenant, 0)

    def _dequeue(self, request_id: str) -> None:
        tenant = self._queued.pop(request_id, None)
        if tenant is not None:
            self._queued_by_tenant[tenant] -= 1
            if not self._queued_by_tenant[tenant]:
                del self._queued_by_tenant[tenant]

    # requests --------------------------------------------------------------------------------------

    def validate_request(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> None:
        """ValueError naming the field when the request can never run (checked here: a 400 before any IPC)."""
        self._check_alive()
        grammars = self._grammar_compiler() if params.structured_output is not None else None
        check_request(self.info, prompt_token_ids, params, grammars)

    async def start_grammar_workers(self) -> None:
        """Start the grammar workers now, warm (tokenizer loaded, one grammar compiled): the server's start pays
        for them, not its first response_format (seconds on a busy machine). Nothing to warm without a tokenizer."""
        if self.info is not None and self.info.model_path is not None:
            await self._grammar_pool().start()

    async def compile_structured_output(self, spec: StructuredOutput) -> StructuredOutput:
        """``spec`` checked and compiled in a grammar worker process (engine/grammar_worker.py: a large schema takes
        seconds and hundreds of MB; limited by its CPU time), or known from an earlier request; the result carries
        its grammar, so neither ``generate`` nor the core compiles it again. ValueError naming ``response_format``
        when it cannot be compiled, takes too long or too much memory."""
        self._check_alive()
        return await self._grammar_pool().compile(spec)

    def _grammar_pool(self) -> GrammarWorkers:
        info = self.info
        return self._grammar_side.pool(info.model_path, info.vocab_size, info.eos_token_ids)

    def generate(
        self,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        tenant: str = "",
        priority: int = 0,
        retain: bool = False,
    ) -> RequestStream:
        """Submit a request now (ValueError on bad input, EngineDeadError when down) and return its stream of
        outputs (deltas; with n > 1 or best_of, every sample's, told apart by ``index``) until each sample's
        has ``finished``. Closing the stream early aborts the request. ``tenant``: who sent it (the core shares
        its steps fairly among tenants); ``priority``: its rank among the tenant's requests, lower first;
        ``retain``: a session's turn (its blocks outrank one-off ones and are kept on the lower KV tiers)."""
        self.validate_request(prompt_token_ids, params)
        check_priority(priority)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        stream = RequestStream(
            request_id,
            self._processor.take,
            self._release,
            self._loop,
            params.num_samples,
            self.config.stream_interval,
        )
        self._processor.add_request(request_id, prompt, params, cache_salt)
        self._streams[request_id] = stream
        self._queued[request_id] = tenant
        self._queued_by_tenant[tenant] += 1
        self._core.send(
            AddRequest(
                request_id,
                prompt,
                params,
                cache_salt,
                self._core.endpoint.client,
                tenant,
                priority,
                retain,
            )
        )
        return stream

    async def abort(self, request_id: str) -> None:
        """End a request; its stream receives a final output with finish_reason ``abort``."""
        if self.healthy:
            self._core.send(AbortRequest(request_id))

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine was started on (None before ``start``): where another thread submits."""
        return self._loop

    async def call(self, target: str | Callable[..., T], *args: Any) -> T:
        """Run ``target`` in the core between steps: an EngineCore method by name, or a module-level function
        taking the core first (pickled: tests inject faults so); returns its result, or raises its error."""
        self._check_alive()
        call_id = next(self._call_ids)
        future: asyncio.Future[T] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            self._core.send(
                UtilityCall(call_id, pickle.dumps((target, args)), self._core.endpoint.client)
            )
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _release(self, request_id: str, finished: bool) -> None:
        """A stream is done with (read to the end, closed or dropped): forget it, abort if unfinished."""
        self._streams.pop(request_id, None)
        self._dequeue(request_id)
        if not finished and self._processor is not None:
            self._processor.abort_request(request_id)
            if self.healthy:
                self._core.send(AbortRequest(request_id))

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine failed: {self._error}") from self._error
        if not self.healthy:
            raise EngineDeadError("engine is not running")

    def _grammar_compiler(self) -> Any:
        if self._grammars is None:
            from engine.output.grammar_compiler import GrammarCompiler

            self._grammars = GrammarCompiler(
                self.tokenizer, self.info.vocab_size, self.info.eos_token_ids
            )
        return self._grammars

    # the core's messages ---------------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        try:
            while True:
                self._handle(await self._core.receive())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug on this side: nothing more can be delivered
            logger.exception("reading the engine core's outputs failed")
            self._die(exc)

    def _handle(self, message: Any) -> None:
        if isinstance(message, StepOutputs):
            if message.stats is not None:
                self._stats = message.stats
            if message.deltas:
                self._deliver(message)
        elif isinstance(message, AddFailed):
            error = (
                ValueError(message.message)
                if message.invalid
                else RequestFailedError(message.message)
            )
            self._processor.abort_request(message.request_id)
            if (stream := self._streams.get(message.request_id)) is not None:
                stream.fail(error)
        elif isinstance(message, UtilityResult):
            self._settle(message)
        elif isinstance(message, CoreFailed):
            self._die(RuntimeError(message.message))

    def _deliver(self, message: StepOutputs) -> None:
        updated, stops = self._processor.process(message.deltas)
        for stop in stops:
            self._core.send(AbortRequest(stop.request_id, stop.index, stop.reason))
        streams = self._streams
        for sample in updated:
            stream = streams.get(sample.request_id)
            if stream is not None:
                stream.push(sample)
        if self._queued:
            for sample in updated:
                self._dequeue(sample.request_id)

    def _settle(self, message: UtilityResult) -> None:
        future = self._calls.get(message.call_id)
        if future is None or future.done():  # the caller was cancelled meanwhile
            return
        value = pickle.loads(message.payload)
        if message.ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _core_exited(self) -> None:
        """The core's process ended (the loop watches its sentinel)."""
        self._loop.remove_reader(self._core.process.sentinel)
        if not self._stopping and self._error is None:
            self._die(RuntimeError(self._core.exited()))

    def _die(self, cause: BaseException) -> None:
        if self._error is None:
            logger.critical("engine core failed: %s", cause)
            self._error = cause
        error = EngineDeadError(f"engine failed: {cause}")
        error.__cause__ = cause
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.fail(error)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)
