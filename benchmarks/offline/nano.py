"""Workload ``nano`` (shared WORKLOADS.md): offline throughput, ours against transformers continuous batching.

256 requests; prompt and output lengths uniform in [100, 1024] (``random.Random(seed)``: per request the prompt
length, its ids uniform in [0, 10000), then the output length); greedy, EOS ignored; random weights of a named
architecture (``load_format="dummy"``). Throughput = output tokens / wall seconds from submitting every request
to the last one finishing; ours hands out the final outputs only, as ``LLM.generate`` does (``--stream-outputs``:
an output per sample per step, as a server's output path builds them). Engine start (weights, KV sizing, CUDA
graph capture) is timed apart.
Peer in the same run, on the same weights and requests: transformers continuous batching
(``continuous_batching_context_manager`` / ``add_request`` / ``get_result``). Its failure is reported, never
fatal. ``--split`` then measures ours at a steady decode batch (256 x 640-token prompts): wall ms per step,
GPU kernel ms per step (torch.profiler) and the engine's host phases per step (``engine.counters``).

    python -m benchmarks.offline.nano --model-config llama-3.2-1b|qwen3-0.6b [--no-peer] [--peer-num-requests N]
        [--num-requests 256] [--enforce-eager] [--no-warm-up] [--max-model-len N] [--no-split] [--stream-outputs]
        [--json PATH]
    smoke test on the CPU: --device cpu --num-requests 2 --max-prompt-len 8 --max-output-len 4 --no-peer --no-split
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from dataclasses import asdict, fields
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.harness import record
from benchmarks.harness.engine import (
    Run,
    build_engine,
    compiled_variants,
    greedy,
    release_memory,
    synchronize,
)
from benchmarks.harness.peers import run_peer
from benchmarks.harness.workloads import VOCAB, Request, capped, nano_workload
from engine.llm_engine import LLMEngine
from engine.worker.dummy_model import DUMMY_ARCHITECTURES

logger = logging.getLogger("benchmarks.offline.nano")

PHASES = ("schedule", "prepare", "launch", "wait", "output")


# ours ----------------------------------------------------------------------------------------------------


def start_engine(args: argparse.Namespace) -> tuple[LLMEngine, float]:
    """The engine and the seconds its start took."""
    start = time.perf_counter()
    engine = build_engine(
        args,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        warm_up=getattr(args, "warm_up", True),
    )
    return engine, time.perf_counter() - start


def drive(
    engine: LLMEngine,
    requests: list[Request],
    prefix: str,
    progress: bool = False,
    stream: bool = False,
) -> int:
    """Submit every request, step until all finish; returns the output tokens (each request's exact count
    checked). As the offline ``LLM.generate`` runs (nano-vllm's benchmark calls it): the final outputs only,
    unless ``stream`` (an output per sample per step, as a server's output path builds them)."""
    for i, request in enumerate(requests):
        engine.add_request(f"{prefix}-{i}", request.prompt, greedy(request.output_len))
    produced: dict[str, int] = {}
    counted = engine.counters.generation_tokens
    streamed = 0  # the core's count: an independent tally of the same tokens
    with tqdm(
        total=sum(r.output_len for r in requests), unit="tok", desc=prefix, disable=not progress
    ) as bar:
        while engine.has_unfinished_requests():
            outputs = engine.step(finals_only=not stream)
            step_tokens = engine.counters.generation_tokens - counted - streamed
            streamed += step_tokens
            bar.update(step_tokens)
            produced.update((o.request_id, len(o.token_ids)) for o in outputs if o.finished)
    wrong = [
        (i, produced.get(f"{prefix}-{i}"), r.output_len)
        for i, r in enumerate(requests)
        if produced.get(f"{prefix}-{i}") != r.output_len
    ]
    assert not wrong, f"{prefix}: (request, tokens produced, requested) differ: {wrong[:5]}"
    assert streamed == sum(produced.values()), (streamed, sum(produced.values()))
    return streamed


def run_ours(
    engine: LLMEngine, requests: list[Request], start_seconds: float, stream: bool = False
) -> Run:
    # short, from other draws: one-time costs (kernel compilation, allocator) fall outside the timing
    warm = nano_workload(
        min(8, len(requests)),
        1_000_003,
        capped(min(256, max(len(r.prompt) for r in requests))),
        capped(min(32, max(r.output_len for r in requests))),
    )
    run = Run(
        "pagedchat", len(requests), sum(r.output_len for r in requests), start_seconds=start_seconds
    )
    device = engine.config.torch_device
    start = time.perf_counter()
    drive(engine, warm, "warm-up")
    synchronize(device)
    run.warmup_seconds = time.perf_counter() - start
    counters = engine.counters
    before = {p: getattr(counters, f"{p}_seconds") for p in PHASES}
    steps_before, compiled_before = counters.steps, compiled_variants()
    start = time.perf_counter()
    run.output_tokens = drive(engine, requests, "ours", progress=True, stream=stream)
    synchronize(device)
    run.seconds = time.perf_counter() - start
    run.steps = counters.steps - steps_before
    run.phase_seconds = {p: getattr(counters, f"{p}_seconds") - before[p] for p in PHASES}
    run.compiled = {
        k: n - compiled_before.get(k, 0)
        for k, n in compiled_variants().items()
        if n > compiled_before.get(k, 0)
    }
    assert run.output_tokens == run.requested_tokens, (run.output_tokens, run.requested_tokens)
    return run


# per-step split at a steady decode batch -----------------------------------------------------------------


def fill_decode_batch(engine: LLMEngine, batch: int, prompt_len: int, seed: int) -> list[str]:
    """``batch`` requests whose prompts are all computed: each has produced at least one token."""
    rng = random.Random(seed)
    rids = [f"split-{i}" for i in range(batch)]
    room = engine.config.max_model_len - prompt_len
    for rid in rids:
        engine.add_request(rid, [rng.randrange(VOCAB) for _ in range(prompt_len)], greedy(room))
    waiting = set(rids)
    while waiting:
        waiting -= {o.request_id for o in engine.step() if o.token_ids_delta}
    return rids


def time_steps(engine: LLMEngine, steps: int) -> dict[str, Any]:
    """Wall time per step (one-step-lagged pipeline: a step's wall includes waiting for the previous one, so
    the mean over consecutive steps is the steady-state step time) and the host phases from the counters."""
    counters, device = engine.counters, engine.config.torch_device
    before = {p: getattr(counters, f"{p}_seconds", 0.0) for p in PHASES}
    tokens_before = counters.generation_tokens
    synchronize(device)
    walls, finished = [], 0
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        finished += sum(o.finished for o in engine.step())
        walls.append(time.perf_counter() - t)
    synchronize(device)
    total = time.perf_counter() - start
    phases = {p: (getattr(counters, f"{p}_seconds", 0.0) - before[p]) * 1e3 / steps for p in PHASES}
    return {
        "wall_ms_mean": total * 1e3 / steps,
        "wall_ms_median": statistics.median(walls) * 1e3,
        "host_ms": phases,
        "tokens_per_step": (counters.generation_tokens - tokens_before) / steps,
        "finished_during": finished,
    }


def profile_steps(engine: LLMEngine, steps: int) -> dict[str, Any]:
    """GPU time per step from torch.profiler: all device events, kernels only (no memcpy/memset), and the
    busy time (union of kernel intervals: overlapping kernels counted once)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(engine.config.torch_device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        synchronize(engine.config.torch_device)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    per_step_ms = 1e-3 / steps
    return {
        "gpu_all_ms": sum(e.time_range.elapsed_us() for e in events) * per_step_ms,
        "gpu_kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) * per_step_ms,
        "gpu_busy_ms": busy_us([(e.time_range.start, e.time_range.end) for e in kernels])
        * per_step_ms,
        "kernels_per_step": len(kernels) / steps,
        "kernels_added_ms": dict(
            list(kernel_times(kernels, steps, by="added").items())[:TOP_KERNELS]
        ),
        "idle_before_ms": dict(list(idle_before(events, steps).items())[:TOP_KERNELS]),
    }


TOP_KERNELS = 12  # kernels (by name) listed in a profile


def kernel_times(kernels: list, steps: int, by: str) -> dict[str, float]:
    """ms per step of each kernel name (first 80 characters), most first: ``by="elapsed"`` sums the kernels'
    own intervals, ``by="added"`` what each adds to the busy union (``added_us``; they differ under PDL)."""
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    own = added_us(intervals) if by == "added" else [end - start for start, end in intervals]
    totals: dict[str, float] = {}
    for e, us in zip(kernels, own):
        totals[e.name[:80]] = totals.get(e.name[:80], 0.0) + us * 1e-3 / steps
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def idle_before(events: list, steps: int) -> dict[str, float]:
    """ms per step that the device sat idle (no kernel, copy or set running) just before each event name
    (first 80 characters) started, most first: where a step's wall goes beyond its busy time."""
    totals: dict[str, float] = {}
    reach = None
    for e in sorted(events, key=lambda e: e.time_range.start):
        start, end = e.time_range.start, e.time_range.end
        if reach is not None and start > reach:
            name = e.name[:80]
            totals[name] = totals.get(name, 0.0) + (start - reach) * 1e-3 / steps
        reach = end if reach is None else max(reach, end)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def added_us(intervals: list[tuple[float, float]]) -> list[float]:
    """What each [start, end) interval adds to the union of the ones that start before it, in the order given:
    its time that nothing earlier covers. With programmatic dependent launch a kernel starts before the one ahead
    of it ends and waits, so its own elapsed time counts that wait; this does not. Sums to ``busy_us``."""
    added = [0.0] * len(intervals)
    reach = float("-inf")
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i]):
        start, end = intervals[i]
        if end > reach:
            added[i] = end - max(start, reach)
            reach = end
    return added


def measure_split(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    rids = fill_decode_batch(engine, args.split_batch, args.split_prompt_len, args.seed + 1)
    for _ in range(args.split_warmup):
        engine.step()
    split = {
        "batch": args.split_batch,
        "prompt_len": args.split_prompt_len,
        "steps": args.split_steps,
        "running": engine.stats().num_running,
        **time_steps(engine, args.split_steps),
    }
    if engine.config.torch_device.type == "cuda":
        split.update(profile_steps(engine, args.split_steps))
        split["wall_over_gpu"] = (
            split["wall_ms_mean"] / split["gpu_busy_ms"] if split["gpu_busy_ms"] else None
        )
    for rid in rids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return split


# report --------------------------------------------------------------------------------------------------


def throughput_table(model: str, runs: list[Run]) -> str:
    ours, peer = runs[0], runs[1] if len(runs) > 1 else None
    rows = [
        "| engine | model | requests | output tokens | seconds | out tok/s | ratio vs peer |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        ratio = f"{ours.tok_s / peer.tok_s:.2f}x" if run is ours and peer and peer.tok_s else "-"
        if run.error and not run.seconds:
            rows.append(
                f"| {run.engine} | {model} | {run.requests} | - | - | failed: {run.error[:80]} | - |"
            )
            continue
        rows.append(
            f"| {run.engine} | {model} | {run.requests} | {run.output_tokens} | {run.seconds:.2f} | "
            f"{run.tok_s:.0f} | {ratio} |"
        )
    return "\n".join(rows)


def split_table(split: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        return f"{split[key]:.3f}" if split.get(key) is not None else "-"

    ratio = f"{split['wall_over_gpu']:.2f}" if split.get("wall_over_gpu") else "-"
    title = f"ours, decode batch {split['batch']} (prompt {split['prompt_len']}), {split['steps']} steps"
    rows = [
        f"| {title} | ms/step |",
        "|---|---:|",
        f"| wall, mean (median) | {ms('wall_ms_mean')} ({ms('wall_ms_median')}) |",
        f"| GPU kernels (all device events) | {ms('gpu_kernel_ms')} ({ms('gpu_all_ms')}) |",
        f"| GPU busy (kernel union) | {ms('gpu_busy_ms')} |",
        f"| wall / GPU busy | {ratio} |",
    ]
    rows += [f"| host: {phase} | {split['host_ms'][phase]:.3f} |" for phase in PHASES]
    other = split["wall_ms_mean"] - sum(split["host_ms"].values())
    rows.append(f"| host: other (wall - phases) | {other:.3f} |")
    rows.append(
        f"| tokens/step, running, kernels/step | {split['tokens_per_step']:.0f}, {split['running']}, "
        f"{split.get('kernels_per_step', 0):.0f} |"
    )
    rows += [
        f"| kernel (added to busy): {name[:60]} | {value:.3f} |"
        for name, value in split.get("kernels_added_ms", {}).items()
    ]
    rows += [
        f"| device idle before: {name[:60]} | {value:.3f} |"
        for name, value in split.get("idle_before_ms", {}).items()
    ]
    return "\n".join(rows)


def print_report(args: argparse.Namespace, result: dict[str, Any], runs: list[Run]) -> None:
    env = result["environment"]
    print(
        f"\n## nano: {args.model_config}, dummy weights, {result['dtype']}, {env['device']}",
        flush=True,
    )
    print(record.environment_line(env))
    for run in runs:
        print(
            f"{run.engine}: start {run.start_seconds:.1f} s (weights, KV cache, CUDA graphs), warm-up "
            f"{run.warmup_seconds:.1f} s" + (f"; error: {run.error}" if run.error else "")
        )
    if len(runs) > 1 and runs[1].requests < runs[0].requests:
        print(
            f"NOTE: the peer ran a SUBSET: the first {runs[1].requests} of {runs[0].requests} requests"
        )
    print("\n" + throughput_table(args.model_config, runs), flush=True)
    ours = runs[0]
    if ours.steps:
        phases = ", ".join(f"{p} {1e3 * s / ours.steps:.2f}" for p, s in ours.phase_seconds.items())
        print(
            f"\nours over the timed run: {ours.steps} steps, {1e3 * ours.seconds / ours.steps:.2f} ms/step; host "
            f"ms/step: {phases}; Triton variants compiled inside it: {ours.compiled or 'none'}"
        )
    if result.get("split"):
        print("\n" + split_table(result["split"]), flush=True)


# main ----------------------------------------------------------------------------------------------------


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of a nano run and its steady decode step (``--split-*``), shared with the benchmarks that
    reuse this one's code (benchmarks/offline/tensor_parallel.py)."""
    parser.add_argument("--split-batch", type=int, default=256)
    parser.add_argument("--split-prompt-len", type=int, default=640)
    parser.add_argument("--split-steps", type=int, default=50)
    parser.add_argument("--split-warmup", type=int, default=10)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto = bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="the KV cache's dtype"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-prompt-len", type=int, help="smoke tests only: clip the prompt lengths"
    )
    parser.add_argument(
        "--max-output-len", type=int, help="smoke tests only: clip the output lengths"
    )
    parser.add_argument(
        "--stream-outputs",
        action="store_true",
        help="an output per sample per step (a server's output path), not the final outputs only",
    )
    parser.add_argument("--json", metavar="PATH")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-config", required=True, choices=sorted(DUMMY_ARCHITECTURES))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--peer-num-requests", type=int, help="run the peer on the first N requests (default all)"
    )
    parser.add_argument(
        "--peer-attn", help="transformers attn_implementation (default: transformers' choice)"
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=1200.0, help="seconds before the peer is given up"
    )
    parser.add_argument("--split", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's start-up kernel warm-up (engine/worker/warm_up.py)",
    )
    add_run_options(parser)
    args = parser.parse_args(argv)
    if min(args.num_requests, args.split_batch, args.split_steps, args.split_prompt_len) < 1:
        parser.error("--num-requests and --split-* must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    load_before = record.load_average()
    requests = nano_workload(
        args.num_requests, args.seed, capped(args.max_prompt_len), capped(args.max_output_len)
    )
    logger.info(
        "%d requests: %d prompt tokens, %d output tokens",
        len(requests),
        sum(len(r.prompt) for r in requests),
        sum(r.output_len for r in requests),
    )
    engine, start_seconds = start_engine(args)
    device, dtype = engine.config.torch_device, engine.config.torch_dtype
    config = {
        f.name: str(getattr(engine.config, f.name))
        for f in fields(engine.config)
        if f.name != "hf_config"
    }
    result: dict[str, Any] = {
        "model": args.model_config,
        "dtype": str(dtype),
        "engine_config": config,
        "outputs": "every step" if args.stream_outputs else "final only",
    }

    def save() -> None:  # after each part, so that a later part's failure keeps the earlier numbers
        result["environment"] = record.environment(__spec__.name, device, load_before)
        record.write_json(args.json, result)

    runs = [run_ours(engine, requests, start_seconds, args.stream_outputs)]
    result["runs"] = [asdict(run) | {"tok_s": run.tok_s} for run in runs]
    save()
    if args.split:
        result["split"] = measure_split(engine, args)
        save()
    del engine
    release_memory(device)
    if device.type == "cuda":
        logger.info(
            "ours freed: %.2f GiB still allocated", torch.cuda.memory_allocated(device) / 2**30
        )
    if args.peer:
        runs.append(run_peer(args, requests[: args.peer_num_requests or None], device, dtype))
        result["runs"] = [asdict(run) | {"tok_s": run.tok_s} for run in runs]
        if runs[1].tok_s:
            result["ratio_vs_peer"] = runs[0].tok_s / runs[1].tok_s
        save()
    print_report(args, result, runs)


if __name__ == "__main__":
    main()
