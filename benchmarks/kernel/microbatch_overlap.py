"""Can a decode step's attention (bandwidth-bound) and its matrix products (FLOP-bound at hundreds of rows) run at
once? The promise of splitting a decode step into two micro-batches on two streams (NanoFlow's intra-device
overlap), measured before building it.

llama-3.2-1b's decoder layers (hidden 2048, 32 query / 8 KV heads of 64, intermediate 8192; random bf16 weights,
a KV cache of its own per layer) at the nano workload's rows at decode step ``--step``
(benchmarks/kernel/decode_attention_mixed.py): per layer the qkv product, decode attention (ours), the o product,
gate/up, SiLU-and-mul (ours), down. Norms, rotary and the KV store are left out (~7% of the step). Timed in CUDA
graph replays of all the layers:

- ``one batch``: every row in one chain (today's step);
- ``halves, one stream``: the first half of the rows through every layer, then the second half;
- ``halves, two streams``: the halves' chains on two streams at once (they share nothing);
- ``halves, two streams, offset``: the second half starts when the first half's first attention has finished,
  so one half's attention meets the other's matrix products;
- ``attention only`` / ``products only``: the one-batch chain with only those kernels (what a perfect overlap
  would be bounded by: the larger of the two).

    python -m benchmarks.kernel.microbatch_overlap [--step 0] [--layers 16] [--json PATH]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from benchmarks.harness import record
from benchmarks.harness.graph_timing import graph_ms
from benchmarks.kernel.decode_attention_mixed import nano_contexts, step_inputs
from kernels.activation import silu_and_mul
from kernels.paged_attention import paged_attention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2048, 32, 8, 64, 8192
DTYPE = torch.bfloat16


@dataclass
class Layer:
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    kv: dict  # step_inputs(): caches, tables, context lengths for every row


def weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5


def build_layers(contexts: list[int], layers: int) -> list[Layer]:
    return [
        Layer(
            weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            weight(HIDDEN, HEADS * HEAD_DIM),
            weight(2 * INTERMEDIATE, HIDDEN),
            weight(HIDDEN, INTERMEDIATE),
            step_inputs(contexts, HEADS, KV_HEADS, HEAD_DIM, table_tokens=0),
        )
        for _ in range(layers)
    ]


def forward(
    layers: list[Layer],
    x: torch.Tensor,
    rows: slice,
    queries: torch.Tensor,
    outputs: torch.Tensor,
    attention: bool = True,
    products: bool = True,
    after_first_attention: torch.cuda.Event | None = None,
) -> torch.Tensor:
    """The layers' chain for ``rows`` of the batch on the current stream (``x``: those rows' hidden states;
    ``queries`` and ``outputs``: every row's attention query and output, random, made before any capture: the
    attention-only chain reads that query, the products' chain computes its own)."""
    n = x.shape[0]
    q, attn_out = queries[rows], outputs[rows]
    for i, layer in enumerate(layers):
        if products:
            qkv = x @ layer.qkv.T
            q = qkv[:, : HEADS * HEAD_DIM].view(n, HEADS, HEAD_DIM)
        if attention:
            kv = layer.kv
            paged_attention(
                attn_out,
                q,
                kv["k_cache"],
                kv["v_cache"],
                kv["tables"][rows],
                kv["context_lens"][rows],
                HEAD_DIM**-0.5,
            )
            if i == 0 and after_first_attention is not None:
                after_first_attention.record()
        if products:
            h = attn_out.view(n, -1) @ layer.o.T
            x = silu_and_mul(h @ layer.gate_up.T) @ layer.down.T
    return x


def variants(layers: list[Layer], batch: int) -> dict:
    half = batch // 2
    x = torch.randn(batch, HIDDEN, device="cuda", dtype=DTYPE)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    attn = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    a, b = slice(0, half), slice(half, batch)
    side = [torch.cuda.Stream(), torch.cuda.Stream()]

    def two_streams(offset: bool) -> None:
        main = torch.cuda.current_stream()
        started = torch.cuda.Event() if offset else None
        for s in side:
            s.wait_stream(main)
        with torch.cuda.stream(side[0]):
            forward(layers, x[a], a, q, attn, after_first_attention=started)
        with torch.cuda.stream(side[1]):
            if started is not None:
                side[1].wait_event(started)
            forward(layers, x[b], b, q, attn)
        for s in side:
            main.wait_stream(s)

    return {
        "one batch": lambda: forward(layers, x, slice(0, batch), q, attn),
        "halves, one stream": lambda: (
            forward(layers, x[a], a, q, attn),
            forward(layers, x[b], b, q, attn),
        ),
        "halves, two streams": lambda: two_streams(False),
        "halves, two streams, offset": lambda: two_streams(True),
        "attention only": lambda: forward(layers, x, slice(0, batch), q, attn, products=False),
        "products only": lambda: forward(layers, x, slice(0, batch), q, attn, attention=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    record.require_cuda(__spec__.name)
    contexts = nano_contexts(args.step)
    layers = build_layers(contexts, args.layers)
    timed = {name: graph_ms(fn) for name, fn in variants(layers, len(contexts)).items()}
    env = record.environment(__spec__.name, "cuda")
    print(f"\n{record.environment_line(env)}")
    print(
        f"llama-3.2-1b, {args.layers} layers, {len(contexts)} rows at nano decode step {args.step} "
        f"(contexts {min(contexts)}-{max(contexts)})\n"
    )
    base = timed["one batch"]
    print("| variant | ms | vs one batch |\n|---|---:|---:|")
    for name, ms in timed.items():
        print(f"| {name} | {ms:.3f} | {ms / base:.2f}x |")
    bound = max(timed["attention only"], timed["products only"])
    print(f"\na perfect overlap's bound: {bound:.3f} ms ({bound / base:.2f}x)")
    record.write_json(
        args.json, dict(environment=env, step=args.step, rows=len(contexts), ms=timed)
    )


if __name__ == "__main__":
    main()
