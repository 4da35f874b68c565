"""kernels/persistent_decode.py (every decoder layer of a decode step in one launch) against
``reference.persistent_decode`` (the engine's layer path, op by op).

On a machine without CUDA the kernel runs in Triton's CPU interpreter, which runs programs one after another: a
grid-wide barrier over several programs would wait forever there, so the kernel runs as one program, which takes
every task of every phase (split-K partials and merges, attention partitions and their merge, the writers'
epilogues: rotary, the KV store, the residual adds, SiLU-and-mul). The barrier across programs is
tests/gpu/test_persistent_decode_gpu.py's. float32 (full-precision dots) is checked tightly; float16 as the
half type (the interpreter's bfloat16 ``tl.dot`` is wrong). Weights, stream and caches are random (never
zeros); scratch buffers start as NaN, so a row left unwritten fails.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from kernels import reference  # noqa: E402
from kernels.decoder_stack import DecoderStack, LayerTensors  # noqa: E402
from kernels.persistent_decode import (  # noqa: E402
    STAMPS_PER_LAYER,
    PersistentConfig,
    persistent_decode,
)

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 128, 4, 2, 32, 256
BLOCK_SIZE, NUM_BLOCKS, LAYERS, EPS = 16, 24, 2, 1e-5
SMALL = dict(block_n=32, block_k=32, tile_n=16, programs=0 if DEVICE.type == "cuda" else 1)


def make_stack(dtype: torch.dtype, seed: int = 0) -> DecoderStack:
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        scale = shape[-1] ** -0.5 if len(shape) == 2 else 1.0
        w = torch.randn(*shape, generator=gen) * scale
        return (w if len(shape) == 2 else 1.0 + 0.1 * w).to(dtype).to(DEVICE)

    def cache() -> torch.Tensor:
        shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    layers = [
        LayerTensors(
            qkv=weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
            o=weight(HIDDEN, HEADS * HEAD_DIM),
            gate_up=weight(2 * INTERMEDIATE, HIDDEN),
            down=weight(HIDDEN, INTERMEDIATE),
            norm_in=weight(HIDDEN),
            norm_post=weight(HIDDEN),
            k_cache=cache(),
            v_cache=cache(),
        )
        for _ in range(LAYERS)
    ]
    return DecoderStack(layers, HEADS, KV_HEADS, HEAD_DIM, EPS)


def copy_stack(stack: DecoderStack) -> DecoderStack:
    layers = [
        LayerTensors(**{name: getattr(layer, name).clone() for name in LayerTensors.__slots__})
        for layer in stack.layers
    ]
    return DecoderStack(layers, HEADS, KV_HEADS, HEAD_DIM, EPS)


def rotary_caches(max_position: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def batch(contexts: list[int], padding: int = 0) -> dict[str, torch.Tensor]:
    """Block tables (distinct blocks per sequence, shuffled), the new token's position and slot; ``padding``
    extra rows with slot -1 (a CUDA graph's padding: they attend to block 0 and store nothing)."""
    width = -(-max(contexts) // BLOCK_SIZE) + 1
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))
    tables = torch.zeros(len(contexts) + padding, width, dtype=torch.int32)
    slots = torch.full((len(contexts) + padding,), -1, dtype=torch.int64)
    used = 0
    for i, ctx in enumerate(contexts):
        blocks = order[used : used + width]
        used += width
        tables[i] = blocks.to(torch.int32)
        slots[i] = blocks[(ctx - 1) // BLOCK_SIZE] * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE
    lens = torch.tensor(contexts + [1] * padding, dtype=torch.int32)
    return dict(
        positions=(lens - 1).to(torch.int64).to(DEVICE),
        slot_mapping=slots.to(DEVICE),
        block_tables=tables.to(DEVICE),
        context_lens=lens.to(DEVICE),
    )


def run_both(
    dtype: torch.dtype, contexts: list[int], config: PersistentConfig, padding: int = 0
) -> tuple[DecoderStack, DecoderStack, torch.Tensor, torch.Tensor]:
    stack = make_stack(dtype)
    want_stack = copy_stack(stack)
    rows = len(contexts) + padding
    h = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    want = h.clone()
    cos, sin = rotary_caches()
    meta = batch(contexts, padding)
    persistent_decode(
        h, stack, **meta, cos_cache=cos, sin_cache=sin, scale=HEAD_DIM**-0.5, config=config
    )
    reference.persistent_decode(
        want, want_stack, **meta, cos_cache=cos, sin_cache=sin, scale=HEAD_DIM**-0.5
    )
    return stack, want_stack, h, want


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "contexts, splits, parts, min_tiles",
    [
        ([9], (1, 1, 1, 1), 1, 2),
        ([9], (2, 2, 2, 4), 3, 2),  # partitions 1 and 2 past the context: empty
        ([5, 40, 17], (2, 4, 1, 2), 2, 2),
        ([33, 1, 16], (4, 1, 2, 8), 5, 1),  # one-tile partitions
        ([20, 3, 33], (2, 4, 1, 2), 1, 2),  # one partition: each task writes its output, no merge
    ],
    ids=[
        "one-row-no-split",
        "one-row-split",
        "three-rows",
        "three-rows-more-splits",
        "three-rows-one-partition",
    ],
)
def test_the_layers_equal_the_reference_in_float32(
    contexts: list[int], splits: tuple[int, int, int, int], parts: int, min_tiles: int
) -> None:
    config = PersistentConfig(
        *splits, attention_parts=parts, attention_min_tiles=min_tiles, **SMALL
    )
    stack, want_stack, h, want = run_both(torch.float32, contexts, config)
    assert relative_error(h, want) < 1e-5
    for got, expected in zip(stack.layers, want_stack.layers):
        # every layer's cache: the new tokens' K and V at their slots, nothing else touched
        assert torch.allclose(got.k_cache, expected.k_cache, rtol=1e-5, atol=1e-5)
        assert torch.allclose(got.v_cache, expected.v_cache, rtol=1e-5, atol=1e-5)


def test_the_layers_equal_the_reference_in_float16() -> None:
    config = PersistentConfig(2, 4, 1, 2, attention_parts=2, **SMALL)
    stack, want_stack, h, want = run_both(torch.float16, [7, 30], config)
    assert relative_error(h, want) < 3e-3
    for got, expected in zip(stack.layers, want_stack.layers):
        assert relative_error(got.k_cache, expected.k_cache) < 3e-3


def test_padding_rows_store_nothing() -> None:
    """A CUDA graph's padding rows (slot -1) leave the caches as the reference leaves them."""
    config = PersistentConfig(2, 4, 1, 2, attention_parts=2, **SMALL)
    stack, want_stack, h, want = run_both(torch.float32, [12], config, padding=2)
    assert relative_error(h[:1], want[:1]) < 1e-5
    for got, expected in zip(stack.layers, want_stack.layers):
        assert torch.allclose(got.k_cache, expected.k_cache, rtol=1e-5, atol=1e-5)


def test_the_new_token_is_attended_to() -> None:
    """The check can fail: a stream that skips the KV store (the new token's K/V never written) differs."""
    config = PersistentConfig(2, 4, 1, 2, attention_parts=1, **SMALL)
    stack, want_stack, h, want = run_both(torch.float32, [3], config)
    meta = batch([3])
    meta["slot_mapping"] = torch.full_like(meta["slot_mapping"], -1)
    skipped = make_stack(torch.float32)
    h2 = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cos, sin = rotary_caches()
    persistent_decode(
        h2, skipped, **meta, cos_cache=cos, sin_cache=sin, scale=HEAD_DIM**-0.5, config=config
    )
    assert relative_error(h2, want) > 1e-3


def test_bad_arguments_are_refused() -> None:
    stack = make_stack(torch.float32)
    cos, sin = rotary_caches()
    meta = batch([4])
    with pytest.raises(ValueError, match="h must be"):
        persistent_decode(torch.zeros(17, HIDDEN, device=DEVICE), stack, **meta, cos_cache=cos,
                          sin_cache=sin, scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="qkv_splits"):
        persistent_decode(torch.zeros(1, HIDDEN, device=DEVICE), stack, **meta, cos_cache=cos,
                          sin_cache=sin, scale=1.0, config=PersistentConfig(qkv_splits=3, **SMALL))  # fmt: skip
    # a down split of 32 columns of the MLP, but gate/up blocks of 64: it could not wait for whole blocks
    with pytest.raises(ValueError, match="down_splits"):
        persistent_decode(torch.zeros(1, HIDDEN, device=DEVICE), stack, **meta, cos_cache=cos,
                          sin_cache=sin, scale=1.0,
                          config=PersistentConfig(down_splits=8, **{**SMALL, "block_n": 64}))  # fmt: skip
    # not int64
    wrong_trace = torch.zeros(1, 2 + STAMPS_PER_LAYER * LAYERS, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="trace must be"):
        persistent_decode(torch.zeros(1, HIDDEN, device=DEVICE), stack, **meta, cos_cache=cos,
                          sin_cache=sin, scale=1.0, config=PersistentConfig(**SMALL),
                          trace=wrong_trace)  # fmt: skip
    layer = stack.layers[0]
    with pytest.raises(ValueError, match="qkv weight"):
        DecoderStack([LayerTensors(**{**{n: getattr(layer, n) for n in LayerTensors.__slots__},
                                      "qkv": layer.qkv[:-1]})], HEADS, KV_HEADS, HEAD_DIM, EPS)  # fmt: skip
