"""Tenants at the HTTP edge: without API keys a client address is a tenant; each tenant has its own part of the
queue (429 ``tenant_queue_full`` for it alone); ``priority`` is checked at the edge. (The fair shares of each
engine step are tests/engine/test_fair_scheduling.py's; the served numbers are benchmarks/fairness.py's.)"""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.server_harness import RunningServer, read_until_content, server_fixture, wait_until_idle

server = server_fixture("--max-num-seqs", "1", "--max-queue", "8", "--max-queue-per-tenant", "1")

LONG = {
    "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
    "max_tokens": 2000,
    "ignore_eos": True,
    "stream": True,
    "temperature": 0,
}


def client_from(address: str) -> httpx.Client:
    """A client whose connections come from ``address`` (any 127.x.y.z reaches the server on Linux)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def test_each_client_address_has_its_own_part_of_the_queue(server: RunningServer):
    url = server.url("/v1/chat/completions")
    with (
        client_from("127.0.0.1") as a,
        client_from("127.0.0.2") as b,
        contextlib.ExitStack() as streams,
    ):
        running = streams.enter_context(a.stream("POST", url, json=LONG))
        assert running.status_code == 200
        lines = running.iter_lines()  # (kept referenced: a dropped iterator closes the connection)
        read_until_content(lines)
        queued = streams.enter_context(a.stream("POST", url, json=LONG))
        assert queued.status_code == 200, "a's first waiting request fits a's part of the queue"
        refused = a.post(url, json={**LONG, "stream": False})
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "tenant_queue_full" and error["type"] == "rate_limit_error"
        other = streams.enter_context(b.stream("POST", url, json=LONG))
        assert other.status_code == 200, "another address is not refused for a's queue"
    wait_until_idle(server)


@pytest.mark.parametrize("priority", [1001, -1001, 1.5, "high"])
def test_priority_out_of_range_is_a_400_naming_the_field(server: RunningServer, priority):
    body = {**LONG, "stream": False, "max_tokens": 1, "priority": priority}
    reply = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "priority"


def test_a_priority_in_range_is_accepted(server: RunningServer):
    body = {**LONG, "stream": False, "max_tokens": 2, "priority": -3}
    reply = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
