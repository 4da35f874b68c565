"""Decode attention at the nano workload's own contexts (shared WORKLOADS.md, ``nano``): one decode step's batch
of mixed context lengths, as the engine's CUDA graphs launch it, judged against the same bytes read as one stream.

At decode step ``S`` (every prompt prefilled, ``S`` tokens generated) the running requests are those whose output
is longer than ``S``, each at context ``prompt + S``, in the workload's order (the engine's row order). Per
``--steps`` point and model shape, timed in CUDA graph replays (each call reads more than the L2 holds):

- ``drawn``: the rows in the workload's order; ``longest-first``: the same rows sorted by context, longest first
  (programs are dispatched in row order, so the longest finish before the tail); ``uniform``: the same number of
  rows all at the mean context (the same bytes, no spread of lengths);
- ``read``: a Triton kernel summing a contiguous buffer of the same bytes (the read ceiling at this kernel's size:
  its own launch ramp and tail included).

    python -m benchmarks.kernel.decode_attention_mixed [--models llama-3.2-1b qwen3-0.6b] [--steps 0 300 600]
                                                       [--table-tokens 131072] [--sweep launch|split]
                                                       [--layouts token-major head-major] [--json PATH]

``--sweep launch`` also times one-pass launch configurations (key tile, stages, warps) on the drawn rows,
``--sweep split`` when split-K starts and how many programs it aims for (the few-row steps of the run's tail).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict

import torch

from benchmarks.harness import record
from benchmarks.harness.graph_timing import graph_ms
from benchmarks.harness.read_ceiling import ReadStream
from benchmarks.harness.workloads import nano_workload
from benchmarks.kernel.decode_attention import reference_error
from kernels.paged_attention import CONFIG, DecodeConfig, paged_attention

# (query heads, KV heads, head dim) of the nano workload's two architectures
MODELS = {"llama-3.2-1b": (32, 8, 64), "qwen3-0.6b": (16, 8, 128)}
BLOCK_SIZE = 16
# --sweep launch: one-pass launch configurations (key tile, pipeline stages, warps) timed on the drawn rows
LAUNCH_SWEEP = [
    DecodeConfig(tile_n=t, small_head_tile_n=t, num_stages=s, num_warps=w)
    for t, s, w in [
        (32, 3, 4),
        (32, 4, 4),
        (64, 2, 4),
        (64, 3, 4),
        (64, 4, 4),
        (128, 2, 4),
        (128, 3, 4),
        (128, 4, 4),
        (128, 3, 8),
        (256, 2, 4),
        (256, 3, 4),
        (256, 2, 8),
        (256, 3, 8),
    ]
]
# --sweep split: when split-K starts (programs under this many per SM) and how many programs it aims for
SPLIT_SWEEP = [
    DecodeConfig(split_below_programs_per_sm=below, programs_per_sm=aim, min_partition=least)
    for below, aim, least in [
        (1.0, 2, 512),
        (2.0, 2, 512),
        (2.0, 4, 512),
        (4.0, 4, 512),
        (4.0, 8, 512),
        (4.0, 8, 256),
        (8.0, 8, 256),
        (8.0, 16, 256),
    ]
]
SWEEPS = {"launch": LAUNCH_SWEEP, "split": SPLIT_SWEEP}
DTYPE = torch.bfloat16


def nano_contexts(step: int, num_requests: int = 256, seed: int = 0) -> list[int]:
    """Context lengths of the running rows at decode step ``step``, in the workload's order."""
    return [len(r.prompt) + step for r in nano_workload(num_requests, seed) if r.output_len > step]


def step_inputs(
    contexts: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    table_tokens: int,
    layout: str = "token-major",
) -> dict:
    """Query, a cache holding exactly the rows' blocks (randomly permuted in the pool) and block tables as wide
    as ``table_tokens`` (a CUDA graph's: max_model_len), padded with block 0. ``layout``: the cache's memory
    order, ``token-major`` ([block, token, kv head, dim], the engine's) or ``head-major`` ([block, kv head,
    token, dim], handed to the kernel as the same logical shape through its strides)."""
    blocks = [-(-c // BLOCK_SIZE) for c in contexts]
    total = sum(blocks)
    if layout == "head-major":
        stored = torch.randn(total, kv_heads, BLOCK_SIZE, head_dim, device="cuda", dtype=DTYPE)
        k_cache = stored.transpose(1, 2)
        v_cache = torch.randn_like(stored).transpose(1, 2)
    else:
        k_cache = torch.randn(total, BLOCK_SIZE, kv_heads, head_dim, device="cuda", dtype=DTYPE)
        v_cache = torch.randn_like(k_cache)
    pool = torch.randperm(total, device="cuda", dtype=torch.int32)
    width = max(max(blocks), table_tokens // BLOCK_SIZE)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32, device="cuda")
    first = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = pool[first : first + n]
        first += n
    return dict(
        query=torch.randn(len(contexts), heads, head_dim, device="cuda", dtype=DTYPE),
        k_cache=k_cache,
        v_cache=v_cache,
        tables=tables,
        context_lens=torch.tensor(contexts, dtype=torch.int32, device="cuda"),
        kv_bytes=2 * sum(contexts) * kv_heads * head_dim * DTYPE.itemsize,
    )


def time_decode(inputs: dict, config: DecodeConfig | None = None) -> tuple[float, float]:
    """(graph-replayed milliseconds, relative error against the reference) of one decode call."""
    out = torch.full_like(inputs["query"], float("nan"))
    scale = inputs["query"].shape[-1] ** -0.5

    def call() -> None:
        paged_attention(
            out,
            inputs["query"],
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["tables"],
            inputs["context_lens"],
            scale,
            config=config,
        )

    ms = graph_ms(call)
    call()
    return ms, reference_error(
        out,
        inputs["query"],
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["tables"],
        inputs["context_lens"],
        scale,
    )


def read_ms(nbytes: int) -> float:
    """Graph-replayed milliseconds of reading ``nbytes`` of bf16 once (64 KiB a program)."""
    return graph_ms(ReadStream(torch.randn(nbytes // 2, device="cuda", dtype=DTYPE), 32768))


def measure(
    model: str, step: int, table_tokens: int, sweep: list[DecodeConfig], layout: str
) -> dict:
    heads, kv_heads, head_dim = MODELS[model]
    drawn = nano_contexts(step)
    mean = round(statistics.mean(drawn))
    row = dict(
        model=model,
        layout=layout,
        step=step,
        rows=len(drawn),
        mean_context=mean,
        max_context=max(drawn),
        min_context=min(drawn),
    )
    orders = {
        "drawn": drawn,
        "longest-first": sorted(drawn, reverse=True),
        "uniform": [mean] * len(drawn),
    }
    for name, contexts in orders.items():
        inputs = step_inputs(contexts, heads, kv_heads, head_dim, table_tokens, layout)
        ms, err = time_decode(inputs)
        row[name] = dict(ms=ms, tbps=inputs["kv_bytes"] / ms / 1e9, rel_err=err)
        if name == "drawn":
            row["kv_mb"] = inputs["kv_bytes"] / 1e6
            read = read_ms(inputs["kv_bytes"])
            row["read"] = dict(ms=read, tbps=inputs["kv_bytes"] / read / 1e9)
            if sweep:
                timed = [
                    (c, *time_decode(inputs, c)) for c in sweep
                ]  # (each checked, as the default)
                row["sweep"] = [dict(config=asdict(c), ms=ms, rel_err=e) for c, ms, e in timed]
                best = min(row["sweep"], key=lambda t: t["ms"])
                row["best"] = dict(best, tbps=inputs["kv_bytes"] / best["ms"] / 1e9)
        del inputs
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--steps", type=int, nargs="+", default=[0, 300, 600])
    parser.add_argument("--table-tokens", type=int, default=131072)
    parser.add_argument(
        "--sweep",
        choices=sorted(SWEEPS),
        default=None,
        help="also time these configs on the drawn rows",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=["token-major", "head-major"],
        default=["token-major"],
        help="the cache's memory order (head-major: each block's tokens of one KV head contiguous)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    record.require_cuda(__spec__.name)
    rows = [
        measure(m, s, args.table_tokens, SWEEPS.get(args.sweep, []), layout)
        for m in args.models
        for s in args.steps
        for layout in args.layouts
    ]
    env = record.environment(__spec__.name, "cuda", config=asdict(CONFIG))
    print(f"\n{record.environment_line(env)}\n")
    print(
        "| model | layout | step | rows | ctx mean (min-max) | KV MB | read TB/s | drawn TB/s | longest-first TB/s"
        " | uniform TB/s | drawn / read | rel err |"
    )
    print("|---" * 12 + "|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layout']} | {r['step']} | {r['rows']} | {r['mean_context']} ({r['min_context']}-"
            f"{r['max_context']}) | {r['kv_mb']:.0f} | {r['read']['tbps']:.2f} | {r['drawn']['tbps']:.2f} | "
            f"{r['longest-first']['tbps']:.2f} | {r['uniform']['tbps']:.2f} | "
            f"{r['read']['ms'] / r['drawn']['ms']:.0%} | {r['drawn']['rel_err']:.1e} |"
        )
    for r in rows:
        for timed in r.get("sweep", []):
            c, tbps = timed["config"], r["kv_mb"] / 1e3 / timed["ms"]
            print(
                f"sweep, {r['model']} {r['layout']} step {r['step']}: {tbps:.2f} TB/s (rel err {timed['rel_err']:.1e}): "
                f"tile {c['tile_n']}/"
                f"{c['small_head_tile_n']}, {c['num_stages']} stages, {c['num_warps']} warps, split below "
                f"{c['split_below_programs_per_sm']} programs/SM aiming at {c['programs_per_sm']}, partitions >= "
                f"{c['min_partition']}"
            )
    record.write_json(args.json, dict(environment=env, rows=rows))


if __name__ == "__main__":
    main()
