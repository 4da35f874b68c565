"""Fairness between tenants, served: a light tenant's stream beside a heavy tenant.

The light tenant sends ``--light-requests`` streamed completions one after another (greedy, ``--light-max-tokens``
each), first alone (its unloaded pace), then beside each heavy load, started once the load is running:

- ``n128``: one request of n = 128 samples (``--heavy-max-tokens`` each);
- ``bestof128``: one request of best_of = 128 (n = 1);
- ``beam128``: one beam search of beam_width = 128;
- ``n32x8``: eight concurrent requests of n = 32;
- ``c64``: 64 concurrent streamed requests;
- ``storm``: 500 clients that connect, send a streamed request and drop the connection after 0-200 ms.

With ``--stop-heavy`` the heavy load is stopped (its client process killed: the server aborts its requests) once the
light tenant is done, so a heavy load of outside-report size (n = 128 x 2,000 tokens) need not run to its end.

Tenants are API keys (the server is started with two). Reported per scenario: the light tenant's TPOT p50 against
its unloaded TPOT p50, its TTFT p50 and max, whether the heavy load finished (every sample's tokens), and how the
storm's requests ended. The goals (issue 22): TPOT p50 <= 2x unloaded and first token <= 2 s on the CPU, <= 1.5x
on a GPU.

    python -m benchmarks.online.fairness                       # the CPU default model
    python -m benchmarks.online.fairness --server-args "--load-format dummy --model-config llama-3.2-1b"   # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from random import Random
from typing import Any

import httpx
import torch

from benchmarks.harness import record
from benchmarks.online.http_client import (
    StreamResult,
    add_server_options,
    banner,
    new_client,
    row,
    server_from_args,
    stream_request,
)

HEAVY_KEY, LIGHT_KEY = "fairness-heavy", "fairness-light"
SCENARIOS = ("n128", "c64", "storm")
WIDE = {  # one or more requests of many samples: (requests, samples each, the request's extra fields)
    "n128": (1, 128, {"n": 128}),
    "bestof128": (1, 1, {"n": 1, "best_of": 128}),
    "beam128": (1, 1, {"n": 1, "use_beam_search": True, "beam_width": 128}),
    "n32x8": (8, 32, {"n": 32}),
}
GOALS = {"cpu": (2.0, 2.0), "cuda": (1.5, None)}  # TPOT ratio, first token seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_server_options(parser)
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated, of " + ", ".join([*WIDE, *SCENARIOS[1:]]),
    )
    parser.add_argument("--light-requests", type=int, default=4)
    parser.add_argument("--light-max-tokens", type=int, default=32)
    parser.add_argument("--heavy-max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=48, help="prompt tokens of every request")
    parser.add_argument("--storm-clients", type=int, default=500)
    parser.add_argument(
        "--heavy-timeout", type=float, default=1800.0, help="seconds the heavy load may take"
    )
    parser.add_argument(
        "--stop-heavy",
        action="store_true",
        help="stop the heavy load once the light tenant is done (not run to its end)",
    )
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def body(rng: Random, args: argparse.Namespace, max_tokens: int, **extra: Any) -> dict[str, Any]:
    prompt = [rng.randrange(100, 20_000) for _ in range(args.prompt_len)]
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        **extra,
    }


def keyed(key: str, timeout_s: float) -> httpx.AsyncClient:
    client = new_client(timeout_s)
    client.headers["Authorization"] = f"Bearer {key}"
    return client


async def light_run(url: str, args: argparse.Namespace, seed: int) -> list[StreamResult]:
    rng = Random(seed)
    async with keyed(LIGHT_KEY, args.request_timeout) as client:
        results = []
        for _ in range(args.light_requests):
            result = await stream_request(client, url, body(rng, args, args.light_max_tokens))
            if not result.ok:
                raise RuntimeError(f"a light request failed: {result.error}")
            results.append(result)
        return results


def light_summary(results: list[StreamResult]) -> dict[str, float]:
    tpots = [r.tpot for r in results if r.tpot is not None]
    ttfts = [r.ttft for r in results if r.ttft is not None]
    return {
        "tpot_p50_ms": statistics.median(tpots) * 1e3,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_max_ms": max(ttfts) * 1e3,
    }


# heavy loads: each returns a task whose result describes how the load ended, and an event set once it runs ----


def heavy_wide(name: str):
    """The load of ``WIDE[name]``: its requests at once, not streamed; finished when every one returned all its
    choices, each of ``--heavy-max-tokens`` tokens."""
    requests, choices, extra = WIDE[name]

    async def load(url: str, args: argparse.Namespace, started: asyncio.Event) -> dict[str, Any]:
        rng = Random(1)
        bodies = [
            {**body(rng, args, args.heavy_max_tokens, stream=False), **extra}
            for _ in range(requests)
        ]
        for request in bodies:
            del request["stream_options"]
        async with keyed(HEAVY_KEY, args.heavy_timeout) as client:
            begin = time.perf_counter()
            tasks = [asyncio.ensure_future(client.post(url, json=b)) for b in bodies]
            await asyncio.sleep(0.5)
            started.set()
            responses = await asyncio.gather(*tasks)
            answers = [r.json() if r.status_code == 200 else {} for r in responses]
            complete = all(
                len(a.get("choices", [])) == choices
                and all(len(c["token_ids"]) == args.heavy_max_tokens for c in a["choices"])
                for a in answers
            )
            return {
                "status": sorted({r.status_code for r in responses}),
                "finished": complete,
                "seconds": time.perf_counter() - begin,
            }

    return load


async def heavy_concurrent(
    url: str, args: argparse.Namespace, started: asyncio.Event
) -> dict[str, Any]:
    rng = Random(2)
    async with keyed(HEAVY_KEY, args.heavy_timeout) as client:
        begin = time.perf_counter()
        tasks = [
            asyncio.ensure_future(
                stream_request(client, url, body(rng, args, args.heavy_max_tokens))
            )
            for _ in range(64)
        ]
        await asyncio.sleep(0.5)
        started.set()
        results = await asyncio.gather(*tasks)
        ok = [r for r in results if r.ok and r.completion_tokens == args.heavy_max_tokens]
        return {
            "finished": len(ok) == 64,
            "completed": len(ok),
            "seconds": time.perf_counter() - begin,
            "errors": sorted({r.error[:80] for r in results if not r.ok}),
        }


async def heavy_storm(url: str, args: argparse.Namespace, started: asyncio.Event) -> dict[str, Any]:
    rng = Random(3)
    outcomes: dict[str, int] = {}

    async def connect_and_drop(delay: float) -> None:
        outcome = "dropped"
        try:
            async with keyed(HEAVY_KEY, 30.0) as client:
                async with client.stream(
                    "POST", url, json=body(rng, args, args.heavy_max_tokens)
                ) as response:
                    if response.status_code != 200:
                        outcome = f"HTTP {response.status_code}"
                    else:
                        await asyncio.sleep(delay)
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    begin = time.perf_counter()
    tasks = [
        asyncio.ensure_future(connect_and_drop(rng.uniform(0.0, 0.2)))
        for _ in range(args.storm_clients)
    ]
    await asyncio.sleep(0.2)
    started.set()
    await asyncio.gather(*tasks)
    return {"finished": True, "outcomes": outcomes, "seconds": time.perf_counter() - begin}


HEAVY = {
    **{name: heavy_wide(name) for name in WIDE},
    "c64": heavy_concurrent,
    "storm": heavy_storm,
}


def heavy_process(
    name: str, url: str, args: argparse.Namespace, messages: multiprocessing.Queue
) -> None:
    """The heavy load in a process of its own: its client work (500 connections, 64 streams) must not delay
    the light tenant's reads, which are what is measured."""

    async def load() -> dict[str, Any]:
        started = asyncio.Event()
        task = asyncio.ensure_future(HEAVY[name](url, args, started))
        await started.wait()
        messages.put("started")
        return await task

    messages.put(asyncio.run(load()))


async def scenario(
    url: str, args: argparse.Namespace, name: str, unloaded: dict[str, float]
) -> dict[str, Any]:
    messages = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(
        target=heavy_process, args=(name, url, args, messages)
    )
    process.start()
    try:
        assert await asyncio.to_thread(messages.get, True, 120.0) == "started"
        light = light_summary(await light_run(url, args, seed=10))
        if args.stop_heavy:
            process.kill()  # (its connections close: the server aborts its requests)
            heavy_result = {"finished": False, "stopped": "after the light tenant's requests"}
        else:
            heavy_result = await asyncio.to_thread(messages.get, True, args.heavy_timeout)
    finally:
        process.join(10.0)
        if process.is_alive():
            process.kill()
    return {
        "light": light,
        "heavy": heavy_result,
        "tpot_ratio": light["tpot_p50_ms"] / unloaded["tpot_p50_ms"],
    }


async def run(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    url = f"{base_url}/v1/completions"
    # (the server runs here, on the same device)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    await light_run(url, args, seed=99)  # warm-up (and the step-cost model's first points)
    unloaded = light_summary(await light_run(url, args, seed=10))
    output: dict[str, Any] = {"device": device, "unloaded": unloaded, "scenarios": {}}
    for name in args.scenarios.split(","):
        output["scenarios"][name] = await scenario(url, args, name, unloaded)
    return output


def report(output: dict[str, Any]) -> None:
    ratio_goal, ttft_goal = GOALS.get(output["device"], GOALS["cuda"])
    print(banner("fairness: a light tenant beside a heavy one"))
    print(row("light TPOT p50, alone (ms)", output["unloaded"]["tpot_p50_ms"]))
    print(row("light TTFT p50, alone (ms)", output["unloaded"]["ttft_p50_ms"]))
    for name, result in output["scenarios"].items():
        light = result["light"]
        print(banner(name, "-"))
        print(row("light TPOT p50 (ms)", light["tpot_p50_ms"]))
        print(row(f"  / alone (goal <= {ratio_goal})", result["tpot_ratio"]))
        print(row("light TTFT p50 (ms)", light["ttft_p50_ms"]))
        print(
            row(
                "light TTFT max (ms)" + (f" (goal <= {ttft_goal * 1e3:.0f})" if ttft_goal else ""),
                light["ttft_max_ms"],
            )
        )
        print(row("heavy finished", str(result["heavy"]["finished"])))
        if "seconds" in result["heavy"]:
            print(row("heavy seconds", result["heavy"]["seconds"]))
        if "outcomes" in result["heavy"]:
            print(row("storm outcomes", json.dumps(result["heavy"]["outcomes"])))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load_before = record.load_average()
    with server_from_args(args, ["--api-key", f"{HEAVY_KEY},{LIGHT_KEY}"]) as base_url:
        output = asyncio.run(run(base_url, args))
    output["environment"] = record.environment(
        __spec__.name, load_before=load_before, argv=argv, server_args=args.server_args
    )
    report(output)
    print(record.environment_line(output["environment"]))
    record.write_json(args.json, output)


if __name__ == "__main__":
    main()
