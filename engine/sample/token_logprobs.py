"""TokenLogprobs: one sampled token's log-probability, rank and the most likely alternatives, as the sampler
reads them off the device and the front hands them out (a plain type: the front imports it without torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw model distribution
    # 1 = most likely; ties share the worse rank (tokens at least as likely, itself included)
    rank: int
    # params.logprobs most likely (token_id, logprob), most likely first
    top: list[tuple[int, float]]
