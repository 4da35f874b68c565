"""The Triton kernels on CUDA at real sizes (Llama-like heads, contexts up to several thousand tokens, every
block size) in bf16/fp16/fp32, against the torch reference in float64 on the same device.

Cache slots outside every sequence hold NaN in the kernels' input, and outputs start as NaN, so a read past
a context or an unwritten element fails. fp32 must match to 1e-5 (the kernels use full-precision fp32 dots),
half types to 1e-2.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels compiled)"
)

triton = pytest.importorskip("triton", reason="triton is not installed")

from kernels import reference  # noqa: E402
from kernels.cache_ops import copy_blocks, store_kv, swap_blocks  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def paged_cache(
    lengths: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables, context_lens, unused slot mask): random blocks, randomly permuted."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 7
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    v = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device="cuda")
    tables = torch.zeros(len(lengths), max(needed), dtype=torch.int32, device="cuda")
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool, device="cuda")
    first = 0
    for b, (n, count) in enumerate(zip(lengths, needed)):
        tables[b, :count] = order[first : first + count]
        positions = torch.arange(n, device="cuda")
        used[tables[b, positions // block_size].long(), positions % block_size] = True
        first += count
    return k, v, tables, torch.tensor(lengths, dtype=torch.int32, device="cuda"), ~used.view(-1)


def poisoned(cache: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    out = cache.clone()
    out.view(-1, *cache.shape[2:])[unused] = float("nan")
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# every block size with the workload's shape (32 query / 8 KV heads, head 128); the other head layouts at 16
DECODE_SHAPES = [(bs, 32, 8, 128) for bs in (16, 32, 64, 128)] + [
    (16, 24, 8, 64),
    (16, 16, 16, 128),
    (32, 8, 1, 64),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "block_size, heads, kv_heads, head_dim",
    DECODE_SHAPES,
    ids=[f"bs{b}-h{h}-kv{k}-d{d}" for b, h, k, d in DECODE_SHAPES],
)
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
def test_paged_decode_matches_reference(dtype, block_size, heads, kv_heads, head_dim, split):
    torch.manual_seed(block_size)
    lengths = [1, 15, 16, 17, 300, 1000, 4096, 2049] + torch.randint(1, 6000, (8,)).tolist()
    k, v, tables, ctx, unused = paged_cache(
        lengths, block_size, kv_heads, head_dim, dtype, seed=block_size
    )
    query = torch.randn(len(lengths), heads, head_dim, device="cuda").to(dtype)
    ref = torch.empty(query.shape, dtype=torch.float64, device="cuda")
    reference.paged_attention(
        ref, query.double(), k.double(), v.double(), tables, ctx, head_dim**-0.5
    )
    out = torch.full_like(query, float("nan"))
    paged_attention(
        out,
        query,
        poisoned(k, unused),
        poisoned(v, unused),
        tables,
        ctx,
        head_dim**-0.5,
        split=split,
    )
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(32, 8, 128), (24, 8, 64)], ids=["gqa4-h128", "gqa3-h64"]
)
def test_prefill_with_prefix_hits_and_chunks_matches_reference(
    dtype, block_size, heads, kv_heads, head_dim
):
    """Plain prompts (2K, 300, 15 tokens), a prefix hit (1K cached + 500), chunks in the middle of prompts,
    and a one-token chunk, in one call."""
    torch.manual_seed(block_size)
    cases = [(0, 2048), (1024, 500), (512, 512), (4000, 77), (0, 300), (16, 1), (0, 15), (33, 200)]
    lengths = [cached + chunk for cached, chunk in cases]
    k, v, tables, ctx, unused = paged_cache(
        lengths, block_size, kv_heads, head_dim, dtype, seed=block_size
    )
    cu = torch.tensor([0] + [c for _, c in cases], device="cuda").cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), heads, head_dim, device="cuda").to(dtype)
    ref = torch.empty(query.shape, dtype=torch.float64, device="cuda")
    reference.prefill_attention(
        ref, query.double(), k.double(), v.double(), tables, cu, ctx, head_dim**-0.5
    )
    out = torch.full_like(query, float("nan"))
    prefill_attention(
        out, query, poisoned(k, unused), poisoned(v, unused), tables, cu, ctx, head_dim**-0.5
    )
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
    reason="the chunk rows are read through TMA: compute capability 9.0+",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size", [16, 128])
def test_prefill_reading_chunk_rows_equals_the_cache_path(dtype, block_size):
    """The engine's call: the chunk's K/V also given as views of the projection output (TMA loads). Bit for
    bit the cache-only result, with the cache's copy of every chunk position poisoned."""
    torch.manual_seed(block_size + 1)
    heads, kv_heads, head_dim = 32, 8, 128
    cases = [(0, 2048), (1024, 500), (512, 512), (4000, 77), (0, 300), (16, 1), (33, 200)]
    k, v, tables, ctx, unused = paged_cache(
        [c + n for c, n in cases], block_size, kv_heads, head_dim, dtype, seed=block_size
    )
    cu = torch.tensor([0] + [n for _, n in cases], device="cuda").cumsum(0).to(torch.int32)
    slots = torch.cat(
        [
            tables[b, torch.arange(c, c + n, device="cuda") // block_size].long() * block_size
            + torch.arange(c, c + n, device="cuda") % block_size
            for b, (c, n) in enumerate(cases)
        ]
    )
    fused = torch.randn(int(cu[-1]), (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    query, chunk_k, chunk_v = (
        part.view(int(cu[-1]), -1, head_dim)
        for part in fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
    )
    chunk_k.copy_(k.view(-1, kv_heads, head_dim)[slots])
    chunk_v.copy_(v.view(-1, kv_heads, head_dim)[slots])
    k, v = poisoned(k, unused), poisoned(v, unused)
    from_cache = torch.full_like(query, float("nan"))
    prefill_attention(from_cache, query, k, v, tables, cu, ctx, head_dim**-0.5)
    k.view(-1, kv_heads, head_dim)[slots] = float("nan")
    v.view(-1, kv_heads, head_dim)[slots] = float("nan")
    from_rows = torch.full_like(query, float("nan"))
    prefill_attention(
        from_rows, query, k, v, tables, cu, ctx, head_dim**-0.5, 1.0, 1.0, chunk_k, chunk_v
    )
    diff = (from_rows.float() - from_cache.float()).abs().max().item()
    assert torch.equal(from_rows, from_cache), f"max |diff| {diff}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_store_kv_writes_slots_and_skips_padding(dtype):
    k_cache = torch.randn(64, 16, 8, 128, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    # strided views, as the attention layer passes
    fused = torch.randn(300, 3, 8, 128, device="cuda").to(dtype)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(fused[:, 1], fused[:, 2], expected_k, expected_v, slots)
    store_kv(fused[:, 1], fused[:, 2], k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_copy_blocks_and_swap_blocks_match_reference():
    k = torch.randn(4, 32, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mapping = torch.tensor([[3, 20], [7, 21], [0, 31]], device="cuda")
    expected_k, expected_v = k.clone(), v.clone()
    reference.copy_blocks(expected_k, expected_v, mapping)
    copy_blocks(k, v, mapping)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    host = torch.randn(4, 40, 16, 8, 128, dtype=torch.bfloat16).pin_memory()
    expected_host = host.clone()
    reference.swap_blocks(k, expected_host, mapping.cpu())
    swap_blocks(k, host, mapping.cpu())
    torch.cuda.synchronize()
    assert torch.equal(host, expected_host)
