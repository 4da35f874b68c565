"""Shared parts of the HTTP benchmarks (workloads ``serve`` and ``multi-turn``): the server (and Redis) as
subprocesses, one streamed request timed chunk by chunk, filler prompts, percentiles and report lines.

Nothing here imports the server: the benchmarks talk to it over real HTTP only, like any client.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

import httpx

logger = logging.getLogger("benchmarks.http")

REPO_ROOT = Path(__file__).resolve().parents[2]  # (benchmarks/online/ -> the repository)
REDIS_SERVER = "/usr/bin/redis-server"

# Common English words that byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen) encode as one token each when
# preceded by a space, so n filler words make n prompt tokens (checked on SmolLM2's tokenizer).
_WORD_LIST = """the of and to in is was for on with as by at from that this it be are or an have not but had
his they which one you were her all she there would their we him been has when who will more no if out so said
what up its about into than them can only other new some time could these two may then do first any my now such
like our over man me even most made after also did many before must through back years where much your way well
down should because each just those people how too little state good very make world still own see men work long
get here between both life being under never day same another know while last might us great old year off come
since against go came right used take three"""
WORDS = tuple(_WORD_LIST.split())


# prompts ---------------------------------------------------------------------------------------------------


def int_range(text: str) -> tuple[int, int]:
    """argparse type: ``"128"`` or ``"120-160"`` (inclusive) as (low, high)."""
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LOW-HIGH") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < LOW <= HIGH")
    return bounds


def shown(bounds: tuple[int, int]) -> str:
    return str(bounds[0]) if bounds[0] == bounds[1] else f"{bounds[0]}-{bounds[1]}"


def draw(rng: Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def filler_text(rng: Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


# one streamed request --------------------------------------------------------------------------------------


@dataclass(slots=True)
class StreamResult:
    """One streamed answer, timed on arrival of each SSE event: ``time.perf_counter`` seconds in one process;
    ``time.monotonic`` where client processes are compared (benchmarks.online.sse_client), one clock system-wide."""

    sent_at: float
    done_at: float = 0.0
    # arrivals of token events (see apply_chunk)
    token_times: list[float] = field(default_factory=list)
    # tokens each token event carried: its choice's ``token_ids`` where the server sends them, else 1
    token_counts: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.done_at - self.sent_at

    @property
    def timed(self) -> bool:
        """Whether tokens streamed as they came: a reply of several tokens needs at least two token events
        (a server that sends one event at the end, as ours does without a tokenizer, cannot be timed)."""
        return len(self.token_times) >= min(2, max(1, self.completion_tokens))

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times and self.timed else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (end - first token) / (output tokens - 1)."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.done_at - self.token_times[0]) / (self.completion_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token events."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])] if self.timed else []


def new_client(timeout_s: float) -> httpx.AsyncClient:
    """No connection cap (every simulated client gets its own connection); no proxies from the environment."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits, trust_env=False
    )


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> StreamResult:
    """POST ``body`` (stream=true) and time its SSE events; errors are recorded on the result, not raised."""
    result = StreamResult(sent_at=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (
                    f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                )
            else:
                await _read_events(response, result)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event whose data is not JSON
        result.error = f"{type(exc).__name__}: {exc}"
    result.done_at = result.done_at or time.perf_counter()
    if result.ok and result.finish_reason is None:
        result.error = "the stream ended without a finish_reason"
    return result


async def _read_events(response: httpx.Response, result: StreamResult) -> None:
    """Reads to the end of the body even after ``[DONE]``: a fully read response returns its connection to
    the pool, a half-read one is closed (and the next request would pay for a new connection)."""
    async for data in sse_data(response.aiter_lines()):
        now = time.perf_counter()
        if data == "[DONE]":
            result.done_at = now
        elif not result.done_at and not result.error:
            apply_chunk(json.loads(data), now, result)


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (several data lines of one event joined by newlines)."""
    parts: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            parts.append(line[5:].removeprefix(" "))
        elif not line and parts:
            yield "\n".join(parts)
            parts = []
    if parts:
        yield "\n".join(parts)


def apply_chunk(chunk: dict[str, Any], now: float, result: StreamResult) -> None:
    """A chat.completion.chunk or text_completion chunk: text (chat ``delta.content`` or completions
    ``text``), finish_reason, and the final usage chunk's token counts. Every chunk with a choice is a token
    event (the server sends one when tokens arrive, with their text, possibly empty), except chat's opening
    ``{"role": "assistant", "content": ""}``, which comes before any token. An event counts one token unless
    its choice lists ``token_ids`` (servers that return them: an event may then carry several)."""
    if "error" in chunk:
        result.error = f"error event: {chunk['error'].get('message', chunk['error'])}"
        return
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text = choice.get("text") or delta.get("content") or ""
        if text or "role" not in delta:
            result.token_times.append(now)
            result.token_counts.append(len(choice.get("token_ids") or ()) or 1)
        result.text += text
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    if usage := chunk.get("usage"):
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.completion_tokens = usage.get("completion_tokens", 0)
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# statistics and report lines -------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the two nearest ranks (numpy's default method)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(
    seconds: list[float], percentiles: tuple[float, ...] = (50, 99)
) -> dict[str, float] | None:
    """Mean and percentiles in milliseconds (keys ``mean``, ``p50``, ``p99``); None when there are no values."""
    if not seconds:
        return None
    summary = {"mean": 1e3 * sum(seconds) / len(seconds)}
    summary.update({f"p{p:g}": 1e3 * percentile(seconds, p) for p in percentiles})
    return summary


def banner(title: str, fill: str = "=", width: int = 50) -> str:
    return f" {title} ".center(width, fill) if title else fill * width


def row(label: str, value: float | str | None, decimals: int = 2) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = f"{value:.{decimals}f}"
    else:
        shown = str(value)
    return f"{label:<40} {shown:<10}"


# processes: the server under test, and Redis ---------------------------------------------------------------


def add_server_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument(
        "--base-url", help="a running server (e.g. http://127.0.0.1:8000); default: start one"
    )
    group.add_argument(
        "--server-args",
        default="",
        help="extra `python -m app serve` flags, e.g. "
        '"--kv-cache-memory-gib 1" or "--load-format dummy --model-config llama-3.2-1b"',
    )
    group.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )
    group.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server_from_args(
    args: argparse.Namespace, extra_args: list[str] | None = None
) -> Iterator[str]:
    """The base URL of ``--base-url``, or of a server started here with ``--server-args`` (stopped at exit)."""
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    with local_server(
        shlex.split(args.server_args) + (extra_args or []), args.startup_timeout
    ) as url:
        yield url


@contextlib.contextmanager
def local_server(server_args: list[str], startup_timeout: float) -> Iterator[str]:
    """``python -m app serve`` on a free port, its output in a log file; yields once /health answers 200."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "app",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *server_args,
    ]
    with tempfile.NamedTemporaryFile(
        "w", prefix="pagedchat-bench-server-", suffix=".log", delete=False
    ) as log:
        logger.info("starting the server: %s (log: %s)", shlex.join(command), log.name)
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            # our Ctrl-C must not reach it before we stop it
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_health(url, process, startup_timeout, log.name)
            yield url
        finally:
            # uvicorn shuts down gracefully on SIGTERM
            stop_process(process, signal.SIGTERM, "server")


def wait_for_health(
    url: str, process: subprocess.Popen, timeout_s: float, log_path: str, poll_s: float = 0.5
) -> None:
    """Until ``url``'s /health answers 200, asking every ``poll_s`` (a start timed to the moment: 0.05)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(
                f"the server exited with {process.returncode} during start-up; "
                f"last log lines:\n{tail(log_path)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                logger.info("server ready at %s after %.1f s", url, time.perf_counter() - start)
                return
        time.sleep(poll_s)
    raise RuntimeError(
        f"the server did not answer /health within {timeout_s:.0f} s; log: {log_path}"
    )


def stop_process(
    process: subprocess.Popen, sig: signal.Signals, name: str, grace_s: float = 30.0
) -> None:
    """Signal our own child by its pid; kill it if it has not exited after ``grace_s``."""
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("%s did not stop within %.0f s: killing pid %d", name, grace_s, process.pid)
        process.kill()
        process.wait()


def tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


@contextlib.contextmanager
def local_redis(timeout_s: float = 20.0) -> Iterator[str]:
    """A throw-away redis-server on a free port (no snapshots, no AOF); yields its ``redis://`` URL."""
    port = free_port()
    command = [
        REDIS_SERVER,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_for_redis(port, process, timeout_s)
        logger.info("redis-server ready on port %d (pid %d)", port, process.pid)
        yield f"redis://127.0.0.1:{port}"
    finally:
        stop_process(process, signal.SIGTERM, "redis-server", grace_s=10.0)


def _wait_for_redis(port: int, process: subprocess.Popen, timeout_s: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"redis-server exited with {process.returncode}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock,
        ):
            sock.sendall(b"PING\r\n")
            if sock.recv(16).startswith(b"+PONG"):
                return
        time.sleep(0.1)
    raise RuntimeError(f"redis-server did not answer PING within {timeout_s:.0f} s")
