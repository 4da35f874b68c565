"""One log line per finished request, with its request id (the client's X-Request-ID, or a fresh one sent back),
status, time and, for a generation, its token counts, TTFT and finish reason; in text or as JSON lines
(``--log-format json``); probes are not logged."""

from __future__ import annotations

import json
import time

import httpx

from tests.server_harness import RunningServer, running_server, server_fixture, wait_until_idle

server = server_fixture("--log-format", "json")
CHAT = {
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 5,
    "temperature": 0,
    "ignore_eos": True,
}


def access_lines(server: RunningServer) -> list[dict]:
    lines = []
    for line in server.log().splitlines():
        if line.startswith("{") and '"pagedchat.access"' in line:
            lines.append(json.loads(line))
    return lines


def wait_for_line(server: RunningServer, request_id: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [line for line in access_lines(server) if line["request_id"] == request_id]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}:\n{server.log()[-3000:]}")


def test_a_streamed_chat_has_one_line_with_its_numbers_at_its_end(server: RunningServer):
    with httpx.stream(
        "POST",
        server.url("/v1/chat/completions"),
        json={**CHAT, "stream": True},
        headers={"X-Request-ID": "req-stream-1"},
        timeout=60,
    ) as response:
        assert response.headers["x-request-id"] == "req-stream-1"
        body = response.read().decode()
    assert body.rstrip().endswith("data: [DONE]")
    line = wait_for_line(server, "req-stream-1")
    assert line["message"] == "POST /v1/chat/completions 200" and line["status"] == 200
    assert (
        line["completion_tokens"] == 5
        and line["finish_reason"] == "length"
        and line["prompt_tokens"] > 5
    )
    assert 0 < line["ttft_ms"] <= line["ms"]
    assert [entry["request_id"] for entry in access_lines(server)].count("req-stream-1") == 1


def test_errors_get_a_line_and_a_fresh_id_and_probes_none(server: RunningServer):
    before = len(access_lines(server))
    response = httpx.post(
        server.url("/v1/chat/completions"),
        json={**CHAT, "temperature": -1},
        headers={"X-Request-ID": "not a token!"},
        timeout=30,
    )
    assert response.status_code == 400
    request_id = response.headers["x-request-id"]
    assert request_id != "not a token!" and len(request_id) == 16
    line = wait_for_line(server, request_id)
    assert line["status"] == 400 and "completion_tokens" not in line
    httpx.get(server.url("/health"), timeout=10)
    httpx.get(server.url("/metrics"), timeout=10)
    assert len(access_lines(server)) == before + 1


def test_a_client_that_leaves_midway_is_logged_as_aborted(server: RunningServer):
    long = {**CHAT, "max_tokens": 400, "stream": True}
    with httpx.stream(
        "POST",
        server.url("/v1/chat/completions"),
        json=long,
        headers={"X-Request-ID": "req-left"},
        timeout=60,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                break
    line = wait_for_line(server, "req-left")
    assert line["finish_reason"] == "abort" and 1 <= line["completion_tokens"] < 400
    wait_until_idle(server)


def test_text_lines_carry_the_same_fields_and_the_core_logs_its_numbers_while_busy():
    with running_server("--log-stats-interval-s", "0.2") as text_server:
        time.sleep(1.0)  # idle: no engine line
        idle = [x for x in text_server.log().splitlines() if "engine: " in x and "steps/s" in x]
        httpx.post(
            text_server.url("/v1/chat/completions"),
            json={**CHAT, "max_tokens": 60},
            headers={"X-Request-ID": "req-text"},
            timeout=60,
        )
        time.sleep(0.5)
        log = text_server.log().splitlines()
    (line,) = [x for x in log if "request_id=req-text" in x]
    assert "POST /v1/chat/completions 200" in line and "completion_tokens=60" in line
    assert "finish_reason=length" in line
    engine = [x for x in log if "engine: " in x and "steps/s" in x]
    assert idle == [] and engine, log[-20:]
    assert all(
        "generation" in x and "running" in x and "swapped" in x and "preemptions" in x
        for x in engine
    )
    assert any("running 1," in x for x in engine)


def test_json_format_reaches_the_engine_core_process_too(server: RunningServer):
    lines = server.log().splitlines()
    core = [json.loads(line) for line in lines if line.startswith("{") and '"engine core"' in line]
    assert core and all(entry["process"] == "engine core" for entry in core)
    assert any(entry["logger"].startswith("engine.") for entry in core)
    text_lines = [line for line in lines if " INFO engine." in line or " WARNING engine." in line]
    assert text_lines == []  # (no engine line in the text format)
