"""Where the whole nano run's wall time goes on the device, against each part's floor: the nano workload (shared
WORKLOADS.md) run once on other draws (untimed), then timed as ``benchmarks.offline.nano`` runs it, then again
under torch.profiler (device kernels only); the prefix cache is emptied before each pass (outside its timing), so
every prompt is computed each time, as in the nano run.

Kernel time is split by what each kernel is (the busy time each one adds to the union of kernel intervals, so
overlapped kernels count once): the persistent decode, decode attention, prefill attention, matrix products
(cuBLAS and ours), the rest (norms, rotary, KV stores, activations, sampling); what is left of the wall is device
idle. Each part beside
its floor, counted from the workload and the model:

- decode attention: every KV byte a decode step attends, once, at the device's read ceiling;
- matrix products: per decode step the larger of the weights read once and the step's FLOPs at the matrix rate,
  plus the prompts' FLOPs at the matrix rate (the output head only for each prompt's last token);
- the rest and idle: 0;
- the persistent decode (every decoder layer of a step in one kernel, at few rows): its steps' floors are counted
  in the two above (it is a few percent of the run).

Device idle is the timed pass's wall minus the profiled pass's busy time (the profiler's own host work slows the
host, not the kernels); the idle under the profiler is reported beside it, split by the kind of step the device
waited for: the profiled pass launches a marker kernel (``torch.cuda._sleep``, ~1 us) as each step begins, so the
kernels between two markers are one step's, and each gap between kernels belongs to the step whose kernel ends it.
Steps are grouped by their shape (prompt tokens in it, else its decode rows), each group with its steps, busy time,
idle time (and how much of it came before a step's first kernel, and before which kernels) and the host's mean wall
per step in the timed pass.

The ceilings are measured in the same run (a Triton kernel reading 2 GiB once; a 8192 x 8192 x 8192 bf16
matmul), as the device's METHOD.md asks.

    python -m benchmarks.offline.nano_profile --model-config llama-3.2-1b [--num-requests 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.harness import record
from benchmarks.harness.engine import add_engine_options, build_engine, greedy, synchronize
from benchmarks.harness.graph_timing import graph_ms
from benchmarks.harness.workloads import nano_workload
from benchmarks.kernel.decode_attention_mixed import read_ms
from benchmarks.offline.nano import added_us, busy_us
from engine.llm_engine import LLMEngine

# kernel name fragments of each part, first match wins (names as torch.profiler reports them)
PARTS = {
    # (whole decoder layers in one kernel, at <= 16 rows: llama-3.2-1b's shapes only)
    "persistent decode": ("persistent_decode",),
    "decode attention": ("_decode_kernel",),
    "prefill attention": ("prefill",),
    "matrix products": ("gemm", "nvjet", "cutlass", "sm90_xmma", "skinny", "splitk", "cublas"),
}


# the marker kernel's name (torch.cuda._sleep) and the decode-only steps' groups by rows
MARKER = "spin_kernel"
DECODE_GROUPS = (16, 64, 192)


@dataclass
class StepShapes:
    decode_rows: list[int] = field(default_factory=list)  # each step's (0: prompt tokens only)
    # per engine.step call: its group (None: it launched no pass) and its host wall, seconds
    groups: list[str | None] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    prompts_finished: int = 0  # prompts whose last token was computed (the output head runs for it)
    add_seconds: float = 0.0  # the host's adding of every request (the device idle meanwhile)


def part_of(name: str) -> str:
    lowered = name.lower()
    for part, fragments in PARTS.items():
        if any(f in lowered for f in fragments):
            return part
    return "the rest"


def run_workload(
    engine: LLMEngine, args: argparse.Namespace, label: str, seed: int, mark: bool = False
) -> StepShapes:
    """The workload as benchmarks.offline.nano drives it (final outputs only). ``mark``: a marker kernel as each
    step begins (see the module docstring)."""
    requests = nano_workload(args.num_requests, seed)
    shapes = StepShapes()
    start = time.perf_counter()
    for i, request in enumerate(requests):
        engine.add_request(f"{label}-{i}", request.prompt, greedy(request.output_len))
    shapes.add_seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        before = engine.counters.steps
        if mark:
            torch.cuda._sleep(1)
        start = time.perf_counter()
        engine.step(finals_only=True)
        wall = time.perf_counter() - start
        if engine.counters.steps == before or engine.last_batch is None:
            shapes.groups.append(None)  # (no pass launched: only the step in flight read)
            shapes.walls.append(wall)
            continue
        news = engine.last_batch.num_new_tokens
        prompt_tokens = sum(n for n in news if n > 1)
        shapes.prompt_tokens += prompt_tokens
        shapes.decode_rows.append(sum(1 for n in news if n == 1))
        shapes.groups.append(step_group(prompt_tokens, shapes.decode_rows[-1]))
        shapes.walls.append(wall)
    shapes.prompts_finished = len(requests)
    return shapes


def step_group(prompt_tokens: int, decode_rows: int) -> str:
    if prompt_tokens:
        return "with prompt tokens"
    for bound in DECODE_GROUPS:
        if decode_rows <= bound:
            return f"decode <= {bound} rows"
    return f"decode > {DECODE_GROUPS[-1]} rows"


def idle_by_group(
    kernels: list[tuple[str, float, float]], groups: list[str | None]
) -> dict[str, dict[str, Any]]:
    """Busy and idle seconds of the profiled pass by step group: ``kernels`` (name, start us, end us) in start
    order, markers included; the n-th marker opens the n-th step (``groups[n]``; None: a step that launched
    no pass, its kernels, if any, counted with the step before). Per group also the idle before a step's first
    kernel (the device waited for the step's launch) and the idle by the kernel that ended it."""
    table: dict[str, dict[str, Any]] = {}
    step, group, reach, first = -1, "before the first step", None, False
    for name, start, end in kernels:
        if MARKER in name:
            step += 1
            if step < len(groups) and groups[step] is not None:
                group, first = groups[step], True
            continue
        row = table.setdefault(
            group, {"busy_s": 0.0, "idle_s": 0.0, "idle_at_start_s": 0.0, "idle_before": {}}
        )
        if reach is not None and start > reach:
            gap = (start - reach) * 1e-6
            row["idle_s"] += gap
            row["idle_at_start_s"] += gap if first else 0.0
            row["idle_before"][name[:60]] = row["idle_before"].get(name[:60], 0.0) + gap
        first = False
        added = end - max(start, reach) if reach is not None else end - start
        row["busy_s"] += max(added, 0.0) * 1e-6
        reach = end if reach is None else max(reach, end)
    for row in table.values():
        row["idle_before"] = dict(sorted(row["idle_before"].items(), key=lambda item: -item[1]))
    return table


def attended_kv_tokens(args: argparse.Namespace) -> int:
    """Positions the workload's decode steps attend: a request of prompt p and n outputs decodes n - 1 times (its
    first token comes from the prefill), at contexts p + 1 .. p + n - 1."""
    total = 0
    for r in nano_workload(args.num_requests, args.seed):
        p, n = len(r.prompt), r.output_len
        total += (n - 1) * p + (n - 1) * n // 2
    return total


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / graph_ms(lambda: a @ b) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_options(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    record.require_cuda(__spec__.name)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    read_tbps = 2**31 / read_ms(2**31) / 1e9
    tflops = matmul_tflops()
    engine = build_engine(args, seed=args.seed)
    device = engine.config.torch_device
    run_workload(engine, args, "untimed", args.seed + 1)
    synchronize(device)
    # (each pass's prompts computed again, as in the nano run: the cache emptied outside the timing)
    engine.core.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    timed = run_workload(engine, args, "timed", args.seed)
    synchronize(device)
    timed_wall = time.perf_counter() - start
    engine.core.block_manager.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        shapes = run_workload(engine, args, "profiled", args.seed, mark=True)
        synchronize(device)
        wall = time.perf_counter() - start
    device_events = sorted(
        (
            e
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
        ),
        key=lambda e: e.time_range.start,
    )
    groups = idle_by_group(
        [(e.name, e.time_range.start, e.time_range.end) for e in device_events], shapes.groups
    )
    for group, wall_s in zip(timed.groups, timed.walls):
        if group is not None and group in groups:
            row = groups[group]
            row["steps"] = row.get("steps", 0) + 1
            row["timed_host_wall_s"] = row.get("timed_host_wall_s", 0.0) + wall_s
    kernels = [e for e in device_events if MARKER not in e.name]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    seconds = dict.fromkeys([*PARTS, "the rest"], 0.0)
    rest: dict[str, float] = {}  # "the rest" by kernel name: what a fusion could take
    for e, us in zip(kernels, added_us(intervals)):
        part = part_of(e.name)
        seconds[part] += us * 1e-6
        if part == "the rest":
            rest[e.name[:80]] = rest.get(e.name[:80], 0.0) + us * 1e-6
    rest = dict(sorted(rest.items(), key=lambda item: -item[1]))
    busy = busy_us(intervals) * 1e-6

    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.args.vocab_size * model.args.hidden_size
    params = sum(p.numel() for p in model.parameters())
    kv_token_bytes = (
        2
        * model.args.num_layers
        * model.args.num_kv_heads
        * model.args.head_dim
        * engine.config.torch_dtype.itemsize
    )
    step_floor = sum(
        max(weight_bytes / read_tbps / 1e12, 2 * params * rows / tflops / 1e12)
        for rows in shapes.decode_rows
        if rows
    )
    prefill_flops = 2 * (params - embedding) * shapes.prompt_tokens
    prefill_flops += 2 * embedding * shapes.prompts_finished
    floors = {
        "persistent decode": 0.0,
        "decode attention": attended_kv_tokens(args) * kv_token_bytes / read_tbps / 1e12,
        "prefill attention": 0.0,
        "matrix products": step_floor + prefill_flops / tflops / 1e12,
        "the rest": 0.0,
        "device idle": 0.0,
    }
    seconds["device idle"] = timed_wall - busy
    tokens = sum(r.output_len for r in nano_workload(args.num_requests, args.seed))
    env = record.environment(__spec__.name, device)
    print(f"\n## nano profile: {args.model_config}, dummy weights, {engine.config.torch_dtype}")
    print(record.environment_line(env))
    print(
        f"ceilings measured: read {read_tbps:.2f} TB/s, bf16 matmul {tflops:.0f} TFLOP/s; "
        f"{len(shapes.decode_rows)} steps, {shapes.prompt_tokens} prompt tokens; wall {timed_wall:.3f} s "
        f"({tokens / timed_wall:,.0f} tok/s; adding the requests {timed.add_seconds:.3f} s), under the profiler "
        f"{wall:.3f} s (idle {wall - busy:.3f} s); "
        f"floor {sum(floors.values()):.3f} s "
        f"({tokens / sum(floors.values()):,.0f} tok/s)\n"
    )
    print("| part | seconds | floor s | floor / seconds |\n|---|---:|---:|---:|")
    for part, value in seconds.items():
        share = f"{floors[part] / value:.0%}" if value and floors[part] else "-"
        print(f"| {part} | {value:.3f} | {floors[part]:.3f} | {share} |")
    print("\n| the rest, by kernel | seconds |\n|---|---:|")
    for name, value in list(rest.items())[:12]:
        print(f"| {name} | {value:.3f} |")
    print(
        "\n| steps (profiled pass) | steps | busy s | idle s (before a step's first kernel) | timed pass: host "
        "ms per step | most idle before |\n|---|---:|---:|---:|---:|---|"
    )
    for group, row in groups.items():
        steps = row.get("steps", 0)
        per_step = f"{1e3 * row['timed_host_wall_s'] / steps:.3f}" if steps else "-"
        before = ", ".join(f"{n[:30]} {v:.3f}" for n, v in list(row["idle_before"].items())[:3])
        print(
            f"| {group} | {steps} | {row['busy_s']:.3f} | {row['idle_s']:.3f} "
            f"({row['idle_at_start_s']:.3f}) | {per_step} | {before} |"
        )
    record.write_json(
        args.json,
        dict(
            environment=env,
            model=args.model_config,
            wall_seconds=timed_wall,
            profiled_wall_seconds=wall,
            busy_seconds=busy,
            seconds=seconds,
            floors=floors,
            read_tbps=read_tbps,
            matmul_tflops=tflops,
            decode_rows=shapes.decode_rows,
            prompt_tokens=shapes.prompt_tokens,
            output_tokens=tokens,
            by_step_group=groups,
            add_seconds=timed.add_seconds,
            rest_by_kernel=rest,
        ),
    )


if __name__ == "__main__":
    main()
