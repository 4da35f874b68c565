"""Per-key quotas without a model (app/key_quota.py, charged by app/admission.py): a token bucket per key of
``--max-tokens-per-minute-per-key`` tokens refilled at that many a minute, from which a request reserves its
most possible tokens (prompt + sequences x max_tokens) and gets back what it did not use when it ends; and a cap on
a key's requests in flight. Time is a clock the test moves (no sleeps); every expected number is counted by hand
from the quota (600 tokens a minute: 10 a second)."""

from __future__ import annotations

import gc
import subprocess
import sys
from typing import Any

import pytest
from starlette.requests import Request

from app.admission import Admission
from app.cli import build_parser, server_settings_from_args
from app.errors import APIError
from app.key_quota import KeyQuota
from app.settings import ServerSettings
from engine.sampling_params import SamplingParams

PER_MINUTE = 600  # 10 tokens a second


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def quota(per_minute: int = PER_MINUTE, concurrent: int = 0) -> tuple[KeyQuota, Clock, list[str]]:
    clock, refused = Clock(), []
    return KeyQuota(per_minute, concurrent, clock, refused.append), clock, refused


def refusal(quota: KeyQuota, tenant: str, tokens: int) -> APIError:
    with pytest.raises(APIError) as refused:
        quota.admit(tenant, tokens)
    return refused.value


# the bucket ----------------------------------------------------------------------------------------------


def test_a_burst_past_the_quota_gets_429_with_the_wait_until_it_fits():
    q, _, refused = quota()
    q.admit("a", 400)
    error = refusal(q, "a", 300)  # 200 left: 100 short, 10 s at 10 a second
    assert (error.status, error.code, error.headers) == (
        429,
        "rate_limit_exceeded",
        {"Retry-After": "10"},
    )
    assert error.body()["error"]["type"] == "rate_limit_error"
    for text in ("300 tokens", "200 of its 600", "--max-tokens-per-minute-per-key"):
        assert text in error.message, error.message
    # 5 short: half a second, rounded up to the header's whole seconds
    assert refusal(q, "a", 205).headers == {"Retry-After": "1"}
    assert q.level("a") == 200, "a refused request took tokens"
    assert refused == ["tokens", "tokens"]


def test_the_bucket_refills_continuously_up_to_its_capacity():
    q, clock, _ = quota()
    q.admit("a", 600)
    clock.now += 2.5
    assert q.level("a") == 25
    refusal(q, "a", 100)
    clock.now += 7.5  # 100 now
    q.admit("a", 100)
    assert q.level("a") == 0
    clock.now += 3600
    assert q.level("a") == PER_MINUTE


def test_a_request_larger_than_the_whole_quota_is_400_naming_max_tokens():
    q, _, refused = quota()
    error = refusal(q, "a", PER_MINUTE + 1)
    assert (error.status, error.param, error.code) == (400, "max_tokens", "request_too_large")
    assert error.message.startswith("max_tokens: ") and "601 tokens" in error.message
    assert refused == ["too_large"]
    q.admit("a", PER_MINUTE)  # the whole quota fits


def test_another_key_is_not_affected():
    q, _, _ = quota(concurrent=1)
    q.admit("a", PER_MINUTE)
    assert refusal(q, "a", 1).status == 429
    q.admit("b", PER_MINUTE)
    assert (q.level("a"), q.level("b"), q.running("a"), q.running("b")) == (0, 0, 1, 1)


def test_the_concurrency_cap_refuses_past_it_until_a_request_ends():
    q, _, refused = quota(per_minute=0, concurrent=2)
    first, _second = q.admit("a", 10**9), q.admit("a", 10**9)  # no token quota: any size
    error = refusal(q, "a", 1)
    assert (error.status, error.code, error.headers) == (
        429,
        "rate_limit_exceeded",
        {"Retry-After": "1"},
    )
    assert "--max-concurrent-requests-per-key" in error.message
    assert first is not None
    first.close()
    first.close()  # (once only)
    assert q.running("a") == 1
    q.admit("a", 1)
    assert refused == ["concurrency"]


def test_both_quotas_off_admit_everything_without_a_ticket():
    q, _, _ = quota(per_minute=0, concurrent=0)
    assert q.admit("a", 10**9) is None and not q.enabled


# through admission, with an engine that records ------------------------------------------------------------


class EngineStream:
    """What TimedStream reads of the engine's stream: closing it is all these tests do."""

    request_id = "r"

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> Any:
        raise StopAsyncIteration

    async def aclose(self) -> None:
        pass


class Engine:
    healthy = True
    num_queued = 0
    refuse = False

    def num_queued_for(self, tenant: str) -> int:
        return 0

    def generate(self, prompt_ids: list[int], params: SamplingParams, **kwargs: Any) -> Any:
        if self.refuse:
            raise ValueError("top_k: beyond the vocabulary")
        return EngineStream()


def admission() -> tuple[Admission, Engine]:
    engine = Engine()
    gate = Admission(
        engine,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        ("m",),
        max_queue=8,
        max_queue_per_tenant=8,
        quota=KeyQuota(PER_MINUTE, 2, Clock()),
    )
    return gate, engine


def request(tenant: str = "a") -> Request:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request({"type": "http", "state": {"tenant": tenant}, "headers": []}, receive)


async def test_n_and_max_tokens_count_and_the_unused_part_comes_back_when_the_stream_ends():
    gate, _ = admission()
    http = request()
    stream = await gate.submit(list(range(5)), SamplingParams(n=3, max_tokens=10), None, 0.0, http)
    assert gate.quota.level("a") == PER_MINUTE - (5 + 3 * 10)
    assert gate.quota.running("a") == 1
    stream.num_completion_tokens = 7  # (as if 7 tokens were read)
    await stream.aclose()
    assert gate.quota.level("a") == PER_MINUTE - (5 + 7)
    assert gate.quota.running("a") == 0


async def test_best_of_and_beams_count_their_sequences():
    gate, _ = admission()
    tickets = [
        gate.reserve(request(), [4], [SamplingParams(n=1, best_of=5, max_tokens=10)]),
        gate.reserve(
            request(), [4], [SamplingParams(use_beam_search=True, beam_width=6, n=2, max_tokens=10)]
        ),
    ]
    assert [t.reserved for t in tickets if t is not None] == [4 + 5 * 10, 4 + 6 * 10]


async def test_a_batch_reserves_once_and_ends_with_its_last_stream():
    gate, _ = admission()
    http = request()
    params = SamplingParams(n=2, max_tokens=10)
    ticket = gate.reserve(http, [5, 7], [params, params])
    assert ticket is not None and ticket.reserved == 12 + 2 * 2 * 10
    streams = [
        await gate.submit(list(range(n)), params, None, 0.0, http, ticket=ticket) for n in (5, 7)
    ]
    assert gate.quota.running("a") == 1  # one request in flight, two streams
    await streams[0].aclose()
    assert (gate.quota.running("a"), gate.quota.level("a")) == (1, PER_MINUTE - 52)
    await streams[1].aclose()
    assert (gate.quota.running("a"), gate.quota.level("a")) == (0, PER_MINUTE - 12)


async def test_a_stream_dropped_unread_gives_back_all_but_its_prompt():
    gate, _ = admission()
    http = request()
    stream = await gate.submit(list(range(5)), SamplingParams(max_tokens=100), None, 0.0, http)
    http.scope["state"]["generations"].clear()
    del stream
    gc.collect()
    assert (gate.quota.running("a"), gate.quota.level("a")) == (0, PER_MINUTE - 5)


async def test_a_request_the_engine_refuses_takes_nothing():
    gate, engine = admission()
    engine.refuse = True
    with pytest.raises(APIError) as refused:
        await gate.submit(list(range(5)), SamplingParams(max_tokens=100), None, 0.0, request())
    assert refused.value.status == 400
    assert (gate.quota.running("a"), gate.quota.level("a")) == (0, PER_MINUTE)


async def test_the_servers_own_requests_are_not_charged():
    gate, _ = admission()
    stream = await gate.submit(list(range(5)), SamplingParams(max_tokens=10**4), None, 0.0)
    assert stream.on_close is None and gate.quota.running("") == 0


# the options -----------------------------------------------------------------------------------------------


OPTIONS = ("max_tokens_per_minute_per_key", "max_concurrent_requests_per_key")


@pytest.mark.parametrize("name", OPTIONS)
def test_the_flag_reaches_the_settings_and_a_negative_value_is_refused_naming_it(name: str):
    parse = build_parser().parse_args
    flag = "--" + name.replace("_", "-")
    assert getattr(server_settings_from_args(parse(["serve", flag, "5000"])), name) == 5000
    assert getattr(ServerSettings(), name) == 0
    with pytest.raises(ValueError, match=rf"^{name}: must be >= 0"):
        server_settings_from_args(parse(["serve", flag, "-1"]))


@pytest.mark.parametrize("name", OPTIONS)
def test_the_environment_sets_the_option_and_a_bad_value_names_it(
    name: str, monkeypatch: pytest.MonkeyPatch
):
    variable = "PAGEDCHAT_" + name.upper()
    monkeypatch.setenv(variable, "1200")
    assert getattr(ServerSettings(), name) == 1200
    monkeypatch.setenv(variable, "lots")
    with pytest.raises(ValueError, match=rf"^{name}: \${variable} must be an integer"):
        ServerSettings()


def test_serve_with_a_negative_quota_exits_2_with_one_line_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "app", "serve", "--max-tokens-per-minute-per-key", "-5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "pagedchat: max_tokens_per_minute_per_key: must be >= 0 (0: off)"
    ], result.stderr
