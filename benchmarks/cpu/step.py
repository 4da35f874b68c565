"""Where a CPU decode step of the default model spends its time, per path: the module path (float32 weights),
the lean Python decoder (bfloat16, int8 and q4 weights; q4 with the native step switched off) and the native
decode step (q4).

For 1 and ``--streams`` concurrent streams (the cpu workload's chat prompts, greedy), ``--steps`` decode steps
after a warm-up are timed (wall ms per step, median of ``--repeats`` runs) and profiled with torch.profiler: the
share of the step in the weight matmuls (the projections and the output layer: their ATen ops' self time) and
the rest (attention, norms, rotary, glue, sampling, Python).

    python -m benchmarks.cpu.step [--threads 2] [--streams 8] [--steps 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import record
from engine.llm import LLM
from engine.sampling_params import SamplingParams

MATMUL_OPS = (
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::_weight_int8pack_mm",
    "aten::mm",
    "aten::addmm",
    "aten::matmul",
    "aten::linear",
)
NATIVE_MATMULS = ("::int8_linear", "::q4q8_linear", "::q8q8_linear")  # (pagedchat_cpu_<level>::...)


def is_matmul(key: str) -> bool:
    return key in MATMUL_OPS or (key.startswith("pagedchat_cpu") and key.endswith(NATIVE_MATMULS))


# path: (cpu_weights, native decode step kept); the 8-bit and 4-bit modes use the native packed int8 output layer
PATHS = {
    "modules, float32": ("float32", True),
    "lean Python, bfloat16": ("bfloat16", True),
    "lean Python, int8": ("int8", True),
    "lean Python, q4": ("q4", False),
    "native step, q4": ("q4", True),
}
QUESTION = "Write a short story about a lighthouse keeper."


@dataclass(slots=True)
class StepProfile:
    path: str
    streams: int
    wall_ms: float  # median over repeats of the mean step
    matmul_ms: float  # per step, from the profiled run
    other_ms: float

    @property
    def other_share(self) -> float:
        return self.other_ms / (self.matmul_ms + self.other_ms)


def start_streams(llm: LLM, streams: int, tag: str) -> None:
    prompt = llm.chat_prompt_ids([{"role": "user", "content": QUESTION}])
    for i in range(streams):
        llm.engine.add_request(
            f"{tag}-{i}",
            prompt,
            SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True),
            cache_salt=tag,
        )
    while (
        any(not seq.num_output_tokens for seq in llm.engine.scheduler.running)
        or llm.engine.scheduler.waiting
    ):
        llm.engine.step()  # past the prefill: every later step is decode-only


def measure(llm: LLM, path: str, streams: int, steps: int, repeats: int) -> StepProfile:
    walls = []
    for r in range(repeats):
        start_streams(llm, streams, f"{path}-{streams}-{r}")
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        walls.append((time.perf_counter() - start) / steps * 1e3)
        for request_id in [f"{path}-{streams}-{r}-{i}" for i in range(streams)]:
            llm.engine.abort_request(request_id)
        llm.engine.step()
    start_streams(llm, streams, f"{path}-{streams}-profiled")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.engine.step()
    for i in range(streams):
        llm.engine.abort_request(f"{path}-{streams}-profiled-{i}")
    llm.engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if is_matmul(e.key))
    wall = statistics.median(walls)
    # the profiler's own overhead inflates the step; split the unprofiled wall time by the profiled shares
    return StepProfile(path, streams, wall, wall * matmul / total, wall * (total - matmul) / total)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = record.load_average()
    results = []
    for path, (weights, native) in PATHS.items():
        llm = LLM(num_threads=args.threads, dtype="float32", cpu_weights=weights)
        decoder = llm.engine.model.cpu_decoder
        if decoder is not None and not native:
            decoder.native_step = None
        for streams in (1, args.streams):
            results.append(measure(llm, path, streams, args.steps, args.repeats))
        del llm
    print(
        "\n| path | streams | ms / decode step | in weight matmuls (ms) | rest (ms) | rest, share |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.path} | {r.streams} | {r.wall_ms:.2f} | {r.matmul_ms:.2f} | {r.other_ms:.2f} | "
            f"{r.other_share:.0%} |"
        )
    env = record.environment(__spec__.name, "cpu", load_before=load_before, threads=args.threads)
    print(record.environment_line(env))
    steps = [{**asdict(r), "other_share": r.other_share} for r in results]
    record.write_json(args.json, {"environment": env, "steps": steps})


if __name__ == "__main__":
    main()
