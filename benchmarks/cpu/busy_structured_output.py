"""Structured output on a busy small CPU (issue 49): a server started beside a busy-looping neighbour
(``python -c "while True: pass"``) answers ``response_format`` requests from the first one on, none a 400.

    python -m benchmarks.cpu.busy_structured_output [--requests 20] [--neighbours 1] [--json FILE]

The neighbour starts before the server (the server's start is loaded too). Once /health is 200 the requests are
sent one after another, the first at once: ``{"type": "json_object"}`` and three JSON schemas in turn. Each answer
counts as valid when it is a 200 whose content is JSON of the right shape (an object for json_object; valid against
its schema, checked with jsonschema). The acceptance (issue 49): all valid, none a 400, the first included.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import jsonschema

from benchmarks.harness import record
from benchmarks.harness.processes import neighbours
from benchmarks.online.http_client import add_server_options, local_server

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "palette": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    "place": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
}
FORMATS = ("json_object", *SCHEMAS)
# (a prompt that leads the default model to a short object: asked to describe "a json_object", it nests until
# max_tokens)
PROMPTS = {"json_object": "Give a JSON object with a short greeting."}


@dataclass(slots=True)
class Answer:
    format: str
    status: int
    seconds: float
    valid: bool
    detail: str


def response_format(name: str) -> dict[str, Any]:
    if name == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def check(name: str, content: str) -> str | None:
    """None when ``content`` is JSON of the format's shape; else what is wrong."""
    try:
        value = json.loads(content)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if name == "json_object":
        return None if isinstance(value, dict) else "not an object"
    try:
        jsonschema.validate(value, SCHEMAS[name])
    except jsonschema.ValidationError as exc:
        return f"not valid against its schema: {exc.message}"
    return None


def ask(client: httpx.Client, base_url: str, name: str, max_tokens: int) -> Answer:
    body = {
        "messages": [{"role": "user", "content": PROMPTS.get(name, f"Describe a {name} as JSON.")}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_format": response_format(name),
    }
    start = time.perf_counter()
    reply = client.post(f"{base_url}/v1/chat/completions", json=body)
    seconds = time.perf_counter() - start
    if reply.status_code != 200:
        return Answer(name, reply.status_code, seconds, False, reply.text[:300])
    choice = reply.json()["choices"][0]
    problem = (
        "cut at max_tokens"
        if choice.get("finish_reason") == "length"
        else check(name, choice["message"]["content"])
    )
    return Answer(name, 200, seconds, problem is None, problem or choice["message"]["content"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument(
        "--neighbours", type=int, default=1, help="busy-looping processes beside it"
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", help="write the results here")
    add_server_options(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    load_before = record.load_average()
    answers: list[Answer] = []
    with neighbours(args.neighbours):
        began = time.perf_counter()
        with (
            local_server(shlex.split(args.server_args), args.startup_timeout) as url,
            httpx.Client(timeout=args.request_timeout, trust_env=False) as client,
        ):
            healthy_s = time.perf_counter() - began
            for i in range(args.requests):
                answers.append(ask(client, url, FORMATS[i % len(FORMATS)], args.max_tokens))
                print(
                    f"{i + 1:>3} {answers[-1].format:<12} {answers[-1].status} "
                    f"{answers[-1].seconds:6.2f} s  {'valid' if answers[-1].valid else 'INVALID'}  "
                    f"{answers[-1].detail[:90]!r}",
                    flush=True,
                )
    report(args, answers, healthy_s, load_before)


def report(
    args: argparse.Namespace, answers: list[Answer], healthy_s: float, load_before: float
) -> None:
    valid = sum(a.valid for a in answers)
    refused = sum(a.status == 400 for a in answers)
    print(
        f"beside {args.neighbours} busy neighbour(s): /health 200 after {healthy_s:.1f} s; "
        f"{valid} of {len(answers)} response_format answers valid, {refused} a 400; the first: "
        f"{answers[0].status} in {answers[0].seconds:.2f} s "
        f"({'valid' if answers[0].valid else 'invalid'})"
    )
    env = record.environment(
        __spec__.name, None, load_before, neighbours=args.neighbours, server_args=args.server_args
    )
    print(record.environment_line(env))
    summary = {"valid": valid, "requests": len(answers), "status_400": refused}
    summary["healthy_s"] = healthy_s
    record.write_json(
        args.json, {"environment": env, **summary, "answers": [asdict(a) for a in answers]}
    )


if __name__ == "__main__":
    main()
