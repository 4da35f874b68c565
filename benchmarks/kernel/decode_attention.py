"""Workload ``decode-kernel`` (shared WORKLOADS.md): paged decode attention against the memory roofline.

Batch x context in {32x8K, 64x8K, 128x1K, 32x2K}; 32 query / 8 KV heads, head 128, bf16; the cache's blocks
randomly permuted in the pool; block size in {16, 32, 64, 128}. Effective bandwidth = bytes of K and V read
/ kernel time (``triton.testing.do_bench``: median, L2 flushed before every call). Peers in the same run:
``F.scaled_dot_product_attention`` (GQA) on the same K/V laid out contiguously, and a device-to-device copy
of the same bytes (counted as read + written) for the ceiling. Split-K merges inside the same launch; the
last column times the one-pass kernel (split-K off) for comparison. Kernels under ~60 us include host launch
time in this measurement (the L2 flush before each call is the only head start the host gets).

    python -m benchmarks.kernel.decode_attention [--block-sizes 16 32 64 128] [--shapes 32x8192 ...] [--sweep] [--json PATH]
                                       [--kv-cache-dtype fp8]

``--kv-cache-dtype fp8``: the cache in float8 e4m3 (half the bytes; query and output stay bf16); the SDPA peer
then reads a bfloat16 copy (its TB/s counts its own bytes), and ours/SDPA is the ratio of times.

``--cuda-graph`` times ours in CUDA graph replays, each replay one call per copy of the cache (copies of >= 150 MB
together, so every call reads HBM): the kernel without the host's launch. ``--head-dim 64 --table-tokens 131072
--shapes 16x704`` is llama-3.2-1b's decode at 16 streams as the engine's graphs launch it (a table as wide as
max_model_len).

``--sweep`` also times a grid of launch configurations (tiles, stages, when to split) per shape and reports
the best next to the default.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
import triton

from benchmarks.harness import record
from benchmarks.harness.graph_timing import graph_ms
from kernels import reference
import kernels.paged_attention as paged_attention_module
from kernels.paged_attention import CONFIG, DecodeConfig, paged_attention

SHAPES = [(32, 8192), (64, 8192), (128, 1024), (32, 2048)]
HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
TABLE_TOKENS = 0  # main's --table-tokens
CUDA_GRAPH = False  # main's --cuda-graph
L2_ROTATION_BYTES = (
    150 * 2**20
)  # graph timing rotates over cache copies of at least this many bytes
# the grid behind the defaults (docs/KERNELS_NOTES.md): tiles x stages x when to split
SWEEP = [
    DecodeConfig(tile_n=t, small_head_tile_n=t, split_tile_n=st, num_stages=s, programs_per_sm=k)
    for t, st, s, k in itertools.product([64, 128, 256], [64, 128], [2, 3, 4], [2, 4, 8])
]
SWEEP += [
    DecodeConfig(min_partition=m, programs_per_sm=k)
    for m, k in itertools.product([1024, 2048], [2, 3])
]


def bench(fn) -> float:
    """Median milliseconds of ``fn`` with the L2 flushed before every call."""
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def paged_inputs(batch: int, context: int, block_size: int, kv_dtype: torch.dtype = DTYPE) -> dict:
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(
        num_blocks, block_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE
    ).to(kv_dtype)
    v_cache = torch.randn(k_cache.shape, device="cuda", dtype=DTYPE).to(kv_dtype)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(
        batch, blocks_per_seq
    )
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    copies = -(-L2_ROTATION_BYTES // kv_bytes) - 1 if CUDA_GRAPH else 0
    cache_copies = [(k_cache.clone(), v_cache.clone()) for _ in range(copies)]
    # the kernel's view: a CUDA graph's table is as wide as max_model_len, padded with block 0
    width = max(blocks_per_seq, TABLE_TOKENS // block_size)
    padded = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    padded[:, :blocks_per_seq] = tables
    return dict(
        query=torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        kernel_tables=padded,
        cache_copies=cache_copies,
        context_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
    )


def run_ours(
    inputs: dict, config: DecodeConfig | None = None, split: bool | None = None
) -> tuple[float, torch.Tensor]:
    out = torch.empty_like(inputs["query"])
    scale = HEAD_DIM**-0.5

    def call(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        paged_attention(
            out,
            inputs["query"],
            k_cache,
            v_cache,
            inputs["kernel_tables"],
            inputs["context_lens"],
            scale,
            config=config,
            split=split,
        )

    if not CUDA_GRAPH:
        return bench(lambda: call(inputs["k_cache"], inputs["v_cache"])), out
    # replayed from a graph, one call per copy of the cache: together >= 3x L2, so each reads HBM
    copies = [(inputs["k_cache"], inputs["v_cache"])] + inputs["cache_copies"]
    ms = graph_ms(lambda: [call(k, v) for k, v in copies])
    call(inputs["k_cache"], inputs["v_cache"])
    return ms / len(copies), out


def try_config(inputs: dict, config: DecodeConfig) -> float:
    """Milliseconds for ``config``, or infinity where it does not compile (e.g. too much shared memory)."""
    try:
        return run_ours(inputs, config)[0]
    except Exception as err:  # noqa: BLE001 - a sweep point that cannot run is simply not a candidate
        print(f"skip {config}: {type(err).__name__}")
        return float("inf")


def run_sdpa(inputs: dict) -> tuple[float, torch.Tensor]:
    """The same K/V gathered once into contiguous [B, kv_heads, L, d] tensors (outside the timing)."""
    tables = inputs["block_tables"].long()
    batch = tables.shape[0]
    k = (
        inputs["k_cache"][tables]
        .view(batch, -1, KV_HEADS, HEAD_DIM)
        .transpose(1, 2)
        .to(DTYPE)
        .contiguous()
    )
    v = (
        inputs["v_cache"][tables]
        .view(batch, -1, KV_HEADS, HEAD_DIM)
        .transpose(1, 2)
        .to(DTYPE)
        .contiguous()
    )
    q = inputs["query"].unsqueeze(2)
    ms = bench(
        lambda: F.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5, enable_gqa=True)
    )
    return ms, F.scaled_dot_product_attention(
        q, k, v, scale=HEAD_DIM**-0.5, enable_gqa=True
    ).squeeze(2)


def copy_ceiling_tbps(nbytes: int) -> float:
    """Device-to-device copy of ``nbytes`` (read + written bytes counted), TB/s."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src)) / 1e9


def reference_error(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> float:
    """||out - ref|| / ||ref|| against ``reference.paged_attention`` in float32 on the same inputs."""
    ref = torch.empty_like(out, dtype=torch.float32)
    reference.paged_attention(
        ref, query.float(), k_cache.float(), v_cache.float(), tables, context_lens, scale
    )
    return float((out.float() - ref).norm() / ref.norm())


def check(out: torch.Tensor, inputs: dict) -> float:
    return reference_error(
        out,
        inputs["query"],
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["block_tables"],
        inputs["context_lens"],
        HEAD_DIM**-0.5,
    )


def measure(
    batch: int, context: int, block_size: int, sweep: list[DecodeConfig], kv_dtype: torch.dtype
) -> dict:
    inputs = paged_inputs(batch, context, block_size, kv_dtype)
    kv_bytes = 2 * inputs["k_cache"].numel() * inputs["k_cache"].element_size()
    ours_ms, out = run_ours(inputs)
    row = dict(
        batch=batch,
        context=context,
        block_size=block_size,
        kv_gb=kv_bytes / 1e9,
        ours_ms=ours_ms,
        ours_tbps=kv_bytes / ours_ms / 1e9,
        rel_err=check(out, inputs) if batch * context <= 2**18 else None,
    )
    row["one_pass_tbps"] = kv_bytes / run_ours(inputs, split=False)[0] / 1e9
    if sweep:
        timed = [(try_config(inputs, cfg), cfg) for cfg in sweep]
        best_ms, best = min(timed, key=lambda t: t[0])
        row.update(
            best_ms=best_ms,
            best_tbps=kv_bytes / best_ms / 1e9,
            best_config=asdict(best),
            sweep=[(asdict(c), ms) for ms, c in timed],
        )
    return row


def main() -> None:
    global HEAD_DIM, TABLE_TOKENS, CUDA_GRAPH
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--sweep-from", type=int, default=0, help="time only SWEEP[i:] (a shorter sweep)"
    )
    parser.add_argument(
        "--shapes", nargs="+", default=[f"{b}x{c}" for b, c in SHAPES], help="BATCHxCONTEXT ..."
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="auto: bf16"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="ours timed in graph replays (no host launch time)",
    )
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM, help="64: llama-3.2-1b's")
    parser.add_argument(
        "--table-tokens",
        type=int,
        default=0,
        help="block tables as wide as this many tokens (a CUDA graph's: max_model_len)",
    )
    parser.add_argument(
        "--num-warps", type=int, default=None, help="DecodeConfig.num_warps for every launch"
    )
    parser.add_argument(
        "--tile-n",
        type=int,
        default=None,
        help="the one-pass key tile for every head size (DecodeConfig.tile_n and small_head_tile_n)",
    )
    args = parser.parse_args()
    record.require_cuda(__spec__.name)
    HEAD_DIM, TABLE_TOKENS, CUDA_GRAPH = args.head_dim, args.table_tokens, args.cuda_graph
    sweep = SWEEP
    if args.num_warps:  # the default every launch without a config takes, and the sweep's
        paged_attention_module.CONFIG = replace(CONFIG, num_warps=args.num_warps)
        sweep = [replace(c, num_warps=args.num_warps) for c in SWEEP]
    if args.tile_n:
        paged_attention_module.CONFIG = replace(
            paged_attention_module.CONFIG, tile_n=args.tile_n, small_head_tile_n=args.tile_n
        )
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else DTYPE
    rows = []
    for batch, context in [tuple(map(int, shape.split("x"))) for shape in args.shapes]:
        inputs = paged_inputs(batch, context, 16, kv_dtype)
        kv_bytes = 2 * inputs["k_cache"].numel() * inputs["k_cache"].element_size()
        sdpa_ms, _ = run_sdpa(inputs)
        sdpa_bytes = 2 * inputs["k_cache"].numel() * DTYPE.itemsize  # (SDPA reads bf16)
        del inputs
        copy_tbps = copy_ceiling_tbps(kv_bytes)
        for block_size in args.block_sizes:
            row = measure(
                batch, context, block_size, sweep[args.sweep_from :] if args.sweep else [], kv_dtype
            )
            row.update(
                sdpa_ms=sdpa_ms,
                sdpa_tbps=sdpa_bytes / sdpa_ms / 1e9,
                copy_tbps=copy_tbps,
                kv_dtype=str(kv_dtype).removeprefix("torch."),
            )
            rows.append(row)
            torch.cuda.empty_cache()
    env = record.environment(__spec__.name, "cuda", config=asdict(paged_attention_module.CONFIG))
    print_table(rows, args.sweep, env)
    record.write_json(
        args.json,
        dict(environment=env, default_config=asdict(paged_attention_module.CONFIG), rows=rows),
    )


def print_table(rows: list[dict], sweep: bool, env: dict) -> None:
    print(f"\n{record.environment_line(env)}\nconfig: {env['config']}\n")
    head = (
        "| batch x ctx | block | KV GB | ours ms | ours TB/s | SDPA TB/s | ours/SDPA | copy TB/s | rel err |"
        " one-pass TB/s |"
    )
    print(head + (" best TB/s | best config |" if sweep else ""))
    print("|" + "---|" * (head.count("|") - 1 + (2 if sweep else 0)))
    for r in rows:
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
        line = (
            f"| {r['batch']}x{r['context']} | {r['block_size']} | {r['kv_gb']:.2f} | {r['ours_ms']:.3f} | "
            f"{r['ours_tbps']:.2f} | {r['sdpa_tbps']:.2f} | {r['sdpa_ms'] / r['ours_ms']:.2f} | "
            f"{r['copy_tbps']:.2f} | {err} | {r['one_pass_tbps']:.2f} |"
        )
        if sweep:
            c = r["best_config"]
            line += (
                f" {r['best_tbps']:.2f} | t{c['tile_n']} st{c['split_tile_n']} k{c['programs_per_sm']} "
                f"m{c['min_partition']} s{c['num_stages']} |"
            )
        print(line)


if __name__ == "__main__":
    main()
