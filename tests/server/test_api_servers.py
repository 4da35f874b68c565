"""``--api-server-count 2``: two front processes over one engine core. Both serve (the listening socket is
shared), greedy outputs are the offline engine's, sessions and presets are one set for both (Redis, and the core's
pins), /metrics sums both fronts' histograms; the core's death ends every stream on both with an error event and
the server exits 3; SIGTERM drains open streams; a front that dies takes the server down with it, orphans none."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.redis_harness import RedisServer
from tests.server_harness import (
    REPO_ROOT,
    RunningServer,
    offline_chat,
    running_server,
    server_command,
    server_env,
    sse_chunks,
    sse_data,
)
from tests.engine.test_engine_process import (
    core_processes_of,
    data_events,
    process_gone,
    stream_body,
    wait_until,
)

PROMPT = "Name three colours."
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(redis_server: RedisServer):
    with running_server("--api-server-count", "2", "--redis-url", redis_server.url) as server:
        yield server


def children_of(pid: int) -> tuple[list[int], list[int]]:
    """(the fronts, the core) among the runner's spawned children: the fronts are in a process group of their
    own, the core in the runner's."""
    fronts, cores = [], []
    for child in core_processes_of(pid):
        (fronts if os.getpgid(child) == child else cores).append(child)
    return sorted(fronts), cores


def multiprocess_dir(front_pid: int) -> Path:
    environ = Path(f"/proc/{front_pid}/environ").read_bytes().split(b"\0")
    (entry,) = [e for e in environ if e.startswith(b"PROMETHEUS_MULTIPROC_DIR=")]
    return Path(entry.split(b"=", 1)[1].decode())


def first_tokens_seen_by(front_pid: int) -> float:
    """How many first tokens this front observed: its own histogram file, read as the scrape's collector does."""
    from prometheus_client.mmap_dict import MmapedDict

    path = multiprocess_dir(front_pid) / f"histogram_{front_pid}.db"
    values = MmapedDict.read_all_values_from_file(str(path))
    # (each bucket's own count: they are summed at scrape time)
    return sum(value for key, value, *_ in values if "time_to_first_token_seconds_bucket" in key)


def chat_stream(server: RunningServer, max_tokens: int) -> list[dict]:
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    # a connection of its own: the kernel hands it to either front
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", server.url("/v1/chat/completions"), json=body) as response:
            assert response.status_code == 200
            return sse_chunks(sse_data(response.iter_lines()))


def open_streams(
    stack: contextlib.ExitStack, server: RunningServer, count: int, max_tokens: int
) -> list:
    """``count`` chat streams, each on a connection of its own and past its first event; their other events."""
    streams = []
    for _ in range(count):
        client = stack.enter_context(httpx.Client(timeout=60))
        response = stack.enter_context(
            client.stream("POST", server.url("/v1/chat/completions"), json=stream_body(max_tokens))
        )
        events = data_events(response)
        next(events)
        streams.append(events)
    return streams


def test_two_fronts_serve_one_core_with_the_offline_engines_greedy_tokens(server: RunningServer):
    fronts, cores = children_of(server.process.pid)
    assert len(fronts) == 2 and len(cores) == 1
    expected = offline_chat(MESSAGES, temperature=0.0, max_tokens=12).text
    before = {pid: first_tokens_seen_by(pid) for pid in fronts}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: chat_stream(server, 12), range(24)))
    texts = {
        "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) for chunks in replies
    }
    assert texts == {expected}
    seen = {pid: first_tokens_seen_by(pid) - before[pid] for pid in fronts}
    # both fronts served
    assert sum(seen.values()) == 24 and all(n >= 1 for n in seen.values()), seen
    # a scrape of either front sums both fronts' histograms
    total = server.metrics().value("pagedchat:time_to_first_token_seconds_count")
    assert total == sum(first_tokens_seen_by(pid) for pid in fronts)


def test_structured_output_through_either_front_runs_on_the_one_matcher_server(
    server: RunningServer,
):
    """Each front has its grammar zygote; the core keeps its matchers in the matcher server of the first front
    that told it of one, and grammars compiled by the other front's workers run there as well."""
    body = {
        "messages": [{"role": "user", "content": "Give a number as JSON."}],
        "max_tokens": 16,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "n",
                "schema": {
                    "type": "object",
                    "properties": {"n": {"type": "integer"}},
                    "required": ["n"],
                },
            },
        },
    }

    def ask(_) -> str:
        with httpx.Client(timeout=120) as client:  # a connection of its own: either front
            reply = client.post(server.url("/v1/chat/completions"), json=body)
        assert reply.status_code == 200, reply.text[:300]
        return reply.json()["choices"][0]["message"]["content"]

    fronts, (core,) = children_of(server.process.pid)
    before = {pid: first_tokens_seen_by(pid) for pid in fronts}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = set(pool.map(ask, range(16)))
    assert len(texts) == 1 and next(iter(texts)).startswith('{"n": ')
    seen = {pid: first_tokens_seen_by(pid) - before[pid] for pid in fronts}
    assert all(n >= 1 for n in seen.values()), f"both fronts compiled and served: {seen}"
    # (a core keeping its own matchers would have loaded the grammar library)
    assert "llguidance" not in Path(f"/proc/{core}/maps").read_text()


def test_a_session_goes_on_whichever_front_takes_each_turn(server: RunningServer):
    session = httpx.post(
        server.url("/v1/sessions"), json={"system": "Be brief."}, timeout=30
    ).json()
    replies = []
    for turn in ("Hi!", "Name a colour.", "Another one?", "Thanks."):
        with httpx.Client(timeout=120) as client:  # a new connection per turn
            response = client.post(
                server.url(f"/v1/sessions/{session['id']}/messages"),
                json={"content": turn, "max_tokens": 6, "temperature": 0},
            )
        assert response.status_code == 200, response.text
        replies.append(response.json()["choices"][0]["message"]["content"])
    stored = httpx.get(server.url(f"/v1/sessions/{session['id']}"), timeout=30).json()
    assert [m["content"] for m in stored["messages"]] == [
        text
        for pair in zip(("Hi!", "Name a colour.", "Another one?", "Thanks."), replies)
        for text in pair
    ]


def test_a_preset_pinned_through_one_front_is_reported_and_released_by_both(server: RunningServer):
    created = httpx.post(
        server.url("/v1/presets"),
        json={"name": "tersely", "system": "Answer tersely. " * 30},
        timeout=60,
    )
    assert created.status_code == 201, created.text
    pinned = created.json()["pinned_blocks"]
    assert pinned >= 1
    for _ in range(8):  # fresh connections: both fronts answer, from the core's own pins
        with httpx.Client(timeout=30) as client:
            listed = {p["name"]: p for p in client.get(server.url("/v1/presets")).json()["data"]}
        assert listed["tersely"]["pinned_blocks"] == pinned
        assert listed["tersely"]["num_tokens"] == created.json()["num_tokens"]
    assert server.metrics().value("pagedchat:kv_cache_pinned_blocks") == pinned
    assert httpx.delete(server.url("/v1/presets/tersely"), timeout=30).status_code == 200
    assert wait_until(lambda: server.metrics().value("pagedchat:kv_cache_pinned_blocks") == 0, 5)


def test_the_core_killed_ends_streams_on_every_front_and_the_server_exits_3(
    redis_server: RedisServer,
):
    with running_server("--api-server-count", "2", "--redis-url", redis_server.url) as server:
        fronts, (core,) = children_of(server.process.pid)
        with contextlib.ExitStack() as stack:
            streams = open_streams(stack, server, 6, max_tokens=2000)
            os.kill(core, signal.SIGKILL)
            for events in streams:
                rest = list(events)
                assert rest[-1] == "[DONE]" and '"engine_unavailable"' in rest[-2]
        assert server.process.wait(30) == 3
        assert all(process_gone(pid) for pid in fronts)


def test_sigterm_drains_the_open_streams_of_every_front_then_stops_all(redis_server: RedisServer):
    with running_server(
        "--api-server-count", "2", "--redis-url", redis_server.url, "--shutdown-timeout-s", "60"
    ) as server:
        fronts, cores = children_of(server.process.pid)
        with contextlib.ExitStack() as stack:
            streams = open_streams(stack, server, 6, max_tokens=40)
            server.process.send_signal(signal.SIGTERM)
            for events in streams:
                rest = list(events)
                assert rest[-1] == "[DONE]" and '"finish_reason":"length"' in rest[-2]
        assert server.process.wait(30) == 0
        assert wait_until(lambda: all(process_gone(pid) for pid in fronts + cores), 10)


def test_more_than_one_front_needs_a_shared_session_store():
    result = subprocess.run(
        server_command(8999, ["--api-server-count", "2", "--session-store", "memory"]),
        cwd=REPO_ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    # (before any model load)
    assert "api_server_count" in result.stderr and "not memory" in result.stderr


def test_two_fronts_share_sessions_in_the_default_sqlite_file(tmp_path):
    with running_server(
        "--api-server-count", "2", "--session-db-path", str(tmp_path / "s.sqlite3")
    ) as server:
        session = httpx.post(server.url("/v1/sessions"), json={}, timeout=30).json()
        for turn in ("Hi!", "Name a colour."):
            with httpx.Client(timeout=120) as client:  # a new connection per turn: either front
                response = client.post(
                    server.url(f"/v1/sessions/{session['id']}/messages"),
                    json={"content": turn, "max_tokens": 4, "temperature": 0},
                )
            assert response.status_code == 200, response.text
        for _ in range(4):
            with httpx.Client(timeout=30) as client:
                assert (
                    client.get(server.url(f"/v1/sessions/{session['id']}")).json()["num_messages"]
                    == 4
                )
