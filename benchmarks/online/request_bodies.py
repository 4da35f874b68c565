"""What reading a request body costs the event loop (app/request_body.py's read_model: size checks, field counts,
pydantic), for the largest bodies a client may send at the default 4 MiB limit: one long message, 60,000 short
messages (refused: at most 4096), 4,096 messages, and a schema of ~400,000 enum values. Median of 5 reads, in the
calling thread, as the event loop runs them.

    python -m benchmarks.online.request_bodies
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from benchmarks.harness import record
from app.errors import APIError
from app.protocol.completions import ChatCompletionRequest
from app.protocol.fields import MAX_MESSAGES
from app.request_body import read_model
from starlette.requests import Request

LIMIT = 4 * 2**20


def request_with(body: bytes) -> Request:
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict:
        return next(messages, {"type": "http.disconnect"})

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return Request(
        {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": headers,
            "query_string": b"",
        },
        receive,
    )


def bodies() -> dict[str, bytes]:
    def chat(**fields) -> bytes:
        return json.dumps(
            {"messages": [{"role": "user", "content": "Pick one."}], **fields}
        ).encode()

    schema = {"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(390_000)]}}}
    return {
        "one 4 MB message": json.dumps(
            {"messages": [{"role": "user", "content": "x" * (LIMIT - 100)}]}
        ).encode(),
        "60,000 short messages": json.dumps(
            {"messages": [{"role": "user", "content": "a"}] * 60_000}
        ).encode(),
        f"{MAX_MESSAGES} messages": json.dumps(
            {"messages": [{"role": "user", "content": "hello " * 20}] * MAX_MESSAGES}
        ).encode(),
        "schema of 390,000 enum values": chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "pick", "schema": schema},
            }
        ),
    }


async def measure(body: bytes) -> tuple[float, str]:
    times, outcome = [], ""
    for _ in range(5):
        start = time.perf_counter()
        try:
            parsed = await read_model(request_with(body), ChatCompletionRequest, LIMIT)
            parsed.structured_output()
            outcome = "read"
        except APIError as exc:
            outcome = f"{exc.status} {exc.param}"
        times.append(time.perf_counter() - start)
    return statistics.median(times), outcome


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    load_before = record.load_average()
    for name, body in bodies().items():
        seconds, outcome = asyncio.run(measure(body))
        print(f"{name:32s} {len(body) / 2**20:5.2f} MiB  {seconds * 1e3:7.1f} ms  {outcome}")
    print(record.environment_line(record.environment(__spec__.name, "cpu", load_before)))


if __name__ == "__main__":
    main()
