"""The torch reference kernels (the CPU path) against plain dense attention in float64: KV scattered over
randomly permuted blocks must give the same result as attention over contiguous tensors."""

from __future__ import annotations

import pytest
import torch

from kernels import reference

HEAD_DIM = 32


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Lq, H, d] are the last Lq positions of k/v [L, Hkv, d]; float64, written out by hand."""
    lq, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    out = torch.empty(lq, heads, q.shape[-1], dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for i in range(lq):
            visible = length - lq + i + 1
            scores = (q[i, h].double() @ kh[:visible].T) * scale
            out[i, h] = torch.softmax(scores, dim=-1) @ vh[:visible]
    return out


def scatter_to_blocks(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    free_blocks: list[int],
) -> list[int]:
    """Store one sequence's K/V through store_kv at the slots of freshly taken (random) blocks."""
    block_size = k_cache.shape[1]
    table = [free_blocks.pop() for _ in range(-(-k.shape[0] // block_size))]
    slots = torch.tensor(
        [table[p // block_size] * block_size + p % block_size for p in range(k.shape[0])]
    )
    reference.store_kv(k, v, k_cache, v_cache, slots)
    return table


def make_cache(
    num_blocks: int, block_size: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    # stale random data, never zeros
    k_cache = torch.randn(num_blocks, block_size, kv_heads, HEAD_DIM)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, HEAD_DIM)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(num_blocks)).tolist()
    return k_cache, v_cache, order


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_paged_decode_equals_dense_attention(block_size, heads, kv_heads):
    torch.manual_seed(block_size + heads)
    lengths = [1, 15, 16, 17, 300]
    k_cache, v_cache, free = make_cache(64, block_size, kv_heads)
    tables, refs, queries = [], [], []
    for length in lengths:
        k, v = torch.randn(length, kv_heads, HEAD_DIM), torch.randn(length, kv_heads, HEAD_DIM)
        q = torch.randn(1, heads, HEAD_DIM)
        tables.append(scatter_to_blocks(k, v, k_cache, v_cache, free))
        refs.append(dense_causal_attention(q, k, v, HEAD_DIM**-0.5)[0])
        queries.append(q[0])
    out = torch.full((len(lengths), heads, HEAD_DIM), float("nan"))
    reference.paged_attention(
        out,
        torch.stack(queries),
        k_cache,
        v_cache,
        padded(tables),
        torch.tensor(lengths, dtype=torch.int32),
        HEAD_DIM**-0.5,
    )
    assert relative_error(out, torch.stack(refs)) < 1e-5


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2)])
def test_prefill_with_cached_prefix_and_chunks_equals_dense_attention(heads, kv_heads):
    """Three sequences: a plain prefill, a chunk after a cached prefix, a chunk in the middle of a prompt."""
    torch.manual_seed(heads)
    cases = [(0, 37), (32, 9), (48, 20)]  # (tokens already cached, chunk length)
    k_cache, v_cache, free = make_cache(32, 16, kv_heads)
    tables, refs, chunks = [], [], []
    for cached, chunk in cases:
        total = cached + chunk
        k, v = torch.randn(total, kv_heads, HEAD_DIM), torch.randn(total, kv_heads, HEAD_DIM)
        q = torch.randn(chunk, heads, HEAD_DIM)
        tables.append(scatter_to_blocks(k, v, k_cache, v_cache, free))
        refs.append(dense_causal_attention(q, k, v, 0.125))
        chunks.append(q)
    cu = torch.tensor([0, 37, 46, 66], dtype=torch.int32)
    out = torch.full((66, heads, HEAD_DIM), float("nan"))
    reference.prefill_attention(
        out,
        torch.cat(chunks),
        k_cache,
        v_cache,
        padded(tables),
        cu,
        torch.tensor([c + n for c, n in cases], dtype=torch.int32),
        0.125,
    )
    assert relative_error(out, torch.cat(refs)) < 1e-5


def test_store_kv_skips_padding_slots():
    k_cache, v_cache, _ = make_cache(4, 16, 2)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    reference.store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 40]))
    flat_k, flat_v = k_cache.view(-1, 2, HEAD_DIM), v_cache.view(-1, 2, HEAD_DIM)
    assert (
        torch.equal(flat_k[5], key[0])
        and torch.equal(flat_k[40], key[2])
        and torch.equal(flat_v[40], value[2])
    )
    untouched = [s for s in range(64) if s not in (5, 40)]
    assert torch.equal(flat_k[untouched], before_k.view(-1, 2, HEAD_DIM)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, 2, HEAD_DIM)[untouched])


def test_copy_blocks_copies_every_layer():
    k = torch.randn(3, 6, 16, 2, HEAD_DIM)
    v = torch.randn(3, 6, 16, 2, HEAD_DIM)
    k0, v0 = k.clone(), v.clone()
    reference.copy_blocks(k, v, torch.tensor([[1, 4], [2, 5]]))
    assert torch.equal(k[:, 4], k0[:, 1]) and torch.equal(v[:, 5], v0[:, 2])
    assert torch.equal(k[:, :4], k0[:, :4])
