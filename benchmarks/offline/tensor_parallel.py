"""Tensor parallelism's scaling: the same dummy-weights model at each tensor-parallel size, one engine after the other.

For each size N of ``--sizes`` (in this one process; each engine is shut down and its memory released before the
next starts) the engine is built with ``tensor_parallel_size=N`` (ranks on cuda:0 .. N-1, NCCL; gloo processes on
the CPU), then measured with benchmarks/offline/nano.py's own code:

* nano (shared WORKLOADS.md): ``--num-requests`` requests, prompt and output lengths uniform in [100, 1024], greedy,
  EOS ignored; throughput = output tokens / wall seconds from submitting every request to the last finishing.
* steady decode step: ``--split-batch`` requests of ``--split-prompt-len``-token prompts all decoding (offline's
  ``measure_split``): wall ms per step over ``--split-steps`` steps, and the GPU busy ms per step from torch.profiler.
* collectives: one more torch.profiler run over ``--split-steps`` steps of the same decode batch: the summed time of
  the CUDA kernels whose name holds "AllReduce", "all_reduce", "nccl" or "signal_driver" (any case: the layers'
  all-reduces, also the logits' all-gather or rank 0's wait for the others' logits, and the sampled ids' broadcast) and its share of that run's GPU busy time. An NCCL
  kernel's time includes waiting for the slower rank to arrive.

torch.profiler runs in rank 0's process, so every GPU number is rank 0's kernels on cuda:0 (the other ranks run
the same kernels on their shards); on the CPU the profiled parts are skipped.

    python -m benchmarks.offline.tensor_parallel --model-config llama-3-8b --sizes 1 2 [--json PATH] [--num-requests 256]
        [--split-batch 256] [--split-steps 50] [--max-model-len N] [--gpu-memory-utilization 0.9]
        [--all-reduce auto|two_shot|nccl]
    smoke test on the CPU: --model-config qwen3-0.6b --device cpu --sizes 1 2 --num-requests 2 --max-prompt-len 8
        --max-output-len 4 --split-batch 2 --split-steps 2 --max-model-len 64

Columns of the table:
  size             tensor_parallel_size (processes and devices)
  start s          engine build: every rank's weights, KV sizing, CUDA graph capture
  nano tok/s       nano's output tokens per wall second; "vs base": over the base size's (size 1 when run, else
                   the first size)
  step ms          the steady decode step's wall ms, mean (median); "vs base": its mean over the base size's
  GPU busy ms      rank 0's GPU busy time per decode step (union of kernel intervals)
  all-reduce ms    rank 0's collective kernel time per decode step (the collectives above, and the one-shot
                   all-reduce's kernels, "one_shot"); share: of the GPU busy time of the same profiled steps
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.harness import record
from benchmarks.harness.engine import build_engine, release_memory, synchronize
from benchmarks.harness.workloads import Request, capped, nano_workload
from benchmarks.offline.nano import (
    add_run_options,
    busy_us,
    fill_decode_batch,
    kernel_times,
    measure_split,
    run_ours,
)
from engine.config import ALL_REDUCE_CHOICES
from engine.device_defaults import resolve_device
from engine.llm_engine import LLMEngine
from engine.worker.dummy_model import DUMMY_ARCHITECTURES

logger = logging.getLogger("benchmarks.offline.tensor_parallel")

COLLECTIVE_MARKS = ("allreduce", "all_reduce", "nccl", "one_shot", "signal_driver")
# the kernels (by name) of most time per step, reported with the collectives  # matched against
# kernel names in lower case
TOP_KERNELS = 15


# one size ------------------------------------------------------------------------------------------------


def start_engine(args: argparse.Namespace, size: int) -> tuple[LLMEngine, float]:
    """The engine of ``size`` ranks and the seconds its start took."""
    start = time.perf_counter()
    engine = build_engine(
        args,
        seed=args.seed,
        tensor_parallel_size=size,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        all_reduce=args.all_reduce,
    )
    return engine, time.perf_counter() - start


def profile_collectives(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Per step of the running batch, from one torch.profiler run in this process (rank 0): the collectives'
    kernel ms, the GPU busy ms (union of kernel intervals) and the former's share of the latter."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(engine.config.torch_device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        synchronize(engine.config.torch_device)
    kernels = [
        e
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]
    collective = [e for e in kernels if any(mark in e.name.lower() for mark in COLLECTIVE_MARKS)]
    all_reduce_ms = sum(e.time_range.elapsed_us() for e in collective) * 1e-3 / steps
    busy_ms = busy_us([(e.time_range.start, e.time_range.end) for e in kernels]) * 1e-3 / steps
    top = list(kernel_times(kernels, steps, by="elapsed").items())[:TOP_KERNELS]
    added_by_name = kernel_times(kernels, steps, by="added")
    return {
        "all_reduce_ms": all_reduce_ms,
        "busy_ms": busy_ms,
        "share": all_reduce_ms / busy_ms if busy_ms else 0.0,
        "kernels_per_step": len(collective) / steps,
        "top_kernels_ms": dict(top),
        # the same kernels' share of the busy time: their time no earlier kernel covers (PDL overlaps them)
        "top_kernels_added_ms": {name: added_by_name[name] for name, _ in top},
    }


def measure_collectives(engine: LLMEngine, args: argparse.Namespace) -> dict[str, float] | None:
    """``profile_collectives`` at the split's decode batch (its prompts again: prefix hits where still cached);
    None on the CPU."""
    if engine.config.torch_device.type != "cuda":
        return None
    rids = fill_decode_batch(engine, args.split_batch, args.split_prompt_len, args.seed + 1)
    for _ in range(args.split_warmup):
        engine.step()
    result = profile_collectives(engine, args.split_steps)
    for rid in rids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def run_size(args: argparse.Namespace, size: int, requests: list[Request]) -> dict[str, Any]:
    """Build the engine of ``size`` ranks, measure it, shut it down and release its memory."""
    engine, start_seconds = start_engine(args, size)
    device = engine.config.torch_device
    try:
        logger.info("size %d: started in %.1f s", size, start_seconds)
        run = run_ours(engine, requests, start_seconds)
        logger.info("size %d: nano %.0f tok/s", size, run.tok_s)
        split = measure_split(engine, args)
        collectives = measure_collectives(engine, args)
        result = {
            "size": size,
            "start_seconds": start_seconds,
            "dtype": str(engine.config.torch_dtype),
            "run": asdict(run) | {"tok_s": run.tok_s},
            "split": split,
            "collectives": collectives,
        }
        # (before the shutdown)
        logger.info("size %d: decode step %s; collectives %s", size, split, collectives)
    finally:
        engine.shutdown()
        del engine
        release_memory(device)
    if device.type == "cuda":
        logger.info(
            "size %d freed: %.2f GiB still allocated",
            size,
            torch.cuda.memory_allocated(device) / 2**30,
        )
    return result


# report --------------------------------------------------------------------------------------------------


def ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def size_table(results: list[dict[str, Any]]) -> str:
    base = next((r for r in results if r["size"] == 1), results[0])
    vs = f"vs size {base['size']}"
    header = f"| size | start s | nano tok/s | {vs} | step ms mean (median) | {vs} | GPU busy ms | all-reduce ms |"
    rows = [header + " all-reduce share |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        split, coll = r["split"], r["collectives"] or {}
        share = f"{100 * coll['share']:.1f}%" if coll else "-"
        rows.append(
            f"| {r['size']} | {r['start_seconds']:.1f} | {r['run']['tok_s']:.0f} | "
            f"{ratio(r['run']['tok_s'], base['run']['tok_s'])} | {ms(split['wall_ms_mean'])} "
            f"({ms(split['wall_ms_median'])}) | {ratio(split['wall_ms_mean'], base['split']['wall_ms_mean'])} "
            f"| {ms(split.get('gpu_busy_ms'))} | {ms(coll.get('all_reduce_ms'))} | {share} |"
        )
    return "\n".join(rows)


def print_report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    env, sizes = result["environment"], result["sizes"]
    gpus = f" x {env['device_count']} visible" if sizes[0]["collectives"] is not None else ""
    print(
        f"\n## tensor parallel: {args.model_config}, dummy weights, {sizes[0]['dtype']}, {env['device']}{gpus}",
        flush=True,
    )
    print(record.environment_line(env))
    print(
        f"nano: {args.num_requests} requests; decode step: batch {args.split_batch} x {args.split_prompt_len}-token "
        f"prompts, {args.split_steps} steps"
        + ("; GPU numbers are rank 0's (cuda:0)" if gpus else "")
    )
    print("\n" + size_table(sizes), flush=True)
    for r in sizes:
        if r["collectives"]:
            print(
                f"\nsize {r['size']}: the kernels of most GPU ms per decode step (rank 0): elapsed, and "
                "added to the busy time (what no earlier kernel covers; they differ under PDL)"
            )
            added = r["collectives"].get("top_kernels_added_ms", {})
            for name, value in r["collectives"]["top_kernels_ms"].items():
                print(f"  {value:7.3f}  {added.get(name, float('nan')):7.3f}  {name}")


# main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-config", required=True, choices=sorted(DUMMY_ARCHITECTURES))
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes, run in order"
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument(
        "--all-reduce",
        choices=ALL_REDUCE_CHOICES,
        default="auto",
        help="EngineConfig.all_reduce: auto (symmetric memory for small all-reduces, one barrier each, and "
        "the logits written into rank 0's), two_shot (the same with the two-barrier kernel), nccl",
    )
    add_run_options(parser)  # (--max-prompt-len clips the split's prompts too)
    args = parser.parse_args(argv)
    if (
        min(
            args.num_requests,
            args.split_batch,
            args.split_steps,
            args.split_prompt_len,
            *args.sizes,
        )
        < 1
    ):
        parser.error("--sizes, --num-requests and --split-* must be >= 1")
    if args.max_prompt_len:
        args.split_prompt_len = min(args.split_prompt_len, args.max_prompt_len)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    requests = nano_workload(
        args.num_requests, args.seed, capped(args.max_prompt_len), capped(args.max_output_len)
    )
    logger.info(
        "%d requests: %d prompt tokens, %d output tokens; sizes %s",
        len(requests),
        sum(len(r.prompt) for r in requests),
        sum(r.output_len for r in requests),
        args.sizes,
    )
    device, load_before = resolve_device(args.device), record.load_average()
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    result: dict[str, Any] = {"model": args.model_config, "sizes": []}
    for size in args.sizes:
        result["sizes"].append(run_size(args, size, requests))
        result["environment"] = record.environment(
            __spec__.name, device, load_before, device_count=count
        )
        record.write_json(args.json, result)
    print_report(args, result)


if __name__ == "__main__":
    main()
