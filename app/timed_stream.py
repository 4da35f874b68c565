"""TimedStream: an engine stream as the server reads it, recording its latencies into the server's histograms and
the numbers its access-log line and session turn need."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from app.chat_format.plan import ReplyPlan
from app.metrics import ServerMetrics
from engine.output.outputs import RequestOutput
from engine.request_stream import RequestStream


class TimedStream:
    """A RequestStream that records time to first token, inter-token latency, end-to-end latency and queue
    time into the server's histograms. With several samples (n, best_of) the request's first token is its time
    to first token, intervals are measured within each sample, and the request ends with its last sample."""

    def __init__(
        self,
        stream: RequestStream,
        metrics: ServerMetrics,
        arrival: float,
        num_samples: int = 1,
        num_prompt_tokens: int = 0,
    ) -> None:
        self.stream = stream
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_completion_tokens = 0  # every sample's
        # of the samples that ended ("abort" for those cut by a close)
        self.finish_reasons: set[str] = set()
        self._metrics = metrics
        self.arrival = arrival
        self.num_samples = num_samples
        self._num_open = num_samples
        # sample index -> when its latest token arrived
        self._sample_token_times: dict[int, float] = {}
        self.last_token_time: float | None = None
        self.first_token_time: float | None = None
        self.last_output: RequestOutput | None = None
        # what ended the stream early (the request failed, the engine died)
        self.failure: Exception | None = None
        # called once when the stream ends for any reason (finished, error, cancelled, closed unread): must
        # not block (it may run inside a cancelled task), may return a task the answer waits for before its
        # last event (sessions store the turn so, and the client's next message finds it stored)
        self.on_end: Callable[[TimedStream], asyncio.Task | None] | None = None
        # called once when the stream ends, before on_end (admission's per-key quota: app/key_quota.py)
        self.on_close: Callable[[TimedStream], None] | None = None
        # a session turn the store could not take in time: kept in memory, stored when the store is back (the
        # answer says so: "session_turn": "pending")
        self.turn_pending = False
        # how the reply's text splits into reasoning, content and tool calls (app/chat_format/plan.py)
        self.reply_plan: ReplyPlan | None = None
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
        # ended before every sample finished: closed (the client left) or failed
        if self._num_open > 0:
            self.finish_reasons.add("error" if self.failure is not None else "abort")
            self._num_open = 0
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close(self)
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
