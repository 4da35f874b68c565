"""The decoder layers of one decode step: the persistent kernel (kernels/persistent_decode.py, one launch)
against the engine's layer path (a launch per norm, projection, rotary + KV store and attention), on an H100.

llama-3.2-1b's shapes (16 layers, hidden 2048, 32 heads over 8 KV heads of 64, MLP 8192), bf16 random weights
(never zeros), a paged cache of 16-token blocks holding ``--context`` tokens per sequence, a block table as wide
as ``--table-tokens`` (the engine's CUDA graphs use one sized for the longest context). Both paths end with the
model's final norm and are replayed from a CUDA graph; CUDA events, median of ``--repeats`` replays. Before
timing, the two outputs (the normed stream) are compared: relative error, and whether the persistent kernel
repeats itself bit for bit.

    python -m benchmarks.kernel.persistent_decode [--rows 1 16] [--context 700] [--table-tokens 4096]
                                           [--prefetch-k 256] [--attention-parts 0]
                                           [--attention-min-tiles 2] [--sweep o_splits=2,4 ...]
                                           [--shared-kv] [--trace]
                                           [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
from dataclasses import replace

import torch

from benchmarks.harness import record
from benchmarks.kernel.persistent_chain import graph_ms
from kernels import ops, reference
from kernels.decoder_stack import DecoderStack, LayerTensors
from kernels.persistent_decode import STAMPS_PER_LAYER, PersistentConfig, persistent_decode

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 16, 2048, 32, 8, 64, 8192
BLOCK_SIZE, EPS = 16, 1e-5


def make_stack(device: torch.device, num_blocks: int) -> tuple[DecoderStack, torch.Tensor]:
    """Random layers (weights scaled by 1/sqrt(K), norms near 1) and the final norm's weight."""
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device=device)).to(torch.bfloat16)

    def cache() -> torch.Tensor:
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    layers = [
        LayerTensors(
            weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            weight(HIDDEN, HEADS * HEAD_DIM),
            weight(2 * INTERMEDIATE, HIDDEN),
            weight(HIDDEN, INTERMEDIATE),
            norm(),
            norm(),
            cache(),
            cache(),
        )
        for _ in range(LAYERS)
    ]
    return DecoderStack(layers, HEADS, KV_HEADS, HEAD_DIM, EPS), norm()


def make_batch(
    rows: int, context: int, table_tokens: int, device: torch.device, shared: bool = False
) -> dict:
    """Each sequence's own blocks (shuffled), its new token at position ``context - 1``. ``shared``: every
    sequence reads (and writes its new token into) the first one's blocks, so after the first reads the
    attention's K and V come from L2 (what attention costs when HBM is not the limit)."""
    width = table_tokens // BLOCK_SIZE
    per_seq = -(-context // BLOCK_SIZE)
    order = torch.randperm(rows * per_seq, generator=torch.Generator().manual_seed(1))
    tables = torch.zeros(rows, width, dtype=torch.int32)
    slots = torch.empty(rows, dtype=torch.int64)
    for i in range(rows):
        first = 0 if shared else i * per_seq
        blocks = order[first : first + per_seq]
        tables[i, :per_seq] = blocks.to(torch.int32)
        slots[i] = blocks[(context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    return dict(
        positions=torch.full((rows,), context - 1, dtype=torch.int64, device=device),
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        context_lens=torch.full((rows,), context, dtype=torch.int32, device=device),
    )


def rotary(device: torch.device, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (500000 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    emb = torch.outer(torch.arange(max_position, device=device).float(), inv_freq).repeat(1, 2)
    return emb.cos(), emb.sin()


def layer_path(h, stack, final_norm, meta, cos, sin):
    """The engine's launches (engine/models/llama.py): norm, then per layer qkv, rotary + KV store, attention,
    o, add + norm, gate/up + SiLU, down, add + norm (the last with the final norm's weight)."""
    rows, scale = h.shape[0], HEAD_DIM**-0.5
    residual = h.clone()
    x = ops.rms_norm(residual, stack.layers[0].norm_in, EPS)
    for i, layer in enumerate(stack.layers):
        q, k, v = ops.skinny_gemm(x, layer.qkv).split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1
        )
        q, k = q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM)
        v = v.view(rows, KV_HEADS, HEAD_DIM)
        ops.rotary_store_kv(meta["positions"], q, k, v, cos, sin, layer.k_cache, layer.v_cache,
                            meta["slot_mapping"], 1.0, 1.0)  # fmt: skip
        attn = torch.empty_like(q)
        ops.paged_attention(attn, q, layer.k_cache, layer.v_cache, meta["block_tables"],
                            meta["context_lens"], scale, 1.0, 1.0)  # fmt: skip
        x, residual = ops.rms_norm(ops.skinny_gemm(attn.view(rows, -1), layer.o), layer.norm_post,
                                   EPS, residual)  # fmt: skip
        act = ops.skinny_gemm_silu_and_mul(x, layer.gate_up)
        following = stack.layers[i + 1].norm_in if i + 1 < len(stack.layers) else final_norm
        x, residual = ops.rms_norm(ops.skinny_gemm(act, layer.down), following, EPS, residual)
    return x


def persistent_path(h, stack, final_norm, meta, cos, sin, config):
    stream = h.clone()
    persistent_decode(stream, stack, meta["positions"], meta["slot_mapping"], meta["block_tables"],
                      meta["context_lens"], cos, sin, HEAD_DIM**-0.5, config)  # fmt: skip
    return ops.rms_norm(stream, final_norm, EPS)


def trace_path(h, stack, meta, cos, sin, config):
    """One traced launch (after a warm one), its profile printed and returned."""
    programs = config.programs or torch.cuda.get_device_properties(h.device).multi_processor_count
    trace = torch.zeros(programs, 2 + STAMPS_PER_LAYER * LAYERS, dtype=torch.int64, device=h.device)
    for _ in range(2):
        stream = h.clone()
        persistent_decode(stream, stack, meta["positions"], meta["slot_mapping"], meta["block_tables"],
                          meta["context_lens"], cos, sin, HEAD_DIM**-0.5, config, trace)  # fmt: skip
    torch.cuda.synchronize()
    return print_profile(h.shape[0], trace.cpu())


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def compiled_resources() -> str:
    """Registers, spills and shared memory of the persistent kernel's compiled variants."""
    from kernels import persistent_decode as module

    found = []
    for caches in module._persistent_decode_kernel.device_caches.values():
        for kernel in caches[0].values():
            found.append(f"{kernel.n_regs} registers, {kernel.n_spills} spills, "
                         f"{kernel.metadata.shared} B shared")  # fmt: skip
    return "; ".join(found)


# the trace's segments a layer: (name, start stamp, end stamp, weight bytes); stamp -1 is the previous layer's
# last (kernels/persistent_decode.py ``_stamp``)
SEGMENTS = (
    ("qkv (partials)", -1, 0, (HEADS + 2 * KV_HEADS) * HEAD_DIM * HIDDEN * 2),
    ("prefetches (o's weights; K and V, by programs with no qkv task)", 0, 1, 0),
    ("attention (waits per KV head; + rotary, KV store)", 1, 2, 0),
    ("o + residual (waits per KV head)", 2, 3, HIDDEN * HEADS * HEAD_DIM * 2),
    ("wait for o's writers", 3, 4, 0),
    ("gate/up + SiLU", 4, 5, 2 * INTERMEDIATE * HIDDEN * 2),
    ("prefetch (down's weights)", 5, 6, 0),
    ("down + residual (waits per quarter of gate/up)", 6, 7, HIDDEN * INTERMEDIATE * 2),
    ("wait for down's writers", 7, 8, 0),
)


def phase_profile(trace: torch.Tensor) -> list[dict]:
    """Where one launch's time went, from its trace (``[programs, 2 + 9 x layers]``, the GPU's ns timer). A
    segment's share is how far it moved the latest program on (the latest end minus the latest start): the
    shares add up to the launch after its first barrier. Per segment, the median over the layers of that
    share, and the mean time a program spent in it."""
    ns = trace.double()
    rows = []
    for name, first, last, nbytes in SEGMENTS:
        shares, spent = [], []
        for layer in range((ns.shape[1] - 2) // STAMPS_PER_LAYER):
            base = 2 + STAMPS_PER_LAYER * layer
            # stamp -1 of the first layer: the end of the launch's first barrier
            start = ns[:, base + first] if first >= 0 or layer else ns[:, 1]
            end = ns[:, base + last]
            shares.append((end.max() - start.max()).item() / 1e3)
            spent.append((end - start).mean().item() / 1e3)
        share = statistics.median(shares)
        rows.append(dict(segment=name, share_us=share, spent_us=statistics.median(spent),
                         tb_s=nbytes / share / 1e6 if nbytes and share > 0 else None,
                         total_us=sum(shares)))  # fmt: skip
    return rows


def print_profile(rows: int, trace: torch.Tensor) -> list[dict]:
    steps = torch.unique(trace.flatten()).diff()
    profile = phase_profile(trace)
    launch_us = (trace[:, -1].max() - trace[:, 0].min()).item() / 1e3
    print(f"\n# trace, M={rows}: launch {launch_us:.1f} us (first stamp to last), timer step >= "
          f"{steps[steps > 0].min().item()} ns")  # fmt: skip
    print("| segment | us a layer (median, critical path) | us a program spends | weights TB/s | "
          "us a launch |\n|---|---:|---:|---:|---:|")  # fmt: skip
    for row in profile:
        rate = f"{row['tb_s']:.2f}" if row["tb_s"] else ""
        print(f"| {row['segment']} | {row['share_us']:.2f} | {row['spent_us']:.2f} | {rate} | "
              f"{row['total_us']:.1f} |")  # fmt: skip
    return profile


def parse_sweep(
    items: list[str],
    own: tuple[str, ...] = ("prefetch_k", "attention_parts", "attention_min_tiles"),
) -> dict[str, list[int]]:
    """``FIELD=V1,V2`` items: PersistentConfig fields and the integer values to try (``own``: fields the
    caller has options of its own for, refused here)."""
    fields = {f.name for f in dataclasses.fields(PersistentConfig)}
    sweep = {}
    for item in items:
        name, _, values = item.partition("=")
        if name in own:
            raise SystemExit(f"--sweep: {name} has an option of its own")
        if name not in fields or not values:
            raise SystemExit(
                f"--sweep: {item!r} is not FIELD=V1,V2 with FIELD one of {sorted(fields)}"
            )
        try:
            sweep[name] = [int(v) for v in values.split(",")]
        except ValueError:
            raise SystemExit(f"--sweep: {item!r}: the values must be integers") from None
    return sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--table-tokens", type=int, default=4096)
    parser.add_argument("--shared-kv", action="store_true",
                        help="every sequence reads the first one's blocks (K and V from L2; the new tokens "
                             "share one slot, so the error column means nothing)")  # fmt: skip
    parser.add_argument("--prefetch-k", type=int, nargs="+", default=[256])
    parser.add_argument("--attention-parts", type=int, nargs="+", default=[0],
                        help="partitions of each context (0: the kernel's choice)")  # fmt: skip
    parser.add_argument("--attention-min-tiles", type=int, nargs="+", default=[2])
    parser.add_argument("--sweep", nargs="+", default=[], metavar="FIELD=V1,V2",
                        help="other PersistentConfig fields to sweep (integers), e.g. o_splits=4,8")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--trace", action="store_true",
                        help="also profile each variant's phases from one traced launch")  # fmt: skip
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    sweep = parse_sweep(args.sweep)
    if not torch.cuda.is_available():
        print("persistent_decode: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    max_rows = max(args.rows)
    stack, final_norm = make_stack(device, max_rows * -(-args.context // BLOCK_SIZE) + 1)
    cos, sin = rotary(device, args.table_tokens)
    print(f"# {torch.cuda.get_device_name(device)}, llama-3.2-1b shapes, {LAYERS} layers, context "
          f"{args.context}, table {args.table_tokens} tokens"
          f"{', one sequence of KV shared by all' if args.shared_kv else ''}")  # fmt: skip
    print(
        "| M | path | ms | vs layer path | rel. error | repeats bit for bit |\n|---|---|---:|---:|---:|---|"
    )
    results = []
    for rows in args.rows:
        meta = make_batch(rows, args.context, args.table_tokens, device, args.shared_kv)
        h = torch.randn(rows, HIDDEN, device=device).to(torch.bfloat16)
        base_ms, want = graph_ms(
            lambda: layer_path(h, stack, final_norm, meta, cos, sin), args.repeats
        )
        want = want.clone()
        # the yardstick for the error: the layer path against the torch reference
        ref_stack, _ = make_stack(device, max_rows * -(-args.context // BLOCK_SIZE) + 1)
        stream = h.clone()
        reference.persistent_decode(stream, ref_stack, *meta.values(), cos, sin, HEAD_DIM**-0.5)
        ref_error = relative_error(want, reference.rms_norm(stream, final_norm, EPS))
        del ref_stack
        print(f"| {rows} | layer path (engine launches) | {base_ms:.4f} | 1.00x | "
              f"{ref_error:.1e} (against torch) | |")  # fmt: skip
        results.append(dict(rows=rows, path="layers", ms=base_ms))
        variants = itertools.product(
            args.prefetch_k, args.attention_parts, args.attention_min_tiles,
            *(itertools.product([name], values) for name, values in sweep.items()),
        )  # fmt: skip
        for pf, parts, min_tiles, *fields in variants:
            config = replace(PersistentConfig(), prefetch_k=pf, attention_parts=parts,
                             attention_min_tiles=min_tiles, **dict(fields))  # fmt: skip
            label = (f"prefetch_k {pf}, attention parts {parts or 'auto'} "
                     f"(at least {min_tiles} tiles)")  # fmt: skip
            label += "".join(f", {name} {value}" for name, value in fields)
            first = persistent_path(h, stack, final_norm, meta, cos, sin, config).clone()
            again = persistent_path(h, stack, final_norm, meta, cos, sin, config)
            error = relative_error(first, want)
            ms, _ = graph_ms(
                lambda c=config: persistent_path(h, stack, final_norm, meta, cos, sin, c),
                args.repeats,
            )
            same = bool(torch.equal(first, again))
            if args.trace:
                profile = trace_path(h, stack, meta, cos, sin, config)
                results.append(dict(rows=rows, path=f"trace, {label}", profile=profile))
            print(f"| {rows} | persistent, {label} | {ms:.4f} | {base_ms / ms:.2f}x | {error:.1e} | "
                  f"{same} |")  # fmt: skip
            results.append(dict(rows=rows, path=f"persistent, {label}", ms=ms, error=error,
                                repeats=same))  # fmt: skip
    try:
        print("# compiled:", compiled_resources())
    except (AttributeError, IndexError, TypeError) as e:
        print("# compiled: not available", e)
    env = record.environment(__spec__.name, device, context=args.context,
                             table_tokens=args.table_tokens, shared_kv=args.shared_kv)  # fmt: skip
    print(f"# {record.environment_line(env)}")
    record.write_json(args.json, dict(environment=env, rows=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
