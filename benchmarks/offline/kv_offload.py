"""KV offload to host memory (issue 13): swap vs recompute preemption, and the host tier of the prefix cache.

Part 1, ``preemption``: ``--requests`` greedy requests (prompt and output lengths uniform in the given ranges,
``random.Random(--seed)``, ids in [0, 10000), EOS ignored), all submitted at once to an engine whose KV pool
(``--pool-blocks``) holds only part of the load, once per ``--preemption-mode`` (recompute, swap, auto) on the
same prompts: wall seconds, output tok/s, preemptions, swap-outs, and the share of requests whose tokens equal
those of the first mode (bf16: a recomputed KV may round differently from the one written step by step, so
a few late tokens may differ; the token-exact checks are the float32 tests).

Part 2, ``host tier``: TTFT of a ``--prefix-len``-token prompt prefix (+ 32 new tokens, one output token) that
was computed once and then evicted from the device pool by ``--fillers`` unrelated prompts of the same length,
with the host tier on (``--host-cache-gib``) and off (recompute), ``--trials`` prefixes each (median); next
to it the TTFT of the same prompt when its prefix is still on the device, and of a cold prompt. TTFT = from
``add_request`` to the ``step()`` that returns the request's token.

    python -m benchmarks.offline.kv_offload [--model-config llama-3.2-1b] [--requests 96] [--pool-blocks 2048]
        [--prefix-len 4096] [--fillers 4] [--trials 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from random import Random
from typing import Any

import torch

from benchmarks.harness import record
from benchmarks.harness.engine import (
    add_engine_options,
    build_engine,
    greedy,
    release_memory,
    warm_up,
)
from engine.llm_engine import LLMEngine

logger = logging.getLogger("benchmarks.offline.kv_offload")
VOCAB = 10000


def random_ids(rng: Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# part 1: preemption ---------------------------------------------------------------------------------------


def preemption_load(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = Random(args.seed)
    load = []
    for _ in range(args.requests):
        prompt_len = rng.randint(*args.prompt_len)
        load.append((random_ids(rng, prompt_len), rng.randint(*args.output_len)))
    return load


def run_load(
    engine: LLMEngine, load: list[tuple[list[int], int]]
) -> tuple[float, dict[str, list[int]]]:
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, (ids, n) in enumerate(load):
        engine.add_request(f"p{i}", ids, greedy(n))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    return time.perf_counter() - start, outputs


def preemption_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    load = preemption_load(args)
    rows, first_outputs = [], None
    for mode in args.preemption_mode:
        engine = build_engine(
            args,
            num_kv_blocks=args.pool_blocks,
            preemption_mode=mode,
            swap_space_gib=args.swap_space_gib,
            max_model_len=args.max_model_len,
        )
        warm_up(engine, 64)
        before = engine.stats()
        swaps_before = engine.core.scheduler.num_swap_outs
        seconds, outputs = run_load(engine, load)
        after = engine.stats()
        first_outputs = first_outputs or outputs
        same = sum(outputs[r] == first_outputs[r] for r in outputs) / len(outputs)
        tokens = sum(len(t) for t in outputs.values())
        rows.append(
            {
                "mode": mode,
                "seconds": seconds,
                "output_tokens": tokens,
                "tok_s": tokens / seconds,
                "preemptions": after.preemptions - before.preemptions,
                "swap_outs": engine.core.scheduler.num_swap_outs - swaps_before,
                "block_bytes": engine.runner.bytes_per_block,
                "same_tokens_as_first_mode": same,
            }
        )
        logger.info("%s", rows[-1])
        device = engine.config.torch_device
        del engine
        release_memory(device)
    return rows


# part 2: host tier ----------------------------------------------------------------------------------------


def ttft(engine: LLMEngine, request_id: str, ids: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, ids, greedy(1))
    seen = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.token_ids_delta and seen is None:
                seen = time.perf_counter() - start
    return seen


def host_tier_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for host_gib in (args.host_cache_gib, 0.0):
        engine = build_engine(
            args,
            num_kv_blocks=args.tier_pool_blocks,
            host_cache_gib=host_gib,
            max_model_len=args.max_model_len,
        )
        warm_up(engine, args.prefix_len + 32)
        rng = Random(args.seed + 1)
        times: dict[str, list[float]] = {"evicted": [], "on device": [], "cold": []}
        cached: list[int] = []
        for t in range(args.trials):
            prefix = random_ids(rng, args.prefix_len)
            ttft(engine, f"t{t}-first", prefix + random_ids(rng, 32))
            for f in range(args.fillers):
                ttft(engine, f"t{t}-filler{f}", random_ids(rng, args.prefix_len + 32))
            hits_before = engine.stats().prefix_hits
            times["evicted"].append(ttft(engine, f"t{t}-again", prefix + random_ids(rng, 32)))
            cached.append(engine.stats().prefix_hits - hits_before)
            times["on device"].append(ttft(engine, f"t{t}-hot", prefix + random_ids(rng, 32)))
            times["cold"].append(ttft(engine, f"t{t}-cold", random_ids(rng, args.prefix_len + 32)))
        stats = engine.stats()
        rows.append(
            {
                "host_cache_gib": host_gib,
                **{
                    f"ttft_{k.replace(' ', '_')}_ms": statistics.median(v) * 1e3
                    for k, v in times.items()
                },
                "evicted_prompt_cached_tokens": statistics.median(cached),
                "host_hits_tokens": stats.prefix_host_hits,
                "host_stores": stats.host_cache_stores,
            }
        )
        logger.info("%s", rows[-1])
        device = engine.config.torch_device
        del engine
        release_memory(device)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(512, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(256, 512))
    parser.add_argument(
        "--pool-blocks", type=int, default=2048, help="KV pool of part 1 (blocks of 16)"
    )
    parser.add_argument("--preemption-mode", nargs="+", default=["recompute", "swap", "auto"])
    parser.add_argument("--swap-space-gib", type=float, default=16.0)
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--fillers", type=int, default=4)
    parser.add_argument(
        "--tier-pool-blocks", type=int, default=1024, help="KV pool of part 2 (blocks of 16)"
    )
    parser.add_argument("--host-cache-gib", type=float, default=8.0)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--parts", nargs="+", default=["preemption", "host-tier"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    add_engine_options(parser)
    args = parser.parse_args(argv)
    if (
        min(args.requests, args.pool_blocks, args.prefix_len, args.trials, args.tier_pool_blocks)
        < 1
    ):
        parser.error("counts and lengths must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    load_before = record.load_average()
    result: dict[str, Any] = {}
    if "preemption" in args.parts:
        result["preemption"] = preemption_part(args)
    if "host-tier" in args.parts:
        result["host_tier"] = host_tier_part(args)
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    result["environment"] = env = record.environment(__spec__.name, device, load_before)
    record.write_json(args.json, result)
    print(f"\n## kv offload: {args.model_config} dummy, {env['device']}")
    print(record.environment_line(env))
    if "preemption" in result:
        print(
            f"\n{args.requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs "
            f"{args.output_len[0]}-{args.output_len[1]} tokens, pool {args.pool_blocks} blocks\n"
        )
        print(
            "| preemption mode | seconds | output tok/s | preemptions | swap-outs | same tokens as first |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for r in result["preemption"]:
            print(
                f"| {r['mode']} | {r['seconds']:.2f} | {r['tok_s']:,.0f} | {r['preemptions']} | {r['swap_outs']} "
                f"| {r['same_tokens_as_first_mode']:.0%} |"
            )
    if "host_tier" in result:
        print(
            f"\nTTFT (median of {args.trials}) of a {args.prefix_len}-token prefix + 32 new tokens, pool "
            f"{args.tier_pool_blocks} blocks, {args.fillers} fillers between\n"
        )
        print(
            "| host tier | evicted prefix (ms) | prefix on device (ms) | cold (ms) | evicted prompt: cached tokens |"
        )
        print("|---|---:|---:|---:|---:|")
        for r in result["host_tier"]:
            label = f"{r['host_cache_gib']:g} GiB" if r["host_cache_gib"] else "off (recompute)"
            print(
                f"| {label} | {r['ttft_evicted_ms']:.1f} | {r['ttft_on_device_ms']:.1f} | {r['ttft_cold_ms']:.1f} "
                f"| {r['evicted_prompt_cached_tokens']:.0f} |"
            )


if __name__ == "__main__":
    main()
