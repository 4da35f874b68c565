"""Decode-batch matmuls (M = 64-512 rows) against cuBLAS and the device's limits: where a nano step's GEMM time goes.

At batch 256 the engine's decode step spends ~1.24 ms of ~2.9 ms in cuBLAS (docs/BENCHMARKS.md, the step's kernel
table): llama-3.2-1b's gate/up projection alone 40 us a layer, 43% of bf16 peak. This times every projection of
llama-3.2-1b and qwen3-0.6b at the given M with cuBLAS (``F.linear``, its kernel name from the profiler) and with a
Triton tiled matmul (``tl.dot`` over host TMA descriptors, optionally persistent) at each config of a sweep, every
config checked against torch first (relative error < 1e-2). For gate/up also the fused SiLU-and-mul epilogue
against ``F.linear`` + kernels.activation.silu_and_mul (the engine's pair).

Timing: one CUDA graph of R calls, each on its own copy of the weight (copies together >= 3x the L2, so every call
reads its weight from memory, as a decode step does), timed by benchmarks.harness.graph_timing (Triton's
graph timing after the stream's pending work), per call. The 2026-11-30 results came from this script's first
form (20 replays of one graph, median): the same graph of calls. The limit
column is max(FLOPs / 790 TFLOP/s, bytes / 4.49 TB/s): the ceilings measured on the H200 (bf16 matrix products on
random data, the device's KINDS.md; a read-only stream, ``benchmarks.kernel.fused_moe``). At 256 rows every
projection of both models is FLOP-bound. Results: docs/BENCHMARKS.md ("The step's matmuls at 256 rows").

    python -m benchmarks.kernel.batch_gemm [--rows 128 256 512] [--models llama-3.2-1b qwen3-0.6b] [--json PATH]
                                           [--cublas-only] [--blas-library default|cublas|cublaslt]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.harness import record
from benchmarks.harness.graph_timing import graph_ms
from kernels.activation import silu_and_mul

MODELS = {
    "llama-3.2-1b": {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
    },
    "qwen3-0.6b": {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "gate_up": (6144, 1024),
        "down": (1024, 3072),
    },
}
PEAK_FLOPS, PEAK_BYTES = 790e12, 4.49e12
DTYPE = torch.bfloat16
# (block_m, block_n, block_k, num_warps, num_stages, group_m)
CONFIGS = [
    (bm, bn, 64, w, s, 8)
    for bm, bn, w, s in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4, 5))
    if not (bm == 64 and w == 8 and bn == 64)
] + [
    (bm, bn, 128, w, s, 8)
    for bm, bn, w, s in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))
]
SPLIT_CONFIGS = [
    (bm, bn, 64, w, s, 8)
    for bm, bn, w, s in itertools.product((128, 256), (128, 256), (4, 8), (3, 4))
    if bm * bn < 65536
] + [(64, 128, 64, 4, 4, 8), (128, 64, 64, 4, 4, 8), (64, 128, 128, 4, 4, 8)]


@triton.jit
def _tile_order(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gemm_tma(
    x_desc,
    w_desc,
    o_desc,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    SILU_MUL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[M, N] = x @ w.T (with SILU_MUL: N output columns, w's gate rows [0, N) and up rows [N, 2N)). With
    SPLIT_K > 1 the programs of a tile each take 1/SPLIT_K of K and write fp32 partials [SPLIT_K, M, width]; the
    last to finish (a counter per tile) adds them in split order and stores (deterministic)."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    start = tl.program_id(0)
    step = NUM_SMS if PERSISTENT else num_tiles * SPLIT_K
    k_len = K // SPLIT_K
    for work in tl.range(start, num_tiles * SPLIT_K, step, flatten=PERSISTENT):
        tile = work // SPLIT_K
        split = work % SPLIT_K
        pid_m, pid_n = _tile_order(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(split * k_len, (split + 1) * k_len, BLOCK_K):
            a = x_desc.load([off_m, k])
            acc = tl.dot(a, w_desc.load([off_n, k]).T, acc)
            if SILU_MUL:
                up = tl.dot(a, w_desc.load([N + off_n, k]).T, up)
        element = o_desc.dtype
        last = True
        if SPLIT_K > 1:
            width = 2 * N if SILU_MUL else N
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            offs = rows[:, None] * width + cols[None, :]
            tl.store(part_ptr + split * M * width + offs, acc)
            if SILU_MUL:
                tl.store(part_ptr + split * M * width + offs + N, up)
            tl.debug_barrier()
            last = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
            if last:
                tl.store(counter_ptr + tile, 0)
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(SPLIT_K):
                    acc += tl.load(part_ptr + s * M * width + offs, cache_modifier=".cg")
                    if SILU_MUL:
                        up += tl.load(part_ptr + s * M * width + offs + N, cache_modifier=".cg")
        if last:
            if SILU_MUL:
                g = acc.to(element).to(tl.float32)
                silu = (g / (1.0 + tl.exp(-g))).to(element).to(tl.float32)
                o_desc.store([off_m, off_n], (silu * up.to(element).to(tl.float32)).to(element))
            else:
                o_desc.store([off_m, off_n], acc.to(element))


def triton_gemm(
    x, weight, out, config, silu_mul: bool, persistent: bool, sms: int, split_k=1, scratch=None
):
    bm, bn, bk, warps, stages, group = config
    m, k = x.shape
    n = out.shape[1]
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    o_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(sms, tiles * split_k) if persistent else tiles * split_k,)
    part, counters = scratch if scratch is not None else (out, out)
    _gemm_tma[grid](
        x_desc,
        w_desc,
        o_desc,
        part,
        counters,
        m,
        n,
        k,
        SILU_MUL=silu_mul,
        PERSISTENT=persistent,
        SPLIT_K=split_k,
        NUM_SMS=sms,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def graph_us(calls) -> float:
    """Median microseconds per call of ``calls`` (closures) replayed once each from a CUDA graph."""
    return graph_ms(lambda: [call() for call in calls]) * 1000 / len(calls)


def cublas_kernel(x, weight) -> str:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.linear(x, weight)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return names[0] if names else "?"


def measure(
    m: int, n: int, k: int, fused: bool, sms: int, l2_bytes: int, label: str, triton_sweep: bool
) -> dict:
    out_n = n // 2 if fused else n
    w_bytes = n * k * 2
    copies = max(3, min(32, -(-3 * l2_bytes // w_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        torch.randn(n, k, device="cuda", dtype=DTYPE, generator=gen) * 0.02 for _ in range(copies)
    ]
    x = torch.randn(m, k, device="cuda", dtype=DTYPE, generator=gen)
    ref = F.linear(x.float(), weights[0].float())
    if fused:
        ref = F.silu(ref[:, :out_n]) * ref[:, out_n:]

    def torch_pair(w):
        y = F.linear(x, w)
        return silu_and_mul(y) if fused else y

    flops = 2 * m * n * k
    bytes_moved = w_bytes + m * k * 2 + m * out_n * 2
    limit_us = max(flops / PEAK_FLOPS, bytes_moved / PEAK_BYTES) * 1e6
    row = {
        "shape": label,
        "m": m,
        "n": n,
        "k": k,
        "fused_silu": fused,
        "limit_us": limit_us,
        "cublas_kernel": cublas_kernel(x, weights[0]),
        "cublas_us": graph_us([lambda w=w: torch_pair(w) for w in weights]),
    }
    outs = [torch.empty(m, out_n, device="cuda", dtype=DTYPE) for _ in weights]
    sweep = []
    scratch = (
        torch.empty(8 * m * (2 * out_n if fused else out_n), device="cuda", dtype=torch.float32),
        torch.zeros(4096, device="cuda", dtype=torch.int32),
    )
    plans = [(config, persistent, 1) for persistent in (False, True) for config in CONFIGS]
    plans += [(config, False, split) for split in (2, 4, 8) for config in SPLIT_CONFIGS]
    for config, persistent, split in plans if triton_sweep else []:
        if out_n % config[1] or m % config[0] or k % (split * config[2]):
            continue
        try:
            got = triton_gemm(
                x, weights[0], outs[0], config, fused, persistent, sms, split, scratch
            ).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                print(
                    f"  {label} {config} persistent={persistent}: error {err:.3g}",
                    file=sys.stderr,
                )
                continue
            us = graph_us(
                [
                    lambda w=w, o=o: triton_gemm(
                        x, w, o, config, fused, persistent, sms, split, scratch
                    )
                    for w, o in zip(weights, outs)
                ]
            )
        except (triton.runtime.errors.OutOfResources, RuntimeError) as error:
            print(f"  {label} {config}: {type(error).__name__}", file=sys.stderr)
            continue
        sweep.append({"config": config, "persistent": persistent, "split_k": split, "us": us})
    best = min(  # (no Triton sweep: nothing to report)
        sweep,
        key=lambda r: r["us"],
        default=dict(config=None, persistent=None, split_k=None, us=None),
    )
    row.update(
        best_us=best["us"],
        best_config=best["config"],
        best_persistent=best["persistent"],
        best_split=best["split_k"],
    )
    row["sweep"] = sweep
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--layers", nargs="+", default=None, help="only these projections (qkv o gate_up down)"
    )
    parser.add_argument(
        "--cublas-only", action="store_true", help="time torch's product only (no Triton sweep)"
    )
    parser.add_argument(
        "--blas-library",
        choices=["default", "cublas", "cublaslt"],
        default="default",
        help="torch.backends.cuda.preferred_blas_library for the products",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    record.require_cuda(__spec__.name)
    if args.blas_library != "default":
        torch.backends.cuda.preferred_blas_library(args.blas_library)
    load_before = record.load_average()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    rows = []
    print(
        "| model | layer | M | limit us | cuBLAS us | cuBLAS % | Triton best us | % | config (bm, bn, bk, w, s, g), persistent, split | cuBLAS kernel |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, m in itertools.product(args.models, args.rows):
        for layer, (n, k) in MODELS[model].items():
            if args.layers and layer not in args.layers:
                continue
            variants = [(False, layer)] + ([(True, "gate_up+silu")] if layer == "gate_up" else [])
            for fused, label in variants:
                row = measure(m, n, k, fused, sms, l2, f"{model} {label}", not args.cublas_only)
                row["model"] = model
                rows.append(row)
                ours = (
                    f"{row['best_us']:.1f} | {100 * row['limit_us'] / row['best_us']:.0f} | "
                    f"{row['best_config']}, {row['best_persistent']}, split {row['best_split']}"
                    if row["best_us"] is not None
                    else "- | - | -"
                )
                print(
                    f"| {model} | {label} | {m} | {row['limit_us']:.1f} | {row['cublas_us']:.1f} | "
                    f"{100 * row['limit_us'] / row['cublas_us']:.0f} | {ours} | "
                    f"{row['cublas_kernel'][:60]} |",
                    flush=True,
                )
    env = record.environment(__spec__.name, "cuda", load_before, argv)
    print(record.environment_line(env))
    record.write_json(args.json, {"environment": env, "rows": rows})


if __name__ == "__main__":
    main()
