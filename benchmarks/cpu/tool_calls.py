"""What a grammar-constrained tool call costs a stream (issue 51): time per output token of a forced tool call
against an unconstrained reply of the same model, one stream at a time, on a server started here.

    python -m benchmarks.cpu.tool_calls [--rounds 7] [--max-tokens 64] [--json FILE] [--server-args "..."]

Each round sends, one after the other (interleaved, so drift in the machine's speed hits both alike):
- ``plain``: the question, no tools, ``ignore_eos`` (the reply runs to max_tokens), under the system message the
  server writes for the tools (the default model's template renders none): the same prompt as the others;
- ``required``: the same question with two tools and ``tool_choice: "required"`` (parallel calls on, so the
  grammar keeps allowing calls and the reply runs to max_tokens or the model's end);
- ``auto``: ``tool_choice: "auto"``: the lazy grammar, text until a call starts.
TPOT is (last token - first token) / (tokens - 1), timed on the client as the SSE events arrive; the medians of the
rounds are compared. The acceptance: required's TPOT within 1.2x plain's. Every call's arguments are checked to
parse (a malformed call is an error, not a number).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import statistics
from typing import Any

from app.chat_format.formats import SYNTAXES, ChatFormat
from app.chat_format.plan import ToolUse, tool_instructions
from app.protocol.tools import Tool
from benchmarks.harness import record
from benchmarks.online.http_client import (
    StreamResult,
    add_server_options,
    new_client,
    served_model,
    server_from_args,
    stream_request,
)

QUESTION = [{"role": "user", "content": "What is the weather in Paris and the time in Rome?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]


def described_tools() -> list[dict[str, str]]:
    """The system message the server writes for a template that renders no tools (the default model's): the
    plain reply gets the same prompt as the calls, so only the grammar differs."""
    use = ToolUse.of([Tool.model_validate(t) for t in TOOLS], "required", True)
    fmt = ChatFormat(SYNTAXES["hermes"], False, {}, None)
    return [{"role": "system", "content": tool_instructions(fmt, use)}]


def bodies(model: str, max_tokens: int) -> dict[str, dict[str, Any]]:
    common = {
        "model": model,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    return {
        "plain": {**common, "messages": described_tools() + QUESTION, "ignore_eos": True},
        "required": {**common, "tools": TOOLS, "tool_choice": "required"},
        "auto": {**common, "tools": TOOLS, "tool_choice": "auto"},
    }


async def run(base_url: str, rounds: int, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    async with new_client(timeout_s) as client:
        model = await served_model(client, base_url)
        url = f"{base_url}/v1/chat/completions"
        kinds = bodies(model, max_tokens)
        for body in kinds.values():  # warm: grammar compiled, caches filled
            await stream_request(client, url, body)
        results: dict[str, list[StreamResult]] = {kind: [] for kind in kinds}
        for _ in range(rounds):
            for kind, body in kinds.items():
                result = await stream_request(client, url, body)
                if not result.ok:
                    raise SystemExit(f"{kind}: {result.error}")
                results[kind].append(result)
    summary: dict[str, Any] = {}
    for kind, runs in results.items():
        tpots = [r.tpot for r in runs if r.tpot is not None]
        summary[kind] = {
            "tpot_ms_median": round(statistics.median(tpots) * 1e3, 3),
            "tpot_ms_all": [round(t * 1e3, 3) for t in tpots],
            "completion_tokens": [r.completion_tokens for r in runs],
            "ttft_ms_median": round(statistics.median(r.ttft for r in runs if r.ttft) * 1e3, 1),
            "prompt_tokens": runs[0].prompt_tokens,
        }
    plain = summary["plain"]["tpot_ms_median"]
    for kind in ("required", "auto"):
        summary[kind]["tpot_vs_plain"] = round(summary[kind]["tpot_ms_median"] / plain, 3)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    add_server_options(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_before = record.load_average()
    with server_from_args(args) as base_url:
        summary = asyncio.run(run(base_url, args.rounds, args.max_tokens, args.request_timeout))
    for kind, numbers in summary.items():
        ratio = numbers.get("tpot_vs_plain")
        print(
            f"{kind:9s} TPOT median {numbers['tpot_ms_median']:7.2f} ms"
            + (f"  ({ratio:.3f}x plain)" if ratio else "")
            + f"  TTFT {numbers['ttft_ms_median']:.0f} ms  prompt {numbers['prompt_tokens']}"
            + f"  tokens {numbers['completion_tokens']}"
        )
    env = record.environment(
        __spec__.name, None, load_before, server_args=shlex.split(args.server_args)
    )
    print(record.environment_line(env))
    record.write_json(
        args.json,
        {"environment": env, "rounds": args.rounds, "max_tokens": args.max_tokens, **summary},
    )


if __name__ == "__main__":
    main()
