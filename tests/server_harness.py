"""A real pagedchat server in a subprocess, for tests that talk HTTP to it.

``running_server(*args, env=...)`` starts ``python -m app serve`` on a free port with a small KV pool, waits until
``GET /health`` answers 200 and stops it (SIGINT, then kill) afterwards. ``server_fixture(*args)`` turns that into
a module-scoped pytest fixture, so a few servers serve a whole test file::

    server = server_fixture("--max-queue", "1")          # in the test module
    def test_x(server: RunningServer): httpx.get(server.url("/health"))

Also: the Prometheus text parsed into numbers, SSE parsing, and the offline engine (the oracle for greedy
outputs) loaded once per test process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
SMALL_KV_GIB = "0.1"


@dataclass(slots=True, eq=False)
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        """Everything the server wrote (stdout and stderr) so far."""
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> Metrics:
        response = httpx.get(self.url("/metrics"), timeout=10)
        response.raise_for_status()
        return Metrics.parse(response.text)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(
    port: int, extra_args: Iterable[str] = (), sessions_path: Path | None = None
) -> list[str]:
    """The small test defaults come first: an option repeated in ``extra_args`` wins (argparse keeps the
    last), e.g. ``--kv-cache-memory-gib 0.5``. Sessions go to a SQLite file of this server's own (the default
    store; ``sessions_path``, else a fresh temporary file), so no two test servers share one by accident."""
    if sessions_path is None:
        sessions_path = (
            Path(tempfile.gettempdir()) / f"pagedchat-test-sessions-{port}-{os.getpid()}.sqlite3"
        )
    return [
        sys.executable,
        "-m",
        "app",
        "serve",
        "--port",
        str(port),
        "--kv-cache-memory-gib",
        SMALL_KV_GIB,
        "--num-threads",
        "1",
        # (one warm grammar worker: each costs a tokenizer load and a compile at every server start)
        "--grammar-workers",
        "1",
        "--log-level",
        "info",
        "--session-db-path",
        str(sessions_path),
        *extra_args,
    ]


def server_env(extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # a key in the developer's shell must not change what the tests see
    env.pop("PAGEDCHAT_API_KEY", None)
    env.pop("PAGEDCHAT_ADMIN_API_KEY", None)
    env.pop("REDIS_URL", None)
    env.pop("PAGEDCHAT_MODEL", None)
    env.update(extra_env or {})
    return env


@contextlib.contextmanager
def running_server(
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = STARTUP_TIMEOUT_S,
) -> Iterator[RunningServer]:
    """Start ``pagedchat serve`` with ``extra_args`` (and ``env`` added to the environment); yield it once
    /health is 200; stop it at exit. A server that dies or never gets healthy fails with its log, and one
    that dies while in use prints its log (pytest shows it with the failing test)."""
    server = _start(list(extra_args), env, startup_timeout)
    try:
        yield server
    finally:
        died = server.process.poll() is not None
        stop_server(server)
        if died:
            sys.stderr.write(
                f"the server exited with {server.process.returncode} while in use; its log:\n"
                f"{server.log()}"
            )
        server.log_path.unlink(missing_ok=True)
        _remove_sessions_file(server)


def _remove_sessions_file(server: RunningServer) -> None:
    """The temporary SQLite file server_command gave it (a test's own ``--session-db-path`` is kept)."""
    command = server.process.args
    path = Path(command[command.index("--session-db-path") + 1])
    if path.name.startswith("pagedchat-test-sessions-"):
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)


def _start(
    extra_args: list[str], env: Mapping[str, str] | None, startup_timeout: float, attempts: int = 3
) -> RunningServer:
    """Another process may take the free port before the server binds it: then try another port."""
    for attempt in range(attempts):
        port = free_port()
        fd, name = tempfile.mkstemp(prefix=f"pagedchat-server-{port}-", suffix=".log")
        # a file, not a pipe: a chatty server never blocks on a full pipe
        with os.fdopen(fd, "wb") as log_file:
            process = subprocess.Popen(
                server_command(port, extra_args),
                cwd=REPO_ROOT,
                env=server_env(env),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        server = RunningServer(f"http://127.0.0.1:{port}", process, Path(name), extra_args)
        problem = _wait_until_healthy(server, startup_timeout)
        if problem is None:
            return server
        log = server.log()
        stop_server(server)
        server.log_path.unlink(missing_ok=True)
        if "address already in use" not in log.lower() or attempt == attempts - 1:
            pytest.fail(f"{problem}; its log:\n{log}", pytrace=False)
    raise AssertionError("unreachable")


def _wait_until_healthy(server: RunningServer, timeout: float) -> str | None:
    """None once /health is 200, else what went wrong."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return f"the server exited with {server.process.returncode} before it was healthy"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url("/health"), timeout=2).status_code == 200:
                return None
        time.sleep(0.25)
    return f"the server was not healthy within {timeout:.0f} s"


def stop_server(server: RunningServer) -> None:
    """SIGINT (uvicorn's graceful shutdown), then SIGKILL if it lingers."""
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)


@dataclass(slots=True)
class ProbedAnswer:
    response: httpx.Response
    seconds: float  # until the answer came
    slowest_health: float  # the longest /health took meanwhile: how long the event loop was held


def post_probing_health(
    server: RunningServer, path: str, content: bytes, timeout: float = 120
) -> ProbedAnswer:
    """POST ``content`` (JSON) to ``path`` while /health is asked again and again until the answer comes."""
    answer: dict[str, Any] = {}

    def send() -> None:
        start = time.monotonic()
        answer["response"] = httpx.post(
            server.url(path),
            content=content,
            headers={"content-type": "application/json"},
            timeout=timeout,
        )
        answer["seconds"] = time.monotonic() - start

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(server.url("/health"), timeout=timeout).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.02)
    sender.join()
    return ProbedAnswer(answer["response"], answer["seconds"], slowest)


def server_fixture(
    *extra_args: str, env: Mapping[str, str] | None = None, scope: str = "module"
) -> Callable[..., Any]:
    """A pytest fixture (module scope by default) yielding a RunningServer started with these options;
    assign it to a name in the test module."""

    @pytest.fixture(scope=scope)
    def _server() -> Iterator[RunningServer]:
        with running_server(*extra_args, env=env) as server:
            yield server

    return _server


# metrics --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Metrics:
    """Prometheus text exposition as ``{(name, frozenset(labels)): value}``."""

    samples: dict[tuple[str, frozenset], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        from prometheus_client.parser import text_string_to_metric_families

        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return cls(samples)

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        """The one sample called ``name`` whose labels include ``labels`` (``default`` when there is none)."""
        found = [
            v for (n, ls), v in self.samples.items() if n == name and set(labels.items()) <= ls
        ]
        if not found and default is not None:
            return default
        assert len(found) == 1, f"{len(found)} samples of {name} {labels}"
        return found[0]

    def finished(self, reason: str) -> float:
        return self.value("pagedchat:request_success_total", default=0.0, finished_reason=reason)

    @property
    def running(self) -> float:
        return self.value("pagedchat:num_requests_running")

    @property
    def waiting(self) -> float:
        return self.value("pagedchat:num_requests_waiting")

    @property
    def kv_usage(self) -> float:
        return self.value("pagedchat:kv_cache_usage_perc")


def wait_for_metrics(
    server: RunningServer, condition: Callable[[Metrics], bool], what: str, timeout: float = 30.0
) -> Metrics:
    """Poll /metrics until ``condition`` holds (the engine's numbers are snapshots taken between steps, and
    aborted requests' blocks are freed at the next step); fail with the last numbers otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if condition(metrics):
            return metrics
        if time.monotonic() > deadline:
            pytest.fail(
                f"not {what} after {timeout:.0f} s: running={metrics.running} waiting={metrics.waiting} "
                f"kv_usage={metrics.kv_usage}"
            )
        time.sleep(0.1)


def wait_until_idle(server: RunningServer, timeout: float = 30.0) -> Metrics:
    """Nothing running or waiting, and no KV block held by a request."""
    return wait_for_metrics(
        server, lambda m: m.running == 0 and m.waiting == 0 and m.kv_usage == 0, "idle", timeout
    )


# SSE ------------------------------------------------------------------------------------------------


def sse_data(lines: Iterable[str]) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (comments such as pings are skipped). Asserts every
    event is a single ``data:`` line, as our writer and OpenAI's send them."""
    payloads, event_lines = [], []
    for line in [*lines, ""]:
        if line:
            event_lines.append(line)
            continue
        data = [x for x in event_lines if not x.startswith(":")]
        event_lines = []
        if data:
            assert len(data) == 1 and data[0].startswith("data: "), data
            payloads.append(data[0].removeprefix("data: "))
    return payloads


def sse_chunks(payloads: list[str]) -> list[dict[str, Any]]:
    """The JSON chunks of a stream that ends with ``[DONE]`` (asserted: last, and only once)."""
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    assert payloads.count("[DONE]") == 1
    return [json.loads(p) for p in payloads[:-1]]


# the offline oracle ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def offline_llm() -> Any:
    """The offline engine on the same default model: what greedy outputs must equal."""
    from engine import LLM

    with one_torch_thread():
        return LLM(kv_cache_memory_gib=float(SMALL_KV_GIB))


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a while: beside a server process on a small shared CPU, two threads each
    oversubscribe the cores (we measured a 24-token generation go from 3 s to 45 s)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def offline_generate(prompts: list[str] | list[list[int]], **sampling: Any) -> list[Any]:
    """``LLM.generate`` (a string is encoded like ``tokenizer.encode(text)``), memoised: several tests
    compare against the same prompts."""
    key = json.dumps([prompts, sampling], sort_keys=True)
    if key not in _OFFLINE_OUTPUTS:
        from engine.sampling_params import SamplingParams

        with one_torch_thread():
            _OFFLINE_OUTPUTS[key] = offline_llm().generate(prompts, SamplingParams(**sampling))
    return _OFFLINE_OUTPUTS[key]


def offline_chat(messages: list[dict[str, str]], **sampling: Any) -> Any:
    """One conversation through the chat template, as the server renders it."""
    return offline_generate([offline_llm().chat_prompt_ids(messages)], **sampling)[0]


_OFFLINE_OUTPUTS: dict[str, list[Any]] = {}


def read_until_content(lines: Iterator[str], timeout: float = 60.0) -> None:
    """Read SSE lines until the first chunk with content (the stream is answering)."""
    deadline = time.monotonic() + timeout
    for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
            return
        assert time.monotonic() < deadline, "no content chunk in time"
    pytest.fail("the stream ended before its first content chunk")
