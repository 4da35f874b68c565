"""Decode matmuls (M <= 32 rows) against the weight-read limit: kernels/skinny_gemm.py against cuBLAS.

Every projection of llama-3.2-1b and llama-3-8b (qkv, o, gate_up, down, lm_head) at M in {1, 2, 4, 8, 16, 32},
bf16, random weights and inputs (never zeros). For each: cuBLAS (``F.linear``) and our kernel at the best of an
explicit sweep of launch configs (tiles x warps x stages, split-K 1..8) and at the config the kernel picks by
itself (``choose_config``: the table, else the heuristic), every config checked against torch in float32 first
(relative error < 1e-2, bf16 output). For gate_up also the fused gate/up + SiLU-and-mul against ``F.linear`` +
``kernels.activation.silu_and_mul`` (the engine's pair). GB/s = (weight + x + out bytes) / time, and its fraction
of a device-to-device copy measured in the same run (bytes read + written).

Timing: CUDA events around a batch of calls, each call on its own copy of the weight (the copies together >= 3x
the L2, so every call reads its weight from memory, as a decode step does), queued behind a GPU sleep long
enough for the host to enqueue the whole batch (host launch time stays out, as in the engine's CUDA graphs);
median over 50 batches after a warm-up. ``--graphs``: each batch is captured in a CUDA graph and replayed.

    python -m benchmarks.kernel.skinny_gemm [--graphs] [--models llama-3.2-1b llama-3-8b] [--rows 1 2 4 8 16 32]
                                     [--json PATH]

Prints a markdown table (one row per model, layer and M; "chosen us": the kernel's own config), the matmul time
of one decode step per model and M (every layer), and ``TABLE`` entries for kernels/skinny_gemm.py where the sweep
beat the kernel's own choice by over 2%; ``--json`` writes every row with its best and chosen config and sweep.
Runs in about 2 minutes on an H100 (compiles included).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from benchmarks.harness import record
from kernels.activation import silu_and_mul
from kernels.skinny_gemm import (
    GEMM,
    SILU_AND_MUL,
    SkinnyConfig,
    choose_config,
    row_bucket,
    skinny_gemm,
    skinny_gemm_silu_and_mul,
)

# model -> (decoder layers, {layer: (N = weight rows, K)})
MODELS = {
    "llama-3.2-1b": (
        16,
        {
            "qkv": (3072, 2048),
            "o": (2048, 2048),
            "gate_up": (16384, 2048),
            "down": (2048, 8192),
            "lm_head": (128256, 2048),
        },
    ),
    "llama-3-8b": (
        32,
        {
            "qkv": (6144, 4096),
            "o": (4096, 4096),
            "gate_up": (28672, 4096),
            "down": (4096, 14336),
            "lm_head": (128256, 4096),
        },
    ),
}
ROWS = [1, 2, 4, 8, 16, 32]
REPEATS, TOLERANCE, DTYPE = 50, 1e-2, torch.bfloat16
TILES = [  # (block_n, block_k, num_warps, num_stages)
    (16, 256, 4, 4),
    (32, 128, 4, 4),
    (32, 256, 4, 3),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (128, 128, 8, 3),
]
SPLITS = [1, 2, 4, 8]
FUSED_FROM_BEST = 4  # the fused kernel is swept over the best plain configs of its layer and M


def sweep(m: int, n: int, k: int, op: str, sms: int) -> list[SkinnyConfig]:
    """The configs worth timing, the kernel's own choice first: split-K only where the column blocks leave SMs
    idle, with at least two tiles of K per split."""
    configs = [choose_config(m, n, k, op, torch.device("cuda"))]
    n_out = n // 2 if op == SILU_AND_MUL else n
    for (block_n, block_k, warps, stages), split in itertools.product(TILES, SPLITS):
        blocks, chunks = math.ceil(n_out / block_n), math.ceil(k / block_k)
        if split == 1 or (blocks * split <= 4 * sms and chunks >= 2 * split):
            configs.append(
                SkinnyConfig(
                    block_n=block_n,
                    block_k=block_k,
                    split_k=split,
                    num_warps=warps,
                    num_stages=stages,
                )
            )
    return list(dict.fromkeys(configs))


class Timer:
    """Median microseconds per call of a batch of calls; host launch time hidden behind a GPU sleep."""

    def __init__(self, graphs: bool) -> None:
        self.graphs = graphs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):  # the first sleep also loads the kernel
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
        self.cycles_per_ms = 10_000_000 / start.elapsed_time(end)

    def __call__(self, calls: list[Callable[[], object]]) -> float:
        run = self._capture(calls) if self.graphs else (lambda: [call() for call in calls])
        run()
        torch.cuda.synchronize()
        host = time.perf_counter()
        run()
        host_ms = (time.perf_counter() - host) * 1e3
        sleep_cycles = int(self.cycles_per_ms * (2 * host_ms + 0.05))
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(REPEATS)
        ]
        for start, end in events:
            torch.cuda._sleep(sleep_cycles)
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return (
            statistics.median(start.elapsed_time(end) for start, end in events) * 1e3 / len(calls)
        )

    @staticmethod
    def _capture(calls: list[Callable[[], object]]) -> Callable[[], None]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (lazy buffers, first launches)
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        return graph.replay


def weight_copies(n: int, k: int) -> torch.Tensor:
    """``[copies, n, k]`` random bf16 weights, the copies together at least 3x the L2 (so no call hits it)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    copies = min(64, math.ceil(3 * l2 / (n * k * 2)))
    return torch.randn(copies, n, k, device="cuda", dtype=DTYPE).mul_(k**-0.5)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).norm() / expected.norm())


def copy_gbps(timer: Timer, nbytes: int = 2**30) -> float:
    """Device-to-device copy of ``nbytes`` (read + written bytes counted), GB/s."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer([lambda: dst.copy_(src)]) / 1e3


def time_config(
    timer: Timer,
    kernel: Callable,
    x: torch.Tensor,
    weights: torch.Tensor,
    expected: torch.Tensor,
    config: SkinnyConfig,
) -> float:
    """Microseconds per call of ``config``; infinity where it does not compile or (reported) disagrees."""
    try:
        error = relative_error(kernel(x, weights[0], config=config), expected)
        if not error < TOLERANCE:
            print(f"WRONG {config}: relative error {error:.2e}", file=sys.stderr)
            return math.inf
        out = torch.empty(x.shape[0], expected.shape[1], dtype=DTYPE, device="cuda")
        return timer([lambda w=w: kernel(x, w, out, config) for w in weights])
    except Exception as err:  # noqa: BLE001 - a sweep point that cannot run (e.g. out of resources) is no candidate
        print(
            f"skip {config}: {type(err).__name__}: {' | '.join(str(err).splitlines()[-4:])[-400:]}",
            file=sys.stderr,
        )
        return math.inf


def measure(
    timer: Timer, x: torch.Tensor, weights: torch.Tensor, op: str, configs: list[SkinnyConfig]
) -> dict:
    """cuBLAS (with the engine's activation kernel for the fused op) and every config of ``configs`` (the first:
    the kernel's own choice)."""
    reference = x.float() @ weights[0].float().T
    if op == SILU_AND_MUL:
        gate, up = reference.chunk(2, dim=-1)
        expected, kernel = F.silu(gate) * up, skinny_gemm_silu_and_mul
        cublas_calls = [lambda w=w: silu_and_mul(F.linear(x, w)) for w in weights]
        cublas_out = silu_and_mul(F.linear(x, weights[0]))
    else:
        expected, kernel = reference, skinny_gemm
        cublas_calls = [lambda w=w: F.linear(x, w) for w in weights]
        cublas_out = F.linear(x, weights[0])
    timed = [
        (time_config(timer, kernel, x, weights, expected, config), config) for config in configs
    ]
    best_us, best = min(timed, key=lambda t: t[0])  # infinity (shown as 0 GB/s) if no config ran
    return dict(
        cublas_us=timer(cublas_calls),
        cublas_error=relative_error(cublas_out, expected),
        ours_us=best_us,
        config=asdict(best),
        chosen_us=timed[0][0],
        chosen_config=asdict(timed[0][1]),
        sweep=[(asdict(c), us) for us, c in timed if math.isfinite(us)],
    )


def layer_rows(
    timer: Timer, model: str, layer: str, n: int, k: int, rows: list[int], copy: float
) -> list[dict]:
    weights = weight_copies(n, k)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        plain = None
        for op in [GEMM, SILU_AND_MUL] if layer == "gate_up" else [GEMM]:
            configs = sweep(m, n, k, op, sms)
            # the best plain configs, and each with twice the split (half the columns)
            if op == SILU_AND_MUL:
                best = [
                    SkinnyConfig(**c)
                    for c, _ in sorted(plain["sweep"], key=lambda t: t[1])[:FUSED_FROM_BEST]
                ]
                configs = list(
                    dict.fromkeys(
                        configs[:1] + best + [replace(c, split_k=2 * c.split_k) for c in best]
                    )
                )
            row = dict(
                model=model,
                layer=layer,
                op=op,
                m=m,
                n=n,
                k=k,
                copies=weights.shape[0],
                **measure(timer, x, weights, op, configs),
            )
            nbytes = n * k * 2 + m * k * 2 + m * (n // 2 if op == SILU_AND_MUL else n) * 2
            row.update(
                mbytes=nbytes / 1e6,
                cublas_gbps=nbytes / row["cublas_us"] / 1e3,
                ours_gbps=nbytes / row["ours_us"] / 1e3,
            )
            row.update(cublas_frac=row["cublas_gbps"] / copy, ours_frac=row["ours_gbps"] / copy)
            plain = plain or row
            out.append(row)
            print(table_line(row), flush=True)
    del weights
    torch.cuda.empty_cache()
    return out


def short(config: dict) -> str:
    return (
        f"{config['block_n']}x{config['block_k']} split {config['split_k']} w{config['num_warps']} "
        f"s{config['num_stages']}"
    )


HEADER = (
    "| model | layer | M | N x K | MB | cuBLAS us | cuBLAS GB/s | ours us | ours GB/s | cuBLAS % copy | "
    "ours % copy | ours/cuBLAS | best config | chosen us |\n" + "|---" * 14 + "|"
)


def table_line(r: dict) -> str:
    layer = r["layer"] + (" + silu*mul" if r["op"] == SILU_AND_MUL else "")
    return (
        f"| {r['model']} | {layer} | {r['m']} | {r['n']}x{r['k']} | {r['mbytes']:.1f} | {r['cublas_us']:.1f} | "
        f"{r['cublas_gbps']:.0f} | {r['ours_us']:.1f} | {r['ours_gbps']:.0f} | {100 * r['cublas_frac']:.0f}% | "
        f"{100 * r['ours_frac']:.0f}% | {r['cublas_us'] / r['ours_us']:.2f}x | {short(r['config'])} | "
        f"{r['chosen_us']:.1f} |"
    )


def step_summary(rows: list[dict], copy: float) -> list[str]:
    """Matmul time of one decode step (every decoder layer + the output layer; gate/up with its activation):
    cuBLAS, our kernel at its own choice of config and at the sweep's best, and the better of cuBLAS and our
    choice per layer; the bandwidth is the step's bytes over our chosen time."""
    lines = [
        "| model | M | GB | cuBLAS ms | ours (chosen) ms | ours (best) ms | min(cuBLAS, chosen) ms | "
        "chosen % copy | cuBLAS/chosen |",
        "|---" * 9 + "|",
    ]
    for model, (layers, shapes) in MODELS.items():
        for m in sorted({r["m"] for r in rows if r["model"] == model}):
            picked = [
                r
                for r in rows
                if r["model"] == model
                and r["m"] == m
                and (r["op"] == SILU_AND_MUL or r["layer"] != "gate_up")
            ]
            if {r["layer"] for r in picked} != set(shapes):
                continue

            def total(value: Callable[[dict], float]) -> float:
                return sum((1 if r["layer"] == "lm_head" else layers) * value(r) for r in picked)

            cublas, chosen = (
                total(lambda r: r["cublas_us"]) / 1e3,
                total(lambda r: r["chosen_us"]) / 1e3,
            )
            best = total(lambda r: r["ours_us"]) / 1e3
            either = total(lambda r: min(r["cublas_us"], r["chosen_us"])) / 1e3
            gbytes = total(lambda r: r["mbytes"]) / 1e3
            lines.append(
                f"| {model} | {m} | {gbytes:.2f} | {cublas:.3f} | {chosen:.3f} | {best:.3f} | {either:.3f} | "
                f"{100 * gbytes / chosen / copy * 1e3:.0f}% | {cublas / chosen:.2f}x |"
            )
    return lines


def table_entries(rows: list[dict]) -> list[str]:
    """TABLE lines for kernels/skinny_gemm.py where the sweep's best beats the kernel's own choice by over 2%."""
    lines = []
    for r in rows:
        if r["ours_us"] < r["chosen_us"] / 1.02:
            fields = ", ".join(
                f"{name}={value}"
                for name, value in r["config"].items()
                if value != getattr(SkinnyConfig(), name)
            )
            lines.append(
                f"    ({r['op']!r}, {row_bucket(r['m'])}, {r['n']}, {r['k']}): SkinnyConfig({fields}),  "
                f"# {r['chosen_us'] / r['ours_us']:.2f}x over the choice"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--graphs", action="store_true", help="time each batch of calls as a CUDA graph replay"
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--layers", nargs="+", default=None, help="only these layers (qkv o gate_up down lm_head)"
    )
    parser.add_argument(
        "--rows", type=int, nargs="+", default=ROWS, help="values of M (at most 32)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    record.require_cuda(__spec__.name)
    load_before = record.load_average()
    started, timer = time.perf_counter(), Timer(args.graphs)
    copy = copy_gbps(Timer(graphs=False))  # in a graph the copy becomes a copy-engine node: slower
    print(
        f"\n{torch.cuda.get_device_name()}, timing: {'CUDA graphs' if args.graphs else 'eager'}, "
        f"copy: {copy:.0f} GB/s\n\n{HEADER}",
        flush=True,
    )
    rows = []
    for model in args.models:
        for layer, (n, k) in MODELS[model][1].items():
            if args.layers is None or layer in args.layers:
                rows += layer_rows(timer, model, layer, n, k, args.rows, copy)
    print("\n" + "\n".join(step_summary(rows, copy)))
    print(
        "\nTABLE = {  # kernels/skinny_gemm.py: where the sweep beat the kernel's own choice by > 2%\n"
        + "\n".join(table_entries(rows))
        + "\n}"
    )
    env = record.environment(__spec__.name, "cuda", load_before, graphs=args.graphs)
    print(f"\n{time.perf_counter() - started:.0f} s; {record.environment_line(env)}")
    record.write_json(
        args.json, dict(environment=env, graphs=args.graphs, copy_gbps=copy, rows=rows)
    )


if __name__ == "__main__":
    main()
