"""The host's share of one decode step, without a model: scheduling, input packing and the sampler's per-row
work at a given batch.

With CUDA graphs the device runs a decode step of a 1B model in a few milliseconds, and with async
scheduling the host's work for step N+1 overlaps the device's step N, so the host work per step must stay
below the device time. This measures that host work on any machine (no GPU needed):
``python -m benchmarks.offline.host_step --batch 256 --context 640``. "sample" is ``Sampler.__call__`` over
random logits of a 256-token vocabulary (its per-row checks; the argmax itself is a few microseconds here and an
asynchronous launch on a GPU).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.harness import record
from engine.core.block_hash import BlockHasher
from engine.core.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.sequence import Sequence
from engine.kv_backend.paged import PagedKV
from engine.sample.sampler import Sampler
from engine.worker.step_inputs import StepInputs


def decode_ready(
    batch: int, context: int, block_size: int, seed: int
) -> tuple[Scheduler, StepInputs]:
    """``batch`` sequences with ``context`` computed tokens each and one new token to decode."""
    rng = random.Random(seed)
    blocks = batch * (context // block_size + 8)
    manager = BlockManager(blocks, block_size, True, BlockHasher("sha256", "host-step", ""))
    scheduler = Scheduler(manager, batch, max(2048, batch))
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(10000) for _ in range(context)]
        scheduler.add(Sequence(seq_id=i, request_id=str(i), token_ids=ids, params=params))
    while scheduler.waiting or any(s.num_uncomputed_tokens for s in scheduler.running):
        step = scheduler.schedule()
        scheduler.advance(list(zip(step.seqs, step.num_new_tokens)))
    for seq in scheduler.running:
        seq.append_token(rng.randrange(10000))
    max_blocks = context // block_size + 64
    return scheduler, StepInputs(
        torch.device("cpu"),
        block_size,
        max(2048, batch),
        batch + 1,
        max_blocks,
        PagedKV(1, 1, 1, torch.float32, torch.device("cpu"), block_size),
    )


def measure(batch: int, context: int, steps: int, pad: bool) -> dict[str, float]:
    scheduler, inputs = decode_ready(batch, context, 16, seed=0)
    times: dict[str, list[float]] = {"schedule": [], "prepare": [], "sample": [], "advance": []}
    sampler, logits = Sampler(), torch.randn(batch, 256, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        t0 = time.perf_counter()
        step = scheduler.schedule()
        t1 = time.perf_counter()
        inputs.build(step, {}, batch if pad else None)
        t2 = time.perf_counter()
        sampler(logits[: len(step.sampling_seqs)], step.sampling_seqs, (0,))
        t3 = time.perf_counter()
        for seq in step.sampling_seqs:
            seq.append_token(7)
        scheduler.advance(list(zip(step.seqs, step.num_new_tokens)))
        t4 = time.perf_counter()
        for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[name].append(seconds * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_before = record.load_average()
    rows = {batch: measure(batch, args.context, args.steps, pad=True) for batch in args.batch}
    env = record.environment(__spec__.name, "cpu", load_before=load_before)
    record.write_json(
        args.json,
        {"environment": env, "context": args.context, "steps": args.steps, "median_ms": rows},
    )
    print(f"\nhost work per decode step, context {args.context}, median of {args.steps} steps (ms)")
    print("| batch | schedule | prepare inputs | sample | advance + append | total |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, row in rows.items():
        print(
            f"| {batch} | {row['schedule']:.3f} | {row['prepare']:.3f} | {row['sample']:.3f} "
            f"| {row['advance']:.3f} | {sum(row.values()):.3f} |"
        )
    print(record.environment_line(env))


if __name__ == "__main__":
    main()
