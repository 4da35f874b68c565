"""Streaming clients spread over several processes, so that the client is never what a served benchmark measures.

At C = 256 a GPU server sends tens of thousands of SSE events a second; one Python process parsing them with
httpx runs out of CPU first, and its late reads would show up as the server's latency. Here the requests are
dealt round-robin to N spawned processes, each running its share on asyncio with a lean HTTP/1.1 client (one
connection per request, the response read as chunked transfer-encoding or plain bytes, split into events on
blank lines). Every timestamp is ``time.monotonic()``: CLOCK_MONOTONIC, one clock for every process on Linux
(``perf_counter`` makes no such promise), so the parent can merge the timings.

Each process also reports its own load (CPU seconds over wall seconds while sending): near 1 it was busy all
the time, and its timings are suspect.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import queue
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from benchmarks.online.http_client import StreamResult, apply_chunk

START_TIMEOUT_S = 120.0  # for the client processes to start (spawn imports this module afresh)
BUSY_SHARE = 0.8  # a client process busier than this (CPU / wall) may have delayed its reads


@dataclass(slots=True)
class ClientLoad:
    """How hard one client process worked: ``cpu_s / wall_s`` near 1 means it was the bottleneck."""

    requests: int
    events: int  # SSE token events parsed
    wall_s: float
    cpu_s: float

    @property
    def busy(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0

    @property
    def events_per_cpu_s(self) -> float:
        """What this process could parse flat out: its capacity, in events per second."""
        return self.events / self.cpu_s if self.cpu_s else 0.0


def run_clients(
    url: str,
    bodies: list[dict[str, Any]],
    offsets: list[float],
    concurrency: int | None,
    processes: int,
    timeout_s: float,
) -> tuple[list[StreamResult], list[ClientLoad]]:
    """Send ``bodies`` (each at its offset in seconds after the start, at most ``concurrency`` in flight in all)
    from ``processes`` spawned processes; the results in the order of ``bodies``, and each process's load."""
    processes = max(1, min(processes, len(bodies)))
    context = multiprocessing.get_context("spawn")
    start_line = context.Barrier(processes + 1)
    results: multiprocessing.Queue = context.Queue()
    workers = [
        context.Process(
            target=_worker,
            daemon=True,
            args=(
                i,
                url,
                bodies[i::processes],
                offsets[i::processes],
                concurrency_share(concurrency, i, processes),
                timeout_s,
                start_line,
                results,
            ),
        )
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        start_line.wait(START_TIMEOUT_S)  # every process has imported and parsed its share: go
        shares = _collect(results, workers, timeout_s + START_TIMEOUT_S)
    finally:
        for worker in workers:
            worker.join(5)
            if worker.is_alive():
                worker.kill()
    merged: list[StreamResult] = [None] * len(bodies)  # type: ignore[list-item]
    for i, (share, _) in enumerate(shares):
        merged[i::processes] = share
    return merged, [load for _, load in shares]


def concurrency_share(concurrency: int | None, index: int, processes: int) -> int | None:
    """Process ``index``'s part of the in-flight limit (the parts add up to it; at least one each)."""
    if concurrency is None:
        return None
    return max(1, concurrency // processes + (index < concurrency % processes))


def _collect(
    results: multiprocessing.Queue, workers: list[Any], timeout_s: float
) -> list[tuple[list[StreamResult], ClientLoad]]:
    shares: dict[int, tuple[list[StreamResult], ClientLoad]] = {}
    deadline = time.monotonic() + timeout_s
    while len(shares) < len(workers):
        try:
            index, error, share = results.get(timeout=1.0)
        except queue.Empty:
            dead = [w.pid for w in workers if not w.is_alive() and w.exitcode]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"client processes failed or hung (died: {dead})") from None
            continue
        if error is not None:
            raise RuntimeError(f"client process {index} failed: {error}")
        shares[index] = share
    return [shares[i] for i in range(len(workers))]


# one client process ----------------------------------------------------------------------------------------


def _worker(
    index: int,
    url: str,
    bodies: list[dict[str, Any]],
    offsets: list[float],
    concurrency: int | None,
    timeout_s: float,
    start_line: Any,
    results: multiprocessing.Queue,
) -> None:
    """Entry point of a spawned process: its share of the load, then (index, error, (results, load)) on the
    queue."""
    try:
        payloads = [json.dumps(body, separators=(",", ":")).encode() for body in bodies]
        start_line.wait(START_TIMEOUT_S)
        wall, cpu = time.monotonic(), time.process_time()
        share = asyncio.run(_send_all(url, payloads, offsets, concurrency, timeout_s))
        load = ClientLoad(
            len(share),
            sum(len(r.token_times) for r in share),
            time.monotonic() - wall,
            time.process_time() - cpu,
        )
        results.put((index, None, (share, load)))
    except BaseException as exc:  # noqa: BLE001 - the parent must hear of it rather than wait
        results.put((index, f"{type(exc).__name__}: {exc}", None))


async def _send_all(
    url: str, payloads: list[bytes], offsets: list[float], concurrency: int | None, timeout_s: float
) -> list[StreamResult]:
    """Each request at its offset after this process's start, at most ``concurrency`` in flight."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"{url}: the lean client speaks plain http only")
    target = (parts.hostname or "127.0.0.1", parts.port or 80, parts.path)
    gate = asyncio.Semaphore(concurrency) if concurrency else None

    async def send(payload: bytes, offset: float) -> StreamResult:
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        if gate is None:
            return await stream_sse(*target, payload, timeout_s)
        async with gate:
            return await stream_sse(*target, payload, timeout_s)

    start = time.monotonic()
    return list(await asyncio.gather(*(send(p, o) for p, o in zip(payloads, offsets))))


# the lean HTTP/1.1 client ----------------------------------------------------------------------------------


async def stream_sse(
    host: str, port: int, path: str, payload: bytes, timeout_s: float
) -> StreamResult:
    """POST ``payload`` (a JSON body with stream=true) and time its SSE events; errors are recorded on the
    result, not raised (as ``http_client.stream_request`` does, whose chunk parser this shares)."""
    result = StreamResult(sent_at=time.monotonic())
    try:
        async with asyncio.timeout(timeout_s):
            await _exchange(host, port, path, payload, result)
    # ValueError: bad JSON
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.done_at = result.done_at or time.monotonic()
    if result.ok and result.finish_reason is None:
        result.error = "the stream ended without a finish_reason"
    return result


async def _exchange(host: str, port: int, path: str, payload: bytes, result: StreamResult) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request_head(host, port, path, len(payload)) + payload)
        result.status, headers = await _read_head(reader)
        pieces = body_pieces(reader, headers)
        if result.status != 200:
            body = b"".join([piece async for piece in pieces])
            result.error = f"HTTP {result.status}: {body.decode(errors='replace')[:300]}"
            return
        await read_events(pieces, result)
    finally:
        writer.close()


def _request_head(host: str, port: int, path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status code and the headers (names lower-cased)."""
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> Any:
    """The body as it arrives: the data of each chunk (chunked transfer-encoding), else what each read brings."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while size := int((await reader.readline()).split(b";")[0], 16):
            yield (await reader.readexactly(size + 2))[:-2]  # (the chunk's trailing CRLF)
        return
    remaining = int(headers.get("content-length", -1))
    while remaining and (
        piece := await reader.read(65536 if remaining < 0 else min(remaining, 65536))
    ):
        remaining -= len(piece) if remaining > 0 else 0
        yield piece


async def read_events(pieces: Any, result: StreamResult) -> None:
    """Split the body into events (a blank line ends one) and apply each ``data:``; every event completed by
    one piece is timed at that piece's arrival. Reads to the end, as the server closes the connection."""
    buffer = b""
    async for piece in pieces:
        now = time.monotonic()
        buffer += piece.replace(b"\r\n", b"\n") if b"\r" in piece else piece
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            data = event_data(event)
            if data is None:
                continue  # a comment (sse-starlette's ping) or an empty event
            if data == b"[DONE]":
                result.done_at = now
            elif not result.done_at and not result.error:
                apply_chunk(json.loads(data), now, result)


def event_data(event: bytes) -> bytes | None:
    """The ``data`` of one event (several data lines joined by newlines); None when it has none."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None
