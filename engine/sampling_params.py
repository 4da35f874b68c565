"""SamplingParams: how one request is sampled and when it stops (vLLM semantics)."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed, same output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = sampled token's logprob plus top-k alternatives
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(_is_int(self.n) and self.n == 1, "n", "only n=1 is supported (parallel sampling comes later)")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(self.seed is None or _is_int(self.seed), "seed", "must be an integer")
        _check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
               "presence_penalty", "must be in [-2, 2]")
        _check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
               "frequency_penalty", "must be in [-2, 2]")
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", "must be > 0")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", "must be >= 1")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens", "must not exceed max_tokens")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN fails


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
