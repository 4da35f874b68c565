"""Weight-only quantized CPU matmuls (``--cpu-weights``): each storage mode on the default model's projection
shapes, with the activation in float32, bfloat16 and float16, at 1 and 8 rows. bfloat16 weights both ways the
layer computes them: torch's product (oneDNN's where the CPU has bfloat16 kernels) and float32 from slices of
the weight (``float32_product``: the layer's choice where oneDNN has none, as on AVX2).

Why torch's quantized layers cast their input to bfloat16: its weight-only int4/int8 CPU kernels are vectorized
for bfloat16 inputs only (float32 and float16 inputs take a scalar path many times slower). Also our native
tile kernel (kernels/cpu_gguf_matmul.cpp, ``file`` and ``q4`` modes) on random blocks of every GGUF format at the
configured level (``PAGEDCHAT_CPU_ISA``), and the packed int8 output layer. Effective bandwidth = weight bytes /
time; 30 copies of each weight (a decode step's layers, beyond L2) are cycled through.

    python -m benchmarks.cpu.quant_linear [--threads 2] [--rows 1 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.harness import record
from engine.config import EngineConfig
from engine.layers.gguf_linear import GGUFLinear
from engine.layers.quantized_linear import (
    GROUP,
    PACKED_OUTPUTS,
    Int8Linear,
    PackedInt8Head,
    Q4Linear,
    float32_product,
    q4_1_from_float,
)
from engine.weights.gguf_blocks import GGUFBlocks
from kernels import cpu_native
from kernels.quant_blocks import FORMATS
from tests.gguf_writer import BLOCK_BYTES, random_file_bytes

# SmolLM2-135M: [out, in] of the fused QKV, gate/up, down projections and the tied output layer
SHAPES = [(960, 576), (3072, 576), (576, 1536), (49152, 576)]
COPIES = 30


def timed(fn: Callable[[int], torch.Tensor], copies: int, repeats: int = 5) -> float:
    for i in range(min(copies, 3)):
        fn(i)
    start = time.perf_counter()
    for _ in range(repeats):
        for i in range(copies):
            fn(i)
    return (time.perf_counter() - start) / repeats / copies


def measure(out_features: int, in_features: int, rows: int) -> list[tuple[str, str, float, float]]:
    copies = 1 if out_features > 10_000 else COPIES
    weights = [torch.randn(out_features, in_features) * 0.02 for _ in range(copies)]
    q4 = [Q4Linear(q4_1_from_float(w), None) for w in weights]
    i8 = [Int8Linear(w, None) for w in weights]
    columns = [w.t().contiguous().t() for w in weights]
    bf16 = [w.to(torch.bfloat16) for w in weights]
    x = torch.randn(rows, in_features)
    results = [
        ("float32", "float32", 4.0, timed(lambda i: F.linear(x, columns[i]), copies)),
        (
            "bfloat16, torch",
            "bfloat16",
            2.0,
            timed(lambda i: F.linear(x.bfloat16(), bf16[i]), copies),
        ),
        (
            "bfloat16, float32 slices",
            "bfloat16",
            2.0,
            timed(lambda i: float32_product(x.bfloat16(), bf16[i]), copies),
        ),
    ]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        sz = [m.scales_and_zeros.to(dtype) for m in q4]
        sc = [m.scales.to(dtype) for m in i8]
        name = str(dtype).removeprefix("torch.")
        results.append(
            (
                "q4",
                name,
                0.5 + 4 / GROUP,
                timed(
                    lambda i: torch.ops.aten._weight_int4pack_mm_for_cpu(
                        xd, q4[i].packed, GROUP, sz[i]
                    ),
                    copies,
                ),
            )
        )
        results.append(
            (
                "int8",
                name,
                1.0,
                timed(lambda i: torch._weight_int8pack_mm(xd, i8[i].weight, sc[i]), copies),
            )
        )
    return results + measure_native(weights, x, copies)


def measure_native(
    weights: list[torch.Tensor], x: torch.Tensor, copies: int
) -> list[tuple[str, str, float, float]]:
    """Our kernels at the configured level (``PAGEDCHAT_CPU_ISA``), where they build: the tile matmul on random
    blocks of each GGUF format (activations quantized to 8 bits per 32 inputs inside it), and the packed int8
    output layer."""
    config = EngineConfig()
    native = cpu_native.load(Path(config.cache_dir) / "native", config.cpu_isa)
    if native is None:
        return []
    out_features, in_features = weights[0].shape
    results = []
    for fmt, (_, block, _) in FORMATS.items():
        if in_features % block:
            continue
        layers = [
            GGUFLinear(
                [
                    GGUFBlocks(
                        fmt,
                        torch.from_numpy(random_file_bytes(fmt, out_features, in_features, seed)),
                        (out_features, in_features),
                    )
                ],
                None,
                native,
            )
            for seed in range(copies)
        ]
        results.append(
            (
                f"{fmt}, native tiles ({native.level})",
                "float32 (8-bit per 32)",
                BLOCK_BYTES[fmt] / block,
                timed(lambda i, layers=layers: layers[i].matmul(x), copies),
            )
        )
    if out_features % PACKED_OUTPUTS == 0:
        packed = [PackedInt8Head(w, native) for w in weights]
        results.append(
            ("int8, native packed", "float32", 1.0, timed(lambda i: packed[i](x), copies))
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = record.load_average()
    print("| weight [out, in] | rows | weights | activation | µs per matmul | GB/s |")
    print("|---|---:|---|---|---:|---:|")
    for out_features, in_features in SHAPES:
        for rows in args.rows:
            for weights, activation, bytes_per_weight, seconds in measure(
                out_features, in_features, rows
            ):
                gbs = out_features * in_features * bytes_per_weight / seconds / 1e9
                print(
                    f"| {out_features}x{in_features} | {rows} | {weights} | {activation} | {seconds * 1e6:.0f} "
                    f"| {gbs:.1f} |"
                )
    env = record.environment(__spec__.name, "cpu", load_before=load, threads=args.threads)
    print(f"\n{args.threads} threads; {record.environment_line(env)}")


if __name__ == "__main__":
    main()
