"""Start-up mistakes are the operator's to fix: each is one line that says what to do, with exit status 2 (3 is
the engine's death only), and those that need no model are found before any weights load."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.server_harness import REPO_ROOT, free_port, server_command, server_env

# uvicorn's line as the lifespan (the model load) begins
LOADING = "Waiting for application startup"


def start(*args: str, port: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        server_command(port or free_port(), args),
        cwd=REPO_ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if " ERROR " in line]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--model", "/no/such/model"), "model: /no/such/model does not exist"),
        (
            ("--redis-url", "http://localhost:6379"),
            "redis_url: 'http://localhost:6379' is not a Redis URL",
        ),
        (
            ("--redis-url", "redis://127.0.0.1:1/0"),
            "redis_url: no Redis answers at redis://127.0.0.1:1/0",
        ),
    ],
)
def test_a_mistake_that_needs_no_model_is_one_line_before_any_weights_load(args, said):
    result = start(*args)
    assert result.returncode == 2
    (line,) = errors(result)
    assert said in line
    assert LOADING not in result.stdout + result.stderr and "Traceback" not in result.stderr


def test_a_busy_port_is_said_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = start(port=taken.getsockname()[1])
    assert result.returncode == 2
    (line,) = errors(result)
    assert "port: cannot listen on" in line and "--port" in line
    assert LOADING not in result.stdout + result.stderr


def test_a_limit_the_model_cannot_meet_is_one_line_and_status_2():
    result = start("--max-model-len", "1000000")
    assert result.returncode == 2, result.stderr
    assert any("max_model_len: 1000000 exceeds" in line for line in errors(result))
    assert "Traceback" not in result.stdout + result.stderr


def test_a_bad_flag_value_is_refused_by_the_parser_with_status_2():
    result = subprocess.run(
        server_command(free_port(), ["--max-queue", "-1"]),
        cwd=REPO_ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "max_queue: must be >= 0" in result.stderr
