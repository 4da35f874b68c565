"""Per-key quotas, beside the queue limits of app/admission.py: ``--max-tokens-per-minute-per-key`` and
``--max-concurrent-requests-per-key``. The key is the request's tenant (a hash of its API key; on a server without
keys every request is the one tenant "").

Tokens: each key has a bucket of ``capacity`` = N tokens, refilled continuously at N / 60 a second:

    level(t) = min(capacity, level(t0) + (t - t0) * capacity / 60)

A request reserves at admission the most it can take (app/request_budget.py: prompt tokens + sequences x
max_tokens, over its prompts); when it ends, however it ends, what it did not take goes back:

    level += reserved - (prompt tokens + tokens generated)

A reservation above the level is refused with 429 and ``Retry-After``, the seconds until the level holds it; one
above the capacity could never run and is a 400 naming ``max_tokens``.

Concurrency: a key's generating requests in flight (a completions batch of several prompts is one request); past
the cap, 429 with ``Retry-After: 1``. The place is given back when the request's last stream ends.

With several fronts (``--api-server-count``) each front keeps its own buckets and counts, with its share of both
limits (N / fronts, rounded up: app/front.py)."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from app.errors import APIError
from app.timed_stream import TimedStream

Clock = Callable[[], float]
# told the reason of each refusal: "tokens", "concurrency" or "too_large" (the metrics' counter)
OnRefused = Callable[[str], None]

_SECONDS_PER_MINUTE = 60.0


@dataclass(slots=True)
class TokenBucket:
    capacity: int
    level: float
    stamp: float  # when ``level`` was last brought up to date

    @property
    def rate(self) -> float:
        """Tokens a second."""
        return self.capacity / _SECONDS_PER_MINUTE

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + max(0.0, now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def seconds_until(self, tokens: int) -> float:
        """How long until the bucket holds ``tokens`` (0 when it does now); as of the last refill."""
        return max(0.0, tokens - self.level) / self.rate


class KeyQuota:
    """Both quotas of one front; either may be off (0). ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(
        self,
        tokens_per_minute: int = 0,
        max_concurrent: int = 0,
        clock: Clock = time.monotonic,
        on_refused: OnRefused | None = None,
    ) -> None:
        self.tokens_per_minute = tokens_per_minute
        self.max_concurrent = max_concurrent
        self.clock = clock
        self._on_refused = on_refused
        self._buckets: dict[str, TokenBucket] = {}
        self._running: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.tokens_per_minute or self.max_concurrent)

    def admit(self, tenant: str, tokens: int) -> KeyTicket | None:
        """Reserve ``tokens`` and a place among the key's requests in flight, or raise the APIError that says
        why not (nothing is taken then); None when both quotas are off."""
        if not self.enabled:
            return None
        if self.tokens_per_minute and tokens > self.tokens_per_minute:
            raise self._refuse("too_large", _too_large(tokens, self.tokens_per_minute))
        if self.max_concurrent and self.running(tenant) >= self.max_concurrent:
            raise self._refuse("concurrency", _too_many(self.max_concurrent))
        if self.tokens_per_minute:
            bucket = self._bucket(tenant)
            if tokens > bucket.refill(self.clock()):
                raise self._refuse("tokens", _out_of_tokens(tokens, bucket))
            bucket.level -= tokens
        self._running[tenant] = self.running(tenant) + 1
        return KeyTicket(self, tenant, tokens if self.tokens_per_minute else 0)

    def level(self, tenant: str) -> float:
        """The tokens the key may reserve now (the capacity for a key not seen yet)."""
        return self._bucket(tenant).refill(self.clock()) if self.tokens_per_minute else 0.0

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def _bucket(self, tenant: str) -> TokenBucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            capacity = self.tokens_per_minute
            bucket = self._buckets[tenant] = TokenBucket(capacity, capacity, self.clock())
        return bucket

    def give_back(self, tenant: str, unused: int) -> None:
        """A request of ``tenant`` ended: its place in flight, and the ``unused`` part of its reservation."""
        left = self.running(tenant) - 1
        if left > 0:
            self._running[tenant] = left
        else:
            self._running.pop(tenant, None)
        if unused > 0 and self.tokens_per_minute:
            bucket = self._bucket(tenant)
            bucket.refill(self.clock())
            bucket.level = min(bucket.capacity, bucket.level + unused)

    def _refuse(self, reason: str, error: APIError) -> APIError:
        if self._on_refused is not None:
            self._on_refused(reason)
        return error


class KeyTicket:
    """One admitted request's reservation: held by its streams (``hold``), given back (the unused tokens and the
    place in flight) once the last of them ends, or by ``close`` when none was submitted."""

    __slots__ = ("_closed", "_open", "_quota", "_used", "reserved", "tenant")

    def __init__(self, quota: KeyQuota, tenant: str, reserved: int) -> None:
        self._quota = quota
        self.tenant = tenant
        self.reserved = reserved
        self._used = 0
        self._open = 0  # streams holding the ticket
        self._closed = False

    @property
    def idle(self) -> bool:
        """No stream holds the ticket."""
        return self._open == 0

    def hold(self, stream: TimedStream) -> None:
        """``stream`` ends its part when it closes (TimedStream.on_close); one dropped unread (garbage
        collected, its engine request aborted) counts its prompt tokens only."""
        self._open += 1
        lost = weakref.finalize(stream, self._end_one, stream.num_prompt_tokens)
        lost.atexit = False

        def ended(closed: TimedStream) -> None:
            lost.detach()
            self._end_one(closed.num_prompt_tokens + closed.num_completion_tokens)

        stream.on_close = ended

    def close(self) -> None:
        """Give back what was not used, and the place in flight (once)."""
        if not self._closed:
            self._closed = True
            self._quota.give_back(self.tenant, self.reserved - self._used)

    def _end_one(self, used: int) -> None:
        self._used += used
        self._open -= 1
        if self._open <= 0:
            self.close()


def _too_large(tokens: int, capacity: int) -> APIError:
    return APIError(
        400,
        f"max_tokens: this request may take {tokens} tokens (prompt + sequences x max_tokens), more than "
        f"your key's whole quota of {capacity} tokens a minute (--max-tokens-per-minute-per-key); lower "
        "max_tokens (or n, best_of, the prompt)",
        param="max_tokens",
        code="request_too_large",
    )


def _too_many(cap: int) -> APIError:
    return APIError(
        429,
        f"rate limit: your key already has {cap} requests in flight, its cap "
        "(--max-concurrent-requests-per-key); retry once one has ended",
        code="rate_limit_exceeded",
        headers={"Retry-After": "1"},
    )


def _out_of_tokens(tokens: int, bucket: TokenBucket) -> APIError:
    wait = max(1, math.ceil(bucket.seconds_until(tokens)))
    return APIError(
        429,
        f"rate limit: this request may take {tokens} tokens (prompt + sequences x max_tokens) and your key "
        f"has {int(bucket.level)} of its {bucket.capacity} tokens a minute left "
        f"(--max-tokens-per-minute-per-key); retry in {wait} s",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(wait)},
    )
