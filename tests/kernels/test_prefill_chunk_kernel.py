"""The prefill kernel reading the chunk's own K/V rows (``chunk_k``/``chunk_v``, TMA descriptors on Hopper)
in place of the cache's copy: the same result, bit for bit, as reading everything from the cache, and no read
of the cache at the chunk's positions (they are poisoned with NaN here). In Triton's interpreter the
descriptors run as plain loads; tests/gpu/test_kernels_gpu.py runs the same comparison compiled on an H100.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from kernels import reference  # noqa: E402
from kernels.contiguous_attention import contiguous_prefill_attention  # noqa: E402
from kernels.device_features import has_tma  # noqa: E402
from kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402
from kernels.prefill_chunk import chunk_rows, tma_rows  # noqa: E402
from tests.kernels.test_triton_kernels import (  # noqa: E402
    DEVICE,
    HEAD_DIM,
    PagedKV,
    nan_like,
    relative_error,
)

TMA_HERE = DEVICE.type == "cpu" or has_tma(DEVICE)
# the chunk path from the first token (by default a pass needs 2048 query tokens)
ANY_SIZE = PrefillConfig(chunk_tma_min_tokens=0)
SMALL_TILES = PrefillConfig(
    block_m=16, block_n=16, num_warps=4, num_stages=2, chunk_tma_min_tokens=0
)


def fused_projection(k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, (heads + 2 * kv_heads) * head_dim]`` rows holding random queries, then ``k``, then ``v``: the
    chunk's K/V are strided views of it, as the attention layer passes them."""
    tokens, kv_heads, head_dim = k.shape
    fused = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(k.dtype)
    fused[:, heads * head_dim : (heads + kv_heads) * head_dim] = k.flatten(1)
    fused[:, (heads + kv_heads) * head_dim :] = v.flatten(1)
    return fused


def chunk_views(
    fused: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    k = fused[:, heads * HEAD_DIM : (heads + kv_heads) * HEAD_DIM].view(-1, kv_heads, HEAD_DIM)
    v = fused[:, (heads + kv_heads) * HEAD_DIM :].view(-1, kv_heads, HEAD_DIM)
    return k, v


def chunk_positions(kv: PagedKV, cases: list[tuple[int, int]]) -> torch.Tensor:
    """Cache slots (``block * block_size + offset``) of every chunk position, in query-row order."""
    block_size = kv.k_cache.shape[1]
    slots = []
    for b, (cached, chunk) in enumerate(cases):
        for p in range(cached, cached + chunk):
            slots.append(int(kv.block_tables[b, p // block_size]) * block_size + p % block_size)
    return torch.tensor(slots)


def reference_output(query: torch.Tensor, kv: PagedKV, cu: torch.Tensor) -> torch.Tensor:
    """The float64 reference on the clean cache (CPU)."""
    ref = torch.empty(query.shape, dtype=torch.float64)
    reference.prefill_attention(
        ref,
        query.double(),
        kv.k_cache.double(),
        kv.v_cache.double(),
        kv.block_tables,
        cu,
        kv.context_lens,
        0.125,
    )
    return ref


@pytest.mark.skipif(not TMA_HERE, reason="the chunk path needs compute capability 9.0+ (TMA)")
@pytest.mark.parametrize(
    "cases, config",
    [
        # a long plain prompt, prefixes that end inside a tile and on a tile edge, a one-token chunk
        ([(0, 300), (32, 9), (40, 70), (16, 1), (0, 15)], ANY_SIZE),
        ([(0, 70), (100, 33), (5, 40), (48, 48)], SMALL_TILES),
    ],
    ids=["default-tiles", "small-tiles"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_rows_give_the_cache_path_bit_for_bit(cases, config, dtype):
    torch.manual_seed(len(cases))
    heads, kv_heads = 8, 2
    kv = PagedKV([c + n for c, n in cases], 16, kv_heads, dtype=dtype, seed=7)
    chunks = [n for _, n in cases]
    cu = torch.tensor([0] + chunks, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(chunks), heads, HEAD_DIM).to(dtype)
    slots = chunk_positions(kv, cases)
    flat_k = kv.k_cache.view(-1, kv_heads, HEAD_DIM)
    flat_v = kv.v_cache.view(-1, kv_heads, HEAD_DIM)
    fused = fused_projection(flat_k[slots], flat_v[slots], heads).to(DEVICE)
    chunk_k, chunk_v = chunk_views(fused, heads, kv_heads)
    assert chunk_rows(query.to(DEVICE), kv.k_cache.to(DEVICE), chunk_k) is not None
    args = (kv.block_tables.to(DEVICE), cu.to(DEVICE), kv.context_lens.to(DEVICE), 0.125)

    k, v = kv.poisoned()
    from_cache = nan_like(query.shape, dtype)
    prefill_attention(from_cache, query.to(DEVICE), k, v, *args, config=config)
    # the chunk must come from its rows
    k.view(-1, kv_heads, HEAD_DIM)[slots.to(DEVICE)] = float("nan")
    v.view(-1, kv_heads, HEAD_DIM)[slots.to(DEVICE)] = float("nan")
    from_rows = nan_like(query.shape, dtype)
    prefill_attention(
        from_rows, query.to(DEVICE), k, v, *args, 1.0, 1.0, chunk_k, chunk_v, config=config
    )

    assert torch.equal(from_rows, from_cache)
    ref = reference_output(query, kv, cu)
    assert relative_error(from_rows, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(not TMA_HERE, reason="the chunk path needs compute capability 9.0+ (TMA)")
def test_contiguous_layout_reads_chunk_rows_too():
    torch.manual_seed(11)
    heads, kv_heads, max_len = 4, 2, 160
    cases = [(50, 70), (0, 33), (17, 1)]
    slot_ids = torch.tensor([2, 0, 1], dtype=torch.int32)
    k_slots = torch.randn(3, max_len, kv_heads, HEAD_DIM)
    v_slots = torch.randn(3, max_len, kv_heads, HEAD_DIM)
    chunks = [n for _, n in cases]
    cu = torch.tensor([0] + chunks, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ctx = torch.tensor([c + n for c, n in cases], dtype=torch.int32)
    query = torch.randn(sum(chunks), heads, HEAD_DIM)
    chunk_k = torch.cat([k_slots[s, c : c + n] for s, (c, n) in zip(slot_ids.tolist(), cases)])
    chunk_v = torch.cat([v_slots[s, c : c + n] for s, (c, n) in zip(slot_ids.tolist(), cases)])
    fused = fused_projection(chunk_k, chunk_v, heads).to(DEVICE)
    rows_k, rows_v = chunk_views(fused, heads, kv_heads)
    ref = torch.empty(query.shape)
    reference.contiguous_prefill_attention(ref, query, k_slots, v_slots, slot_ids, cu, ctx, 0.125)
    k, v = k_slots.clone(), v_slots.clone()
    for s, (c, n) in zip(slot_ids.tolist(), cases):  # the chunk's positions and everything after
        k[s, c:], v[s, c:] = float("nan"), float("nan")
    out = nan_like(query.shape, torch.float32)
    contiguous_prefill_attention(
        out,
        query.to(DEVICE),
        k.to(DEVICE),
        v.to(DEVICE),
        slot_ids.to(DEVICE),
        cu.to(DEVICE),
        ctx.to(DEVICE),
        0.125,
        1.0,
        1.0,
        rows_k,
        rows_v,
        config=ANY_SIZE,
    )
    assert relative_error(out, ref) < 1e-5


def test_short_passes_read_the_cache_not_the_chunk_rows():
    """Under ``chunk_tma_min_tokens`` query tokens the host's descriptor work would outweigh the kernel: the
    chunk rows (poisoned here) are not read."""
    torch.manual_seed(12)
    cases, heads, kv_heads = [(20, 40), (0, 30)], 4, 2
    kv = PagedKV([c + n for c, n in cases], 16, kv_heads, seed=3)
    cu = torch.tensor([0, 40, 70], dtype=torch.int32)
    query = torch.randn(70, heads, HEAD_DIM)
    poison = torch.full((70, (heads + 2 * kv_heads) * HEAD_DIM), float("nan"), device=DEVICE)
    chunk_k, chunk_v = chunk_views(poison, heads, kv_heads)
    k, v = kv.poisoned()
    args = (kv.block_tables.to(DEVICE), cu.to(DEVICE), kv.context_lens.to(DEVICE), 0.125)
    out = nan_like(query.shape, torch.float32)
    prefill_attention(out, query.to(DEVICE), k, v, *args, 1.0, 1.0, chunk_k, chunk_v)
    ref = reference_output(query, kv, cu)
    assert relative_error(out, ref) < 1e-5


def test_chunk_rows_only_where_the_descriptors_fit():
    query = torch.randn(6, 4, HEAD_DIM, device=DEVICE)
    cache = torch.randn(4, 16, 2, HEAD_DIM, device=DEVICE)
    fused = torch.randn(6, 8 * HEAD_DIM, device=DEVICE)
    view = fused[:, 4 * HEAD_DIM : 6 * HEAD_DIM].view(6, 2, HEAD_DIM)
    rows = chunk_rows(query, cache, view)
    if not TMA_HERE:
        assert rows is None  # an Ampere-class GPU keeps the block-table path
        return
    assert rows.shape == (6, 2 * HEAD_DIM) and rows.data_ptr() == view.data_ptr()
    assert chunk_rows(query, cache, None) is None
    assert chunk_rows(query, cache.to(torch.float8_e4m3fn), view) is None  # FP8 stores other values
    assert chunk_rows(query, cache, view.half()) is None  # not the query's dtype
    odd = torch.randn(6, 2 * 48 + 1, device=DEVICE)[:, 1:].view(
        6, 2, 48
    )  # head 48: not a power of 2
    assert chunk_rows(query[..., :48], cache[..., :48], odd) is None
    skewed = torch.randn(6 * 2 * HEAD_DIM + 1, device=DEVICE)[1:].view(6, 2, HEAD_DIM)
    assert chunk_rows(query, cache, skewed) is None  # base 4 bytes off a 16-byte boundary
    assert tma_rows(skewed) is None and tma_rows(query) is not None  # the query's rows, likewise
    assert tma_rows(query.transpose(0, 1)) is None  # heads not adjacent in a row
