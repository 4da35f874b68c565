"""What an attacker found at the server's edges (issue 49), against a real server: a 2 MB batch of 400,000 prompts
is refused at once naming ``prompt`` while /health keeps answering; a URL path forging log lines is one escaped
access line; the session database deleted while serving shows in /health, in the log and as 503 on session
writes; a corrupt database at start is one line and exit status 2."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.server.test_startup_errors import LOADING, errors, start
from tests.server_harness import RunningServer, post_probing_health, server_fixture

server = server_fixture()

CONTROLS = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0)]}


def sessions_file(server: RunningServer) -> Path:
    command = server.process.args
    return Path(command[command.index("--session-db-path") + 1])


def test_a_2mb_batch_of_prompts_is_refused_at_once_while_health_answers(server: RunningServer):
    body = json.dumps({"prompt": ["a"] * 400_000, "max_tokens": 1}).encode()
    answer = post_probing_health(server, "/v1/completions", body, timeout=90)
    assert answer.response.status_code == 400, answer.response.text
    assert answer.response.json()["error"]["param"] == "prompt"
    # (before: the 400 after ~160 s, /health held 15-22 s; generous bounds for a busy 2-vCPU machine)
    assert answer.seconds < 20, answer.seconds
    assert answer.slowest_health < 5, answer.slowest_health


def test_a_path_forging_log_lines_is_one_escaped_access_line(server: RunningServer):
    forged = "/v1/x%0a2026-11-28 00:00:00 INFO pagedchat.access: GET /forged 200%0d%1b[2J%00"
    assert httpx.get(server.url(forged), timeout=30).status_code == 404
    wanted = (
        "GET /v1/x\\n2026-11-28 00:00:00 INFO pagedchat.access: GET /forged 200\\r\\x1b[2J\\x00"
    )
    deadline = time.monotonic() + 10
    while wanted not in (log := server.log()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert wanted in log, log[-2000:]
    (line,) = [line for line in log.split("\n") if "/v1/x" in line]
    assert not CONTROLS & set(line), repr(line)
    assert not any(entry.startswith("2026-11-28 00:00:00") for entry in log.splitlines())


def test_the_session_database_deleted_while_serving_shows_in_health_log_and_writes(
    server: RunningServer,
):
    assert httpx.get(server.url("/health"), timeout=30).json()["sessions"] == "sqlite"
    assert httpx.post(server.url("/v1/sessions"), json={}, timeout=30).status_code == 201
    sessions_file(server).unlink()
    health = httpx.get(server.url("/health"), timeout=30)
    assert health.json()["sessions"] == "unavailable"
    write = httpx.post(server.url("/v1/sessions"), json={}, timeout=30)
    assert write.status_code == 503, write.text
    assert write.json()["error"]["code"] == "session_store_unavailable"
    said = [line for line in server.log().splitlines() if "was deleted while serving" in line]
    assert len(said) == 1 and " ERROR " in said[0]


def test_a_corrupt_session_database_at_start_is_one_line_and_status_2(tmp_path: Path):
    corrupt = tmp_path / "sessions.sqlite3"
    corrupt.write_bytes(b"not a database " * 1000)
    result = start("--session-db-path", str(corrupt))
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = errors(result)
    assert f"session_db_path: {corrupt} is not a usable SQLite database" in line
    assert LOADING not in result.stdout + result.stderr and "Traceback" not in result.stderr
