"""LLMEngine: the engine core and the output processor in one process, one ``step()`` at a time: requests in,
RequestOutputs out. The offline ``LLM`` (llm.py), the benchmarks and the engine's tests drive it; the server runs
the same core in a process of its own (async_engine.py), with the output processor in the server's process."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any

from engine.core.block_manager import BlockManager
from engine.config import EngineConfig
from engine.runtime.engine_core import EngineCore
from engine.core.metrics import EngineCounters, EngineStats
from engine.worker.model_runner import ModelRunner
from engine.output.output_processor import OutputProcessor
from engine.output.outputs import RequestOutput, SampleDelta, Usage
from engine.sampling_params import SamplingParams
from engine.core.scheduled_batch import ScheduledBatch
from engine.core.scheduler import Scheduler

__all__ = ["LLMEngine", "RequestOutput", "Usage"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **options: Any) -> None:
        self.core = EngineCore(config, **options)
        self.processor = OutputProcessor(self.core.tokenizer, self.core.info)

    def shutdown(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks); the engine is unusable afterwards."""
        self.core.shutdown()

    # the core's parts, for benchmarks and tests that look inside
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def model(self) -> Any:
        return self.core.model

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.core.block_manager

    @property
    def counters(self) -> EngineCounters:
        return self.core.counters

    @property
    def last_batch(self) -> ScheduledBatch | None:
        return self.core.last_batch

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        tenant: str = "",
        priority: int = 0,
        retain: bool = False,
    ) -> None:
        params = params or SamplingParams()
        self.core.add_request(
            request_id, prompt_token_ids, params, cache_salt, tenant, priority, retain
        )
        self.processor.add_request(request_id, prompt_token_ids, params, cache_salt)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """End a request now; returns the final output (finish_reason ``abort``) of each sample not finished
        yet (none if the request is unknown or done)."""
        return self._process(self.core.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self, finals_only: bool = False) -> list[RequestOutput]:
        """One core step; its deltas turned into outputs (see EngineCore.step). ``finals_only``: outputs only for
        the samples that ended, each carrying its whole output in the ``*_delta`` fields too (vLLM's FINAL_ONLY):
        what the offline ``generate`` wants, without an output per running sample per step (at 256 rows, most
        of the output path's host time). Texts and stop strings are still checked at every step."""
        return self._process(self.core.step(), finals_only)

    def _process(self, deltas: list[SampleDelta], finals_only: bool = False) -> list[RequestOutput]:
        updated, stops = self.processor.process(deltas)
        for stop in stops:
            self.core.abort_request(stop.request_id, stop.index, stop.reason)
        return [
            self.processor.take(sample)
            for sample in updated
            if not finals_only or sample.finish_reason is not None
        ]

    def pin_prefix(
        self,
        pin_id: str,
        token_ids: SequenceOf[int],
        cache_salt: str | None,
        share: float = 1.0,
        group: str | None = None,
        group_share: float = 1.0,
    ) -> int:
        """EngineCore.pin_prefix (the prefix must be cached already)."""
        return self.core.pin_prefix(pin_id, token_ids, cache_salt, share, group, group_share)

    def unpin_prefix(self, pin_id: str) -> None:
        self.core.unpin_prefix(pin_id)

    def stats(self) -> EngineStats:
        return self.core.stats()
