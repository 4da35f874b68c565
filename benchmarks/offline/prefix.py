"""Workload ``shared-prefix`` (shared WORKLOADS.md): TTFT and throughput with prefix caching on vs off.

``--groups`` groups of ``--per-group`` requests; each group shares a ``--prefix-len``-token system prompt
(token ids uniform in [0, 10000), drawn per group), followed by a ``--question-len``-token question drawn
per request; ``--output-len`` greedy tokens each (EOS ignored). Ids come from ``random.Random(--seed)``.
Both modes run in the same command on the same prompts, each on its own engine (dummy weights of
``--model-config``), caching on first; the first engine is freed before the second is built.

Submission: by default all requests are added at once, in group order (a burst: TTFT is mostly time queued),
then ``step()`` runs until all finish. With ``--request-rate R`` requests arrive as a Poisson process of R per
second instead, in a seeded shuffled order (groups interleave, as users of different system prompts do); the
loop adds each request once its arrival time has passed and steps while anything is unfinished. TTFT of a
request = from its arrival (burst: just before the first ``add_request``) to the return of the ``step()`` whose
outputs first carry a token of that request (with async scheduling that is one step after the token's pass).
Output tok/s = output tokens / wall seconds from the same start to the last finish. Prefix hit rate =
prompt tokens found in the cache / prompt tokens looked up at admission (``engine.stats()``, timed run only).
One warm-up round per engine (its own cache salt, so the timed run cannot hit its blocks) precedes timing.

    python -m benchmarks.offline.prefix [--groups 64] [--per-group 16] [--prefix-len 2048] [--question-len 128]
        [--output-len 256] [--request-rate R] [--model-config llama-3.2-1b] [--device auto] [--dtype auto]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import asdict, dataclass
from random import Random
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.harness import record
from benchmarks.harness.engine import (
    add_engine_options,
    build_engine,
    greedy,
    release_memory,
    warm_up,
)
from benchmarks.harness.workloads import shared_prefix_prompts
from engine.llm_engine import LLMEngine

logger = logging.getLogger("benchmarks.offline.prefix")


@dataclass(slots=True)
class ModeResult:
    """One engine over the whole workload."""

    prefix_caching: bool
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    wall_s: float
    output_tokens: int
    output_tok_s: float
    prefix_queries: int
    prefix_hits: int
    prefix_hit_rate: float
    preemptions: int


# the run --------------------------------------------------------------------------------------------------


def arrival_schedule(request_ids: list[str], rate: float, seed: int) -> list[tuple[float, str]]:
    """(seconds after the start, request id) in arrival order: all at 0 in the given order when ``rate`` is
    infinite, else a Poisson process of ``rate`` per second over a seeded shuffle of the ids."""
    if math.isinf(rate):
        return [(0.0, r) for r in request_ids]
    rng = Random(seed)
    order = list(request_ids)
    rng.shuffle(order)
    at, schedule = 0.0, []
    for request_id in order:
        at += rng.expovariate(rate)
        schedule.append((at, request_id))
    return schedule


def run_mode(
    engine: LLMEngine,
    prompts: dict[str, list[int]],
    output_len: int,
    schedule: list[tuple[float, str]],
) -> ModeResult:
    before = engine.stats()
    first: dict[str, float] = {}
    arrived: dict[str, float] = {}
    produced = dict.fromkeys(prompts, 0)
    bar = tqdm(
        total=len(prompts) * output_len,
        unit="tok",
        desc=f"prefix caching {'on' if engine.config.enable_prefix_caching else 'off'}",
    )
    start = time.perf_counter()
    pending = 0  # index of the next arrival in schedule
    while pending < len(schedule) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending < len(schedule) and start + schedule[pending][0] <= now:
            offset, request_id = schedule[pending]
            arrived[request_id] = start + offset
            engine.add_request(request_id, prompts[request_id], greedy(output_len))
            pending += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + schedule[pending][0] - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.token_ids_delta:
                first.setdefault(output.request_id, now)
                produced[output.request_id] += len(output.token_ids_delta)
                bar.update(len(output.token_ids_delta))
    wall = time.perf_counter() - start
    bar.close()
    check_lengths(produced, output_len)
    after = engine.stats()
    ttft_ms = np.array([first[r] - arrived[r] for r in prompts]) * 1e3
    queries, hits = (
        after.prefix_queries - before.prefix_queries,
        after.prefix_hits - before.prefix_hits,
    )
    total = sum(produced.values())
    return ModeResult(
        prefix_caching=engine.config.enable_prefix_caching,
        ttft_p50_ms=float(np.percentile(ttft_ms, 50)),
        ttft_p99_ms=float(np.percentile(ttft_ms, 99)),
        ttft_mean_ms=float(ttft_ms.mean()),
        wall_s=wall,
        output_tokens=total,
        output_tok_s=total / wall,
        prefix_queries=queries,
        prefix_hits=hits,
        prefix_hit_rate=hits / queries if queries else 0.0,
        preemptions=after.preemptions - before.preemptions,
    )


def check_lengths(produced: dict[str, int], output_len: int) -> None:
    wrong = {r: n for r, n in produced.items() if n != output_len}
    if wrong:
        raise RuntimeError(
            f"{len(wrong)} requests produced other than {output_len} tokens, e.g. "
            f"{dict(list(wrong.items())[:3])}"
        )


def run_both(
    args: argparse.Namespace, prompts: dict[str, list[int]]
) -> tuple[list[ModeResult], dict[str, Any]]:
    results, engine_info = [], {}
    for caching in (True, False):
        engine = build_engine(args, enable_prefix_caching=caching, num_kv_blocks=args.num_kv_blocks)
        engine_info = {
            "num_kv_blocks": engine.core.block_manager.num_blocks,
            "block_size": engine.config.block_size,
            "max_num_seqs": engine.config.max_num_seqs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "async_scheduling": engine.config.async_scheduling,
            "dtype": str(engine.config.torch_dtype),
        }
        warm_up(engine, args.prefix_len + args.question_len)
        schedule = arrival_schedule(list(prompts), args.request_rate, args.seed)
        results.append(run_mode(engine, prompts, args.output_len, schedule))
        logger.info("prefix caching %s: %s", "on" if caching else "off", results[-1])
        device = engine.config.torch_device
        del engine
        release_memory(device)
    engine_info["torch_device"] = str(device)
    return results, engine_info


# report ---------------------------------------------------------------------------------------------------


def table(results: list[ModeResult]) -> str:
    on = next(r for r in results if r.prefix_caching)
    rows = [
        (
            "| prefix caching | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | wall (s) | prefix hit rate "
            "| TTFT p50 / caching on |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(
            f"| {'on' if r.prefix_caching else 'off'} | {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | "
            f"{r.output_tok_s:.1f} | {r.wall_s:.2f} | {r.prefix_hit_rate:.1%} | "
            f"{r.ttft_p50_ms / on.ttft_p50_ms:.2f}x |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--question-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: inf, every request at once)",
    )
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="fix the KV pool (default: memory budget)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    add_engine_options(parser)
    args = parser.parse_args(argv)
    if min(args.groups, args.per_group, args.prefix_len + args.question_len, args.output_len) < 1:
        parser.error("--groups, --per-group, --output-len and the prompt length must be >= 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    load_before = record.load_average()
    prompts = shared_prefix_prompts(
        args.groups, args.per_group, args.prefix_len, args.question_len, args.seed
    )
    results, engine_info = run_both(args, prompts)
    env = record.environment(__spec__.name, torch.device(engine_info["torch_device"]), load_before)
    on, off = results
    ratio = off.ttft_p50_ms / on.ttft_p50_ms
    if args.json:
        workload = {
            k: getattr(args, k)
            for k in (
                "groups",
                "per_group",
                "prefix_len",
                "question_len",
                "output_len",
                "seed",
                "model_config",
            )
        }
        workload["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate
        record.write_json(
            args.json,
            {
                "workload": workload,
                "engine": engine_info,
                "environment": env,
                "modes": [asdict(r) for r in results],
                "ttft_p50_ratio_off_on": ratio,
            },
        )
    print(
        f"\n## shared-prefix: {args.groups} groups x {args.per_group} requests, prefix {args.prefix_len} + "
        f"question {args.question_len} tokens, {args.output_len} output tokens, "
        f"{'all at once' if math.isinf(args.request_rate) else f'Poisson {args.request_rate:g} req/s'}; "
        f"{args.model_config} dummy, "
        f"{engine_info['dtype']}, {env['device']}, {engine_info['num_kv_blocks']} KV blocks x "
        f"{engine_info['block_size']}"
    )
    print(record.environment_line(env))
    print(f"p50 TTFT off / on: {ratio:.2f}x\n")
    print(table(results))


if __name__ == "__main__":
    main()
