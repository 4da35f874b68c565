"""Per-key quotas over HTTP (``--max-tokens-per-minute-per-key``, ``--max-concurrent-requests-per-key``;
app/key_quota.py), against the app in this process with a real engine and several API keys, each test on keys of
its own. The quota's clock is the test's and stands still, so a bucket's level moves only by what requests
reserve and give back (600 tokens a minute: 10 a second); expected levels are counted by hand from the requests'
token-id prompts, their max_tokens and n, and the usage they report. Streams are driven through ASGI directly, so
a test can hold two open and leave one in the middle."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.testclient import TestClient

from app.key_quota import KeyQuota
from app.security import tenant_id
from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from tests.server_harness import SMALL_KV_GIB, one_torch_thread

pytestmark = pytest.mark.slow

PER_MINUTE, CONCURRENT = 600, 2
KEYS = ("burst", "leaver", "quitter", "bystander", "crowd", "other", "drained", "counted")


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = ServerSettings(
        api_key=",".join(KEYS),
        session_store="memory",
        max_tokens_per_minute_per_key=PER_MINUTE,
        max_concurrent_requests_per_key=CONCURRENT,
        engine=EngineConfig(kv_cache_memory_gib=float(SMALL_KV_GIB), max_model_len=1024),
    )
    with one_torch_thread(), TestClient(create_app(settings)) as client:
        quota(client).clock = Clock()  # before any request: buckets start on it
        yield client


def quota(client: TestClient) -> KeyQuota:
    return client.app.state.server.admission.quota


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ids(count: int) -> list[int]:
    return list(range(100, 100 + count))


def completion(prompt: int, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {
        "prompt": ids(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


# the token bucket -------------------------------------------------------------------------------------------


def test_a_burst_past_the_quota_gets_429_with_retry_after_and_n_and_max_tokens_count(
    client: TestClient,
):
    tenant = tenant_id("burst")
    # 10 prompt tokens + 2 samples x 4 generated: 18 used of the 10 + 2 x 4 reserved
    served = client.post("/v1/completions", json=completion(10, 4, n=2), headers=auth("burst"))
    assert served.status_code == 200, served.text
    usage = served.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (10, 8)
    assert quota(client).level(tenant) == PER_MINUTE - 18
    # 10 + 590 = 600 > 582: 18 short, 1.8 s at 10 a second
    refused = client.post("/v1/completions", json=completion(10, 590), headers=auth("burst"))
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "2"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    for text in ("600 tokens", "582 of its 600", "--max-tokens-per-minute-per-key"):
        assert text in error["message"], error["message"]
    # 10 + 2 x 300 = 610: more than the whole quota, whatever the wait
    too_large = client.post("/v1/completions", json=completion(10, 300, n=2), headers=auth("burst"))
    assert too_large.status_code == 400, too_large.text
    assert (too_large.json()["error"]["param"], too_large.json()["error"]["code"]) == (
        "max_tokens",
        "request_too_large",
    )
    assert quota(client).level(tenant) == PER_MINUTE - 18, "a refused request took tokens"


def test_every_generating_route_is_charged_and_tokenize_is_not(client: TestClient):
    tenant, headers = tenant_id("drained"), auth("drained")
    ticket = quota(client).admit(tenant, PER_MINUTE)  # the key's whole minute, held
    assert ticket is not None
    session = client.post("/v1/sessions", json={}, headers=headers)
    assert session.status_code == 201, session.text
    routes = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
        "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
        f"/v1/sessions/{session.json()['id']}/messages": {"content": "Hi", "max_tokens": 2},
    }
    for route, body in routes.items():
        refused = client.post(route, json=body, headers=headers)
        assert refused.status_code == 429, (route, refused.text)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded", route
    tokenized = client.post("/tokenize", json={"prompt": "Hi"}, headers=headers)
    assert tokenized.status_code == 200, tokenized.text
    ticket.close()
    assert quota(client).running(tenant) == 0


def test_refusals_are_counted_by_reason(client: TestClient):
    def refusals(reason: str) -> float:
        text = client.get("/metrics").text
        for line in text.splitlines():
            if (
                line.startswith("pagedchat:key_quota_refusals_total{")
                and f'reason="{reason}"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = refusals("too_large")
    body = completion(10, PER_MINUTE)  # 610
    assert client.post("/v1/completions", json=body, headers=auth("counted")).status_code == 400
    assert refusals("too_large") == before + 1


# streams that stay open, or leave -----------------------------------------------------------------------


@dataclass(eq=False)
class OpenRequest:
    """One HTTP request driven through ASGI: its body is sent at once, and the client leaves on ``leave()``."""

    task: asyncio.Task | None = None
    scope: dict[str, Any] = field(default_factory=dict)
    sent: list[dict[str, Any]] = field(default_factory=list)
    first_event: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    def header(self, name: str) -> str | None:
        for key, value in self.sent[0]["headers"]:
            if key.decode().lower() == name:
                return value.decode()
        return None

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    async def leave(self) -> None:
        self.gone.set()
        assert self.task is not None
        await self.task


def start(client: TestClient, key: str, route: str, body: dict[str, Any]) -> OpenRequest:
    """Starts the request on the app's event loop (call from a coroutine run by the client's portal)."""
    payload = json.dumps(body).encode()
    request = OpenRequest()
    pending = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await request.gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        request.sent.append(message)
        if b"data: {" in message.get("body", b""):
            request.first_event.set()

    request.scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": route,
        "raw_path": route.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"authorization", f"Bearer {key}".encode()),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
        "state": {},
    }
    request.task = asyncio.ensure_future(client.app(request.scope, receive, send))
    return request


async def settled(check: Any, what: str) -> None:
    """Wait (at most 30 s) until ``check()`` holds: a stream's end reaches the quota after the app's task."""
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


def test_a_stream_that_leaves_gives_back_its_unused_tokens_and_its_place(client: TestClient):
    tenant, q = tenant_id("leaver"), quota(client)

    async def scenario() -> None:
        # 10 + 590: the whole minute, reserved
        stream = start(client, "leaver", "/v1/completions", completion(10, 590, stream=True))
        await asyncio.wait_for(stream.first_event.wait(), 60)
        assert (q.running(tenant), q.level(tenant)) == (1, 0)
        bystander = tenant_id("bystander")
        assert (q.running(bystander), q.level(bystander)) == (0, PER_MINUTE)
        await stream.leave()
        await settled(lambda: q.running(tenant) == 0, "the stream's place given back")
        (timed,) = stream.scope["state"]["generations"]
        generated = timed.num_completion_tokens
        assert 1 <= generated < 590, "the stream was not cut short"
        assert q.level(tenant) == PER_MINUTE - 10 - generated

    client.portal.call(scenario)


def test_a_non_streaming_client_that_gives_up_gives_back_its_unused_tokens_and_its_place(
    client: TestClient,
):
    tenant, q = tenant_id("quitter"), quota(client)

    async def scenario() -> None:
        waiting = start(client, "quitter", "/v1/completions", completion(10, 590))
        await settled(lambda: q.running(tenant) == 1, "the request admitted")
        assert q.level(tenant) == 0
        await waiting.leave()
        await settled(lambda: q.running(tenant) == 0, "the request's place given back")
        (timed,) = waiting.scope["state"]["generations"]
        assert timed.num_completion_tokens < 590, "the request was not cut short"
        assert q.level(tenant) == PER_MINUTE - 10 - timed.num_completion_tokens

    client.portal.call(scenario)


def test_the_concurrency_cap_refuses_a_third_request_until_one_has_left(client: TestClient):
    tenant, q = tenant_id("crowd"), quota(client)
    short = completion(4, 2)

    async def scenario() -> None:
        streams = [
            start(client, "crowd", "/v1/completions", completion(10, 200, stream=True))
            for _ in range(CONCURRENT)
        ]
        for stream in streams:
            await asyncio.wait_for(stream.first_event.wait(), 60)
        third = start(client, "crowd", "/v1/completions", short)
        await asyncio.wait_for(third.task, 60)
        assert third.status == 429 and third.header("retry-after") == "1"
        error = json.loads(third.body())["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "--max-concurrent-requests-per-key" in error["message"]
        # another key meanwhile
        other = start(client, "other", "/v1/completions", short)
        await asyncio.wait_for(other.task, 60)
        assert other.status == 200, other.body()
        await streams[0].leave()
        await settled(lambda: q.running(tenant) < CONCURRENT, "the first stream's place given back")
        again = start(client, "crowd", "/v1/completions", short)
        await asyncio.wait_for(again.task, 60)
        assert again.status == 200, again.body()
        await streams[1].leave()
        await settled(lambda: q.running(tenant) == 0, "every place given back")

    client.portal.call(scenario)
