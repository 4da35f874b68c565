"""OutputProcessor: the core's token-id deltas in, RequestOutputs out (vLLM v1's output processor).

One state per request, one per sample: its detokenizer (text, stop strings), output ids, logprobs and their
running sum. It runs where the text is wanted: in the server's process, beside the HTTP front, while the engine
core steps in its own process; or in-process under the offline ``LLMEngine``. A stop string ends a sample here;
the caller then ends it in the core (``process`` returns which), whose tokens past it are dropped.

``process`` only updates the states; ``take(sample)`` builds the RequestOutput of everything new since the
sample's last one, when its reader wants it: a reader that is behind costs one output for several steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

from engine.core.block_hash import BlockHasher
from engine.core.core_info import CoreInfo
from engine.output.detokenizer import IncrementalDetokenizer
from engine.sample.token_logprobs import TokenLogprobs
from engine.output.outputs import RequestOutput, SampleDelta
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class SampleState:
    """One sample's output so far, and how much of it was taken (handed out in RequestOutputs)."""

    request_id: str
    index: int
    request: _RequestState
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[TokenLogprobs] | None  # handed out: only where the request asked for logprobs
    # output ids so far (RequestOutputs view this list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None
    num_taken: int = 0  # output ids, characters of text and logprobs already handed out
    text_taken: int = 0
    logprobs_taken: int = 0
    queued: bool = False  # (the reader's flag: already waiting to be taken)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True, eq=False)
class _RequestState:
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    samples: list[SampleState] = field(default_factory=list)
    num_open: int = 0


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

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        prompt = list(prompt_token_ids)
        request = _RequestState(prompt, params, cache_salt)
        detokenize = self.tokenizer is not None and not params.use_beam_search
        summed = params.logprobs is not None or params.best_of is not None
        request.samples = [
            SampleState(
                request_id,
                i,
                request,
                IncrementalDetokenizer(self.tokenizer, prompt, params) if detokenize else None,
                [] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if summed else None,
            )
            for i in range(params.num_samples)
        ]
        request.num_open = len(request.samples)
        self._requests[request_id] = request

    def abort_request(self, request_id: str) -> None:
        """Forget a request (its consumer is gone): later deltas of it are dropped."""
        self._requests.pop(request_id, None)

    def process(self, deltas: list[SampleDelta]) -> tuple[list[SampleState], list[SampleStop]]:
        """Apply one step's deltas; the samples that changed (each once, though a step may carry two deltas of a
        sample: speculative decoding's step that reads the step in flight first), and the samples ended here."""
        updated: dict[int, SampleState] = {}
        stops = []
        requests = self._requests
        for delta in deltas:
            request = requests.get(delta.request_id)
            if request is None:
                continue  # aborted here already
            sample = request.samples[delta.index]
            if sample.finish_reason is not None:
                continue  # ended here (a stop string) while the core still ran it
            self._update(request, sample, delta)
            if sample.finish_reason is not None:
                if delta.finish_reason is None:
                    stops.append(SampleStop(delta.request_id, delta.index, sample.finish_reason))
                request.num_open -= 1
                if not request.num_open:
                    del requests[delta.request_id]
            updated[id(sample)] = sample
        return list(updated.values()), stops

    def _update(self, request: _RequestState, sample: SampleState, delta: SampleDelta) -> None:
        params, ids = request.params, delta.token_ids
        finish_reason, stop_reason, error = delta.finish_reason, delta.stop_reason, delta.error
        if delta.logprobs is not None and sample.cumulative_logprob is not None:
            sample.cumulative_logprob += sum(entry.logprob for entry in delta.logprobs)
        num_kept = len(ids)
        if params.use_beam_search:  # its final delta carries the whole output
            sample.text = self._decode(ids, params) if self.tokenizer is not None else ""
            sample.cumulative_logprob = delta.cumulative_logprob
        elif sample.detokenizer is not None and error is None:
            try:
                num_kept, matched = self._detokenize(
                    sample.detokenizer, ids, finish_reason, stop_reason, params
                )
                if matched is not None:
                    finish_reason, stop_reason = "stop", matched
                sample.text += sample.detokenizer.take_delta(finish_reason is not None)
            except Exception as exc:  # noqa: BLE001 - this request's fault: it ends with an error, others run on
                logger.error(
                    "request %s failed: %s: %s",
                    delta.request_id,
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
                error, finish_reason, sample.detokenizer = (
                    f"{type(exc).__name__}: {exc}",
                    "error",
                    None,
                )
        sample.token_ids += ids if num_kept == len(ids) else ids[:num_kept]
        if sample.logprobs is not None:
            sample.logprobs += (delta.logprobs or [])[:num_kept]
        sample.finish_reason, sample.stop_reason, sample.error = finish_reason, stop_reason, error
        sample.num_cached_tokens, sample.queue_time = delta.num_cached_tokens, delta.queue_time

    def take(self, sample: SampleState) -> RequestOutput:
        """The sample's output: everything new since its last one (the ``*_delta`` fields), and all of it."""
        request = sample.request
        text_delta = sample.text[sample.text_taken :]
        ids_delta = sample.token_ids[sample.num_taken :]
        logprobs = sample.logprobs
        logprobs_delta = logprobs[sample.logprobs_taken :] if logprobs is not None else None
        sample.text_taken, sample.num_taken = len(sample.text), len(sample.token_ids)
        sample.logprobs_taken = len(logprobs) if logprobs is not None else 0
        finished = sample.finish_reason is not None
        return RequestOutput(
            sample.request_id,
            sample.text,
            text_delta,
            ids_delta,
            logprobs,
            logprobs_delta,
            finished,
            sample.finish_reason,
            sample.stop_reason,
            len(request.prompt_token_ids),
            sample.num_cached_tokens,
            sample.queue_time,
            sample.error,
            sample.index,
            sample.cumulative_logprob,
            len(sample.token_ids),
            sample.token_ids,
            self._hashes(request, sample) if finished else None,
        )

    @staticmethod
    def _detokenize(
        detok: IncrementalDetokenizer,
        ids: list[int],
        finish_reason: str | None,
        stop_token: int | None,
        params: SamplingParams,
    ) -> tuple[int, str | None]:
        """Feed new ids to the detokenizer; (ids kept, the stop string that ended the output there, if any).
        A final EOS or stop token adds no text (unless ``include_stop_str_in_output`` for a stop token)."""
        text_ids = ids
        if (
            finish_reason == "stop"
            and ids
            and not (stop_token is not None and params.include_stop_str_in_output)
        ):
            text_ids = ids[:-1]
        # one at a time: a stop string may end the output mid-delta
        for i, token_id in enumerate(text_ids):
            if (matched := detok.update([token_id])) is not None:
                return i + 1, matched
        return len(ids), None

    def _decode(self, ids: list[int], params: SamplingParams) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    def _hashes(self, request: _RequestState, sample: SampleState) -> Callable[[], list[str]]:
        def block_hashes() -> list[str]:
            hashes: list[bytes] = []
            tokens = request.prompt_token_ids + sample.token_ids
            self._hasher.extend(hashes, tokens, self._block_size, request.cache_salt)
            return [h.hex() for h in hashes]

        return block_hashes
