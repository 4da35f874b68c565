"""Where a workload's wall time goes, step by step: the nano workload run ``--passes`` times in one process
(the first cold, the rest warm), each step's wall time with its shape (sequences, prompt tokens, decode rows),
and the Triton kernels' compiled variants after each pass. A step that is slow only in the first pass is a
one-time cost (a kernel compiled for a new specialization); one slow in every pass is a slow kernel.

    python -m benchmarks.offline.step_trace --model-config llama-3.2-1b [--num-requests 256] [--passes 2] [--slow-ms 50]
    smoke test on the CPU: --device cpu --num-requests 2 --max-prompt-len 8 --max-output-len 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from benchmarks.harness import record
from benchmarks.harness.engine import (
    add_engine_options,
    build_engine,
    compiled_variants,
    greedy,
    synchronize,
)
from benchmarks.harness.workloads import capped, nano_workload
from engine.llm_engine import LLMEngine


@dataclass
class StepRecord:
    seconds: float
    seqs: int
    prompt_tokens: int
    decode_rows: int


def run_pass(engine: LLMEngine, args: argparse.Namespace, label: str) -> list[StepRecord]:
    requests = nano_workload(
        args.num_requests, args.seed, capped(args.max_prompt_len), capped(args.max_output_len)
    )
    for i, request in enumerate(requests):
        engine.add_request(f"{label}-{i}", request.prompt, greedy(request.output_len))
    records = []
    device = engine.config.torch_device
    while engine.has_unfinished_requests():
        synchronize(device)
        start = time.perf_counter()
        batch_before = engine.counters.steps
        engine.step()
        synchronize(device)
        seconds = time.perf_counter() - start
        batch = engine.last_batch if engine.counters.steps > batch_before else None
        if batch is None:
            records.append(StepRecord(seconds, 0, 0, 0))
            continue
        prompt = sum(n for n in batch.num_new_tokens if n > 1)
        decode = sum(1 for n in batch.num_new_tokens if n == 1)
        records.append(StepRecord(seconds, len(batch.seqs), prompt, decode))
    return records


def summarize(label: str, records: list[StepRecord], slow_ms: float) -> None:
    total = sum(r.seconds for r in records)
    mixed = [r for r in records if r.prompt_tokens]
    decode = [r for r in records if not r.prompt_tokens and r.seqs]
    print(f"\n### {label}: {len(records)} steps, {total:.2f} s")
    for name, group in (("with prompt tokens", mixed), ("decode only", decode)):
        if group:
            ms = [r.seconds * 1e3 for r in group]
            print(
                f"- {name}: {len(group)} steps, {sum(ms) / 1e3:.2f} s, median {statistics.median(ms):.2f} ms, "
                f"max {max(ms):.1f} ms"
            )
    slow = [(i, r) for i, r in enumerate(records) if r.seconds * 1e3 >= slow_ms]
    print(f"- steps >= {slow_ms:g} ms: {len(slow)}, {sum(r.seconds for _, r in slow):.2f} s")
    print("\n| step | ms | seqs | prompt tokens | decode rows |\n|---:|---:|---:|---:|---:|")
    for i, r in slow[:40]:
        print(f"| {i} | {r.seconds * 1e3:.1f} | {r.seqs} | {r.prompt_tokens} | {r.decode_rows} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_options(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--slow-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-len", type=int, default=None, help="smoke tests only")
    parser.add_argument("--max-output-len", type=int, default=None, help="smoke tests only")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    engine = build_engine(args, seed=args.seed, enforce_eager=args.enforce_eager)
    env = record.environment(__spec__.name, engine.config.torch_device)
    print(f"## step trace: {args.model_config}, engine start {time.perf_counter() - start:.1f} s")
    print(record.environment_line(env))
    print(f"kernel variants after start: {compiled_variants()}")
    for p in range(args.passes):
        records = run_pass(engine, args, f"pass{p}")
        summarize(f"pass {p + 1} ({'cold' if p == 0 else 'warm'})", records, args.slow_ms)
        print(f"\nkernel variants after pass {p + 1}: {compiled_variants()}")


if __name__ == "__main__":
    main()
