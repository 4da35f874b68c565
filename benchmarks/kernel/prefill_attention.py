"""Prefill attention throughput: our paged prefill kernel against SDPA's flash backend.

Causal prompts of 2K, 4K and 8K tokens (batch 1, plus 4 x 2K), 32 query / 8 KV heads, head 128, bf16, KV in
randomly permuted blocks of 16. Two cases: no prefix (the whole prompt is the chunk), and a 50% cached prefix
(the second half of the prompt is the chunk; its queries see the whole first half). TFLOP/s counts the
causal work only: 4 * head_dim * heads * (visible query-key pairs). Ours runs as the engine calls it: the
chunk's K/V are also passed as strided views of the fused projection output (read through TMA on Hopper);
"cache only" is the same kernel without them (every key gathered through the block table, the path of
other GPUs and of an FP8 cache). Peer in the same run: SDPA with the
flash backend on contiguous K/V (repeated to all query heads outside the timing); for the prefix case with
a bottom-right causal mask (``causal_lower_right``) where the backend accepts it.

"host us/launch" is the host's time to make one launch (with and without the chunk rows): a kernel shorter
than that is timed at the host's pace. ``--chunk-tma-min-tokens 0`` takes the chunk rows at every size (the
default, PrefillConfig.chunk_tma_min_tokens, skips them under 2048 query tokens). ``--cuda-graph`` times each
call replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``, ours and SDPA alike): the kernels' own
time, without the host's launch cost and without the L2 flush between calls (a 2K prompt's K/V, 8 MB, then stays
in L2; these shapes are compute-bound).

    python -m benchmarks.kernel.prefill_attention [--sweep] [--json PATH] [--chunk-tma-min-tokens N] [--cuda-graph]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from benchmarks.harness import record
from benchmarks.harness.graph_timing import graph_ms
from kernels.prefill_attention import CONFIG, PrefillConfig, prefill_attention

CASES = [(1, 2048), (1, 4096), (1, 8192), (4, 2048)]  # (sequences, prompt tokens each)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
SWEEP = [
    PrefillConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
    for m, n, w, s in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3])
]


def bench(fn) -> float:
    if CUDA_GRAPH:
        return graph_ms(fn)
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


CUDA_GRAPH = False  # main's --cuda-graph


def causal_flops(batch: int, prompt: int, cached: int) -> float:
    chunk = prompt - cached
    pairs = chunk * cached + chunk * (chunk + 1) / 2
    return 4 * HEAD_DIM * HEADS * pairs * batch


def make_inputs(batch: int, prompt: int, cached: int) -> dict:
    blocks = prompt // BLOCK_SIZE
    k_cache = torch.randn(
        batch * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE
    )
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    chunk = prompt - cached
    # the projection's output rows [q | k | v]; the chunk's K/V are also in the cache, as store_kv leaves them
    fused = torch.randn(
        batch * chunk, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DTYPE
    )
    query, chunk_k, chunk_v = fused.split(
        [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1
    )
    chunk_k, chunk_v = chunk_k.view(-1, KV_HEADS, HEAD_DIM), chunk_v.view(-1, KV_HEADS, HEAD_DIM)
    positions = torch.arange(cached, prompt, device="cuda")
    for b in range(batch):
        blocks_b = tables[b, positions // BLOCK_SIZE].long()
        k_cache[blocks_b, positions % BLOCK_SIZE] = chunk_k[b * chunk : (b + 1) * chunk]
        v_cache[blocks_b, positions % BLOCK_SIZE] = chunk_v[b * chunk : (b + 1) * chunk]
    return dict(
        query=query.view(-1, HEADS, HEAD_DIM),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        cu=torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * chunk,
        context_lens=torch.full((batch,), prompt, device="cuda", dtype=torch.int32),
        chunk_k=chunk_k,
        chunk_v=chunk_v,
    )


def ours_call(x: dict, config: PrefillConfig | None = None, chunk_rows: bool = True):
    """One launch of our kernel on ``x``, as the engine makes it (``chunk_rows``: with the chunk's K/V rows)."""
    out = torch.empty_like(x["query"])
    chunk = (x["chunk_k"], x["chunk_v"]) if chunk_rows else (None, None)
    return lambda: prefill_attention(
        out,
        x["query"],
        x["k_cache"],
        x["v_cache"],
        x["block_tables"],
        x["cu"],
        x["context_lens"],
        HEAD_DIM**-0.5,
        1.0,
        1.0,
        *chunk,
        config=config,
    )


def run_ours(x: dict, config: PrefillConfig | None = None, chunk_rows: bool = True) -> float:
    return bench(ours_call(x, config, chunk_rows))


def host_us(fn, launches: int = 200) -> float:
    """Host microseconds per launch: ``launches`` calls queued without a sync (far fewer than CUDA's launch
    queue holds), so the GPU never holds the host back. Where this reaches the kernel's time, the timing
    above measures the host."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / launches * 1e6


def try_config(x: dict, config: PrefillConfig) -> float:
    """Milliseconds for ``config``, or infinity where it does not compile (e.g. too much shared memory)."""
    try:
        return run_ours(x, config)
    except Exception as err:  # noqa: BLE001 - a sweep point that cannot run is simply not a candidate
        print(f"skip {config}: {type(err).__name__}")
        return float("inf")


def run_sdpa(x: dict, batch: int, prompt: int, cached: int) -> float | None:
    tables = x["block_tables"].long()
    group = HEADS // KV_HEADS
    k = x["k_cache"][tables].view(batch, prompt, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = x["v_cache"][tables].view(batch, prompt, KV_HEADS, HEAD_DIM).transpose(1, 2)
    k, v = k.repeat_interleave(group, 1).contiguous(), v.repeat_interleave(group, 1).contiguous()
    q = x["query"].view(batch, prompt - cached, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            if cached == 0:
                return bench(
                    lambda: F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=HEAD_DIM**-0.5
                    )
                )
            mask = causal_lower_right(prompt - cached, prompt)
            return bench(
                lambda: F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=HEAD_DIM**-0.5
                )
            )
    except RuntimeError as err:  # e.g. no flash kernel for a lower-right mask in this torch
        print(
            f"SDPA flash unavailable for {batch}x{prompt} cached={cached}: {str(err).splitlines()[0]}"
        )
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--chunk-tma-min-tokens", type=int, default=CONFIG.chunk_tma_min_tokens)
    parser.add_argument(
        "--cuda-graph", action="store_true", help="time calls replayed from a graph"
    )
    args = parser.parse_args()
    record.require_cuda(__spec__.name)
    global CUDA_GRAPH
    CUDA_GRAPH = args.cuda_graph
    config = replace(CONFIG, chunk_tma_min_tokens=args.chunk_tma_min_tokens)
    rows = []
    for (batch, prompt), fraction in itertools.product(CASES, [0.0, 0.5]):
        cached = int(prompt * fraction)
        x = make_inputs(batch, prompt, cached)
        flops = causal_flops(batch, prompt, cached)
        # alternated, median of three each: the two paths see the same clocks
        timed = [(run_ours(x, config), run_ours(x, config, chunk_rows=False)) for _ in range(3)]
        ours_ms = statistics.median(t[0] for t in timed)
        cache_only_ms = statistics.median(t[1] for t in timed)
        sdpa_ms = run_sdpa(x, batch, prompt, cached)
        row = dict(
            batch=batch,
            prompt=prompt,
            cached=cached,
            ours_ms=ours_ms,
            ours_tflops=flops / ours_ms / 1e9,
            cache_only_tflops=flops / cache_only_ms / 1e9,
            host_us=host_us(ours_call(x, config)),
            cache_only_host_us=host_us(ours_call(x, config, chunk_rows=False)),
            sdpa_tflops=flops / sdpa_ms / 1e9 if sdpa_ms else None,
        )
        if args.sweep:
            timed = [(try_config(x, c), c) for c in SWEEP]
            best_ms, best = min(timed, key=lambda t: t[0])
            row.update(
                best_tflops=flops / best_ms / 1e9,
                best_config=asdict(best),
                sweep=[(asdict(c), flops / ms / 1e9) for ms, c in timed],
            )
        rows.append(row)
    timing = "CUDA graph replay" if CUDA_GRAPH else "events per call, L2 flushed"
    env = record.environment(__spec__.name, "cuda", config=asdict(config), timing=timing)
    print_table(rows, args.sweep, env)
    record.write_json(
        args.json, dict(environment=env, config=asdict(config), cuda_graph=CUDA_GRAPH, rows=rows)
    )


def print_table(rows: list[dict], sweep: bool, env: dict) -> None:
    print(f"\n{record.environment_line(env)}\nconfig: {env['config']}  timing: {env['timing']}\n")
    print(
        "| seqs x prompt | cached | ours ms | host us/launch (cache only) | ours TFLOP/s | cache only TFLOP/s"
        " | SDPA flash TFLOP/s | ours/SDPA |" + (" best TFLOP/s | best config |" if sweep else "")
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if sweep else ""))
    for r in rows:
        sdpa = r["sdpa_tflops"]
        line = (
            f"| {r['batch']}x{r['prompt']} | {r['cached']} | {r['ours_ms']:.3f} | "
            f"{r['host_us']:.0f} ({r['cache_only_host_us']:.0f}) | {r['ours_tflops']:.0f} | "
            f"{r['cache_only_tflops']:.0f} | {sdpa:.0f} | {r['ours_tflops'] / sdpa:.2f} |"
            if sdpa
            else f"| {r['batch']}x{r['prompt']} | {r['cached']} | {r['ours_ms']:.3f} | "
            f"{r['host_us']:.0f} ({r['cache_only_host_us']:.0f}) | {r['ours_tflops']:.0f} | "
            f"{r['cache_only_tflops']:.0f} | - | - |"
        )
        if sweep:
            c = r["best_config"]
            line += f" {r['best_tflops']:.0f} | m{c['block_m']} n{c['block_n']} w{c['num_warps']} s{c['num_stages']} |"
        print(line)


if __name__ == "__main__":
    main()
