"""What leaves the engine: the core's per-step ``SampleDelta``s (token ids only, one batch per step, cheap to
send between processes) and the ``RequestOutput``s the output processor builds from them (text, stop strings,
logprobs, usage)."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

import msgspec

from engine.sample.token_logprobs import TokenLogprobs


class SampleDelta(msgspec.Struct, array_like=True, gc=False):
    """One sample's news from one core step: its new token ids (a beam search's final: all of them), and on
    its last delta why it ended. Sent as a positional array: field order is the wire format."""

    request_id: str
    index: int  # which sample of the request (n > 1, best_of, beam hypotheses)
    token_ids: list[int]
    # per new token, where the sample's params ask for them
    logprobs: list[TokenLogprobs] | None = None
    # stop (EOS, stop token) | length | abort | error; None while running
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    queue_time: float | None = None  # seconds from arrival to first scheduling
    # a beam hypothesis' score (sampled requests sum their logprobs)
    cumulative_logprob: float | None = None
    error: str | None = None  # finish_reason "error": what went wrong with this sample


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one sample of a request: the new part (``*_delta``) and everything so far.

    ``token_ids`` (every output token so far) is a view of the sample's own token list, whose first
    ``num_output_tokens`` entries never change once known: copying a long output for every request at every
    step was a third of the engine's host time at batch 256. ``block_hashes`` are computed on first access
    (sessions store them; most requests never ask)."""

    request_id: str
    text: str
    text_delta: str
    token_ids_delta: list[int]
    logprobs: list[TokenLogprobs] | None  # every output token's, when asked for
    logprobs_delta: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    stop_reason: int | str | None  # the stop token id or stop string, when one ended the request
    num_prompt_tokens: int
    num_cached_tokens: int
    # seconds from arrival to first scheduling; None while still queued
    queue_time: float | None = None
    # finish_reason "error": what went wrong with this request (the others run on)
    error: str | None = None
    index: int = 0  # which of the request's samples (n > 1 or best_of): OpenAI's choices[i].index
    # sum of the sampled tokens' logprobs, where they were computed
    cumulative_logprob: float | None = None
    num_output_tokens: int = 0
    # the sample's output token ids (a live list)
    _tokens: list[int] = field(default_factory=list, repr=False)
    _hashes: Callable[[], list[str]] | None = field(default=None, repr=False)  # on final outputs

    @property
    def token_ids(self) -> list[int]:
        return self._tokens[: self.num_output_tokens]

    @property
    def block_hashes(self) -> list[str] | None:
        """On the final output: hex hashes of the full blocks of prompt + output (the prefix cache's chain)."""
        return self._hashes() if self._hashes is not None else None

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)


def best_choices(finals: list[RequestOutput], n: int) -> list[RequestOutput]:
    """``best_of``: the ``n`` final outputs of highest cumulative logprob (ties: lower index first),
    renumbered 0..n-1 in that order."""
    ranked = sorted(finals, key=lambda out: (-(out.cumulative_logprob or 0.0), out.index))[:n]
    return [dataclasses.replace(out, index=i) for i, out in enumerate(ranked)]
