"""OutputProcessor: the core's token-id deltas in, RequestOutputs out (vLLM v1's output processor).

One state per request, one per sample: its detokenizer (text, stop strings), output ids, logprobs and their
running sum. It runs where the text is wanted: in the server's process, beside the HTTP front, while the engine
core steps in its own process; or in-process under the offline ``LLMEngine``. A stop string ends a sample here;
the caller then ends it in the core (``process`` returns which), whose tokens past it are dropped.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

from engine.block_manager import BlockHasher
from engine.core_info import CoreInfo
from engine.detokenizer import IncrementalDetokenizer
from engine.layers.sampler import TokenLogprobs
from engine.outputs import RequestOutput, SampleDelta
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _SampleState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None  # handed out: only where the request asked for logprobs
    token_ids: list[int] = field(default_factory=list)  # output ids so far (RequestOutputs view this list)
    text: str = ""
    cumulative_logprob: float = 0.0
    finished: bool = False


@dataclass(slots=True, eq=False)
class _RequestState:
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    samples: list[_SampleState]
    num_open: int


@dataclass(slots=True, frozen=True)
class SampleStop:
    """A sample the output processor ended (a stop string, or its own failure): end it in the core too."""

    request_id: str
    index: int
    reason: str  # stop | error


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, info: CoreInfo) -> None:
        self.tokenizer = tokenizer
        self._hasher = BlockHasher(info.prefix_hash, info.model_id, info.prefix_cache_seed)
        self._block_size = info.block_size
        self._requests: dict[str, _RequestState] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, prompt_token_ids: SequenceOf[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        prompt = list(prompt_token_ids)
        detokenize = self.tokenizer is not None and not params.use_beam_search
        samples = [_SampleState(i, IncrementalDetokenizer(self.tokenizer, prompt, params) if detokenize else None,
                                [] if params.logprobs is not None else None) for i in range(params.num_samples)]
        self._requests[request_id] = _RequestState(prompt, params, cache_salt, samples, len(samples))

    def abort_request(self, request_id: str) -> None:
        """Forget a request (its consumer is gone): later deltas of it are dropped."""
        self._requests.pop(request_id, None)

    def process(self, deltas: list[SampleDelta]) -> tuple[list[RequestOutput], list[SampleStop]]:
        outputs, stops = [], []
        requests = self._requests
        for delta in deltas:
            request = requests.get(delta.request_id)
            if request is None:
                continue  # aborted here already
            sample = request.samples[delta.index]
            if sample.finished:
                continue  # ended here (a stop string) while the core still ran it
            output = self._update(request, sample, delta)
            if output.finished:
                if delta.finish_reason is None:
                    stops.append(SampleStop(delta.request_id, delta.index, output.finish_reason or "stop"))
                request.num_open -= 1
                if not request.num_open:
                    del requests[delta.request_id]
            outputs.append(output)
        return outputs, stops

    def _update(self, request: _RequestState, sample: _SampleState, delta: SampleDelta) -> RequestOutput:
        params, ids = request.params, delta.token_ids
        finish_reason, stop_reason, error = delta.finish_reason, delta.stop_reason, delta.error
        if delta.logprobs is not None:
            for entry in delta.logprobs:
                sample.cumulative_logprob += entry.logprob
        num_kept, text_delta = len(ids), ""
        if params.use_beam_search:  # its final delta carries the whole output
            text_delta = self._decode(ids, params) if self.tokenizer is not None else ""
        elif sample.detokenizer is not None and error is None:
            try:
                num_kept, matched = self._detokenize(sample.detokenizer, ids, finish_reason, stop_reason, params)
                if matched is not None:
                    finish_reason, stop_reason = "stop", matched
                text_delta = sample.detokenizer.take_delta(finish_reason is not None)
            except Exception as exc:
                logger.error("request %s failed: %s: %s", delta.request_id, type(exc).__name__, exc, exc_info=exc)
                error, finish_reason, sample.detokenizer = f"{type(exc).__name__}: {exc}", "error", None
        sample.text += text_delta
        kept = ids if num_kept == len(ids) else ids[:num_kept]
        sample.token_ids += kept
        logprobs_delta = None
        if sample.logprobs is not None:
            logprobs_delta = (delta.logprobs or [])[:num_kept]
            sample.logprobs += logprobs_delta
        sample.finished = finished = finish_reason is not None
        cumulative = delta.cumulative_logprob if params.use_beam_search else \
            sample.cumulative_logprob if params.logprobs is not None or params.best_of is not None else None
        return RequestOutput(
            request_id=delta.request_id, text=sample.text, text_delta=text_delta, token_ids_delta=kept,
            logprobs=sample.logprobs, logprobs_delta=logprobs_delta, finished=finished, finish_reason=finish_reason,
            stop_reason=stop_reason, num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=delta.num_cached_tokens, queue_time=delta.queue_time, error=error,
            index=delta.index, cumulative_logprob=cumulative, num_output_tokens=len(sample.token_ids),
            _tokens=sample.token_ids, _hashes=self._hashes(request, sample) if finished else None)

    @staticmethod
    def _detokenize(detok: IncrementalDetokenizer, ids: list[int], finish_reason: str | None,
                    stop_token: int | None, params: SamplingParams) -> tuple[int, str | None]:
        """Feed new ids to the detokenizer; (ids kept, the stop string that ended the output there, if any).
        A final EOS or stop token adds no text (unless ``include_stop_str_in_output`` for a stop token)."""
        text_ids = ids
        if finish_reason == "stop" and ids and not (stop_token is not None and params.include_stop_str_in_output):
            text_ids = ids[:-1]
        for i, token_id in enumerate(text_ids):  # one at a time: a stop string may end the output mid-delta
            if (matched := detok.update([token_id])) is not None:
                return i + 1, matched
        return len(ids), None

    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _hashes(self, request: _RequestState, sample: _SampleState) -> Callable[[], list[str]]:
        def block_hashes() -> list[str]:
            hashes: list[bytes] = []
            tokens = request.prompt_token_ids + sample.token_ids
            self._hasher.extend(hashes, tokens, self._block_size, request.cache_salt)
            return [h.hex() for h in hashes]
        return block_hashes
