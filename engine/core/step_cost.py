"""StepCostModel: what one engine step costs, learned from the steps the engine runs.

A step that computes x tokens (a decode row is one token, a prefill chunk its length) takes about

    t(x) = a + b * x            (+ p when it computes any prefill)

a is paid once per step (the weights are read once, whatever the batch), b is each token's own work (its share
of the matmuls, its attention reads), p what a step with prefill pays beyond a decode-only one (on the CPU the
native decode step cannot take prefill rows: such a step runs the Python layer loop, ~25 ms more for the default
model). One price b for both kinds of token: measured, a decode row and a prefill token cost about the same on the
CPU (q4, 2.2 and 1.7 ms) and on an H100 (llama-3.2-1b, ~7 and ~6 us). The scheduler spends step-time budgets at
these prices: while several tenants have work, steps take on average at most a set multiple of a one-token step
(scheduler.py, fair_share.py), and on the CPU a step beside running streams runs not much past a target (their
tokens keep coming while a long prompt is computed). A prefill chunk is never cut below the efficient chunk, where
its own work b * x reaches the step's fixed cost a + p: when every step is slow (a busy machine), chunks grow
rather than shrink to a block whose step is nearly all fixed cost.

Fitted online: decode-only steps fall in buckets by their token count (1, 2-3, 4-7, 8-15, ...); each bucket's point
is the median of its last few steps' tokens and seconds, and the line is fitted through the buckets, each counted
once, so a long run at one batch size does not wash the others out; p is the median of what the last few steps with
prefill took beyond the line. Medians, not averages: the first steps of a process (pages of the weights read in,
buffers grown) or a step the OS descheduled can take 100x a usual one, and an average would carry that for dozens
of steps; a median forgets it once most of the window is usual, and follows a lasting change (a neighbour starts)
as fast. Until decode-only steps fill two buckets, a line through every step's buckets stands in (without p);
before that there is no fit (``prices`` is None) and the scheduler shares tokens.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

# steps a bucket (and p) remembers; odd, so that for a noiseless line the median seconds are the median tokens' time
WINDOW = 9
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

    def efficient_chunk(self, block_size: int) -> int:
        """The smallest prefill chunk (whole blocks) whose own work is at least a step's fixed cost (a + p): a step
        of it computes prompt tokens at half the machine's prefill speed or better, whatever the step costs."""
        tokens = math.ceil((self.fixed + self.prefill_fixed) / self.per_token - 1e-9)
        return max(1, -(-tokens // block_size)) * block_size


class _Bucket:
    """A bucket's last ``WINDOW`` steps; its point: their median tokens and median seconds (kept as they come:
    the line is refitted every step)."""

    __slots__ = ("point", "seconds", "tokens")

    def __init__(self) -> None:
        self.tokens: deque[float] = deque(maxlen=WINDOW)
        self.seconds: deque[float] = deque(maxlen=WINDOW)
        self.point = (0.0, 0.0)

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens.append(tokens)
        self.seconds.append(seconds)
        self.point = (statistics.median(self.tokens), statistics.median(self.seconds))


class StepCostModel:
    def __init__(self) -> None:
        self._decode: dict[int, _Bucket] = {}  # decode-only steps
        # every step: a first line before decode-only steps vary in size
        self._all: dict[int, _Bucket] = {}
        # what the last steps with prefill took beyond the decode line
        self._prefill_extra: deque[float] = deque(maxlen=WINDOW)
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
            self._prefill_extra.append(max(seconds - line[0] - line[1] * num_tokens, 0.0))
        extra = statistics.median(self._prefill_extra) if self._prefill_extra else 0.0
        self._prices = StepPrices(*line, extra)

    def prices(self) -> StepPrices | None:
        return self._prices


def _add(buckets: dict[int, _Bucket], num_tokens: int, seconds: float) -> None:
    bucket = buckets.get(num_tokens.bit_length())
    if bucket is None:
        bucket = buckets[num_tokens.bit_length()] = _Bucket()
    bucket.add(num_tokens, seconds)


def _fit(buckets: dict[int, _Bucket]) -> tuple[float, float] | None:
    """Least squares through the buckets' (tokens, seconds): (a, b), b the slope (>= a floor), a the rest
    (>= 0); None without two buckets."""
    if len(buckets) < 2:
        return None
    points = [bucket.point for bucket in buckets.values()]
    mean_tokens = sum(tokens for tokens, _ in points) / len(points)
    mean_seconds = sum(seconds for _, seconds in points) / len(points)
    spread = sum((tokens - mean_tokens) ** 2 for tokens, _ in points)
    slope = sum((t - mean_tokens) * (s - mean_seconds) for t, s in points) / spread
    per_token = max(slope, MIN_TOKEN_SECONDS)
    return max(mean_seconds - per_token * mean_tokens, 0.0), per_token
