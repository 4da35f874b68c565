"""StepCostModel: what one engine step costs, learned from the steps the engine runs.

A step that computes x tokens (a decode row is one token, a prefill chunk its length) takes about

    t(x) = a + b * x            (+ p when it computes any prefill)

a is paid once per step (the weights are read once, whatever the batch), b is each token's own work (its share
of the matmuls, its attention reads), p what a step with prefill pays beyond a decode-only one (on the CPU the
native decode step cannot take prefill rows: such a step runs the Python layer loop, ~25 ms more for the default
model). One price b for both kinds of token: measured, a decode row and a prefill token cost about the same on the
CPU (q4, 2.2 and 1.7 ms) and on an H100 (llama-3.2-1b, ~7 and ~6 us). The scheduler spends step-time budgets at
these prices: while several tenants have work, steps take on average at most a set multiple of a one-token step
(scheduler.py, fair_share.py), and on the CPU no step runs much past a target (so a request arriving during
another's long prompt waits one short step, not seconds).

Fitted online: decode-only steps fall in buckets by their token count (1, 2-3, 4-7, 8-15, ...); each bucket is an
exponential average of its tokens and seconds, and the line is fitted through the buckets, each counted once, so a
long run at one batch size does not wash the others out; p is an exponential average of what steps with prefill
took beyond the line. Until decode-only steps fill two buckets, a line through every step's buckets stands in
(without p); before that there is no fit (``prices`` is None) and the scheduler shares tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2  # weight of a new observation in its bucket's average
# a floor for b (a batch-size-free device would otherwise price tokens at zero)
MIN_TOKEN_SECONDS = 1e-7


@dataclass(slots=True, frozen=True)
class StepPrices:
    fixed: float  # a: seconds a step costs whatever it computes
    # b: seconds per token computed (a decode row, or one token of a prefill chunk)
    per_token: float
    prefill_fixed: float = 0.0  # p: seconds a step with any prefill costs beyond a decode-only one

    def one_token_step(self) -> float:
        return self.fixed + self.per_token

    def cost(self, num_tokens: int, prefill: bool) -> float:
        return self.fixed + (self.prefill_fixed if prefill else 0.0) + self.per_token * num_tokens

    def tokens_within(self, seconds: float, prefill: bool = False) -> int:
        """Tokens a step of ``seconds`` computes."""
        spare = seconds - self.fixed - (self.prefill_fixed if prefill else 0.0)
        return int(max(spare, 0.0) / self.per_token + 1e-9)  # (not lost to rounding)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    seconds: float


class StepCostModel:
    def __init__(self) -> None:
        self._decode: dict[int, _Bucket] = {}  # decode-only steps
        # every step: a first line before decode-only steps vary in size
        self._all: dict[int, _Bucket] = {}
        self._prefill_fixed = 0.0
        # (refitted at each observation, read several times a step)
        self._prices: StepPrices | None = None

    def observe(self, num_tokens: int, seconds: float, prefill: bool = False) -> None:
        """One step: the tokens it computed (``prefill``: some of them a prompt's), and its wall time."""
        if seconds <= 0 or num_tokens <= 0:
            return
        _add(self._all, num_tokens, seconds)
        if not prefill:
            _add(self._decode, num_tokens, seconds)
        line = _fit(self._decode)  # (once a step: the engine observes every step)
        if line is None:
            line = _fit(self._all)
            self._prices = StepPrices(*line) if line is not None else None
            return
        if prefill:
            extra = max(seconds - line[0] - line[1] * num_tokens, 0.0)
            self._prefill_fixed += ALPHA * (extra - self._prefill_fixed)
        self._prices = StepPrices(*line, self._prefill_fixed)

    def prices(self) -> StepPrices | None:
        return self._prices


def _add(buckets: dict[int, _Bucket], num_tokens: int, seconds: float) -> None:
    bucket = buckets.get(num_tokens.bit_length())
    if bucket is None:
        buckets[num_tokens.bit_length()] = _Bucket(float(num_tokens), seconds)
    else:
        bucket.tokens += ALPHA * (num_tokens - bucket.tokens)
        bucket.seconds += ALPHA * (seconds - bucket.seconds)


def _fit(buckets: dict[int, _Bucket]) -> tuple[float, float] | None:
    """Least squares through the buckets' (tokens, seconds): (a, b), b the slope (>= a floor), a the rest
    (>= 0); None without two buckets."""
    points = buckets.values()
    if len(points) < 2:
        return None
    mean_tokens = sum(p.tokens for p in points) / len(points)
    mean_seconds = sum(p.seconds for p in points) / len(points)
    spread = sum((p.tokens - mean_tokens) ** 2 for p in points)
    slope = sum((p.tokens - mean_tokens) * (p.seconds - mean_seconds) for p in points) / spread
    per_token = max(slope, MIN_TOKEN_SECONDS)
    return max(mean_seconds - per_token * mean_tokens, 0.0), per_token
