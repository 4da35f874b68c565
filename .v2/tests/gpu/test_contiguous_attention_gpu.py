"""Attention over contiguous per-slot KV (kernels/contiguous_attention.py, the vAttention layout) on CUDA at
real sizes: Llama heads (32 query / 8 KV, head 64) and Qwen heads (16 / 8, head 128), contexts up to 4096, in
bf16 and fp32, against the contiguous reference in float64 on the same device; and a slot that starts past
2^31 elements (the kernels address in int64).

Positions of a slot past its context, and slots no sequence owns, hold NaN in the kernels' input, and outputs
start as NaN, so a read past a context or an unwritten element fails. fp32 must match to 1e-5 (full-precision
fp32 dots), bf16 to 1e-2.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels compiled)"
)

triton = pytest.importorskip("triton", reason="triton is not installed")

from kernels import reference  # noqa: E402
from kernels.contiguous_attention import contiguous_decode_attention, contiguous_prefill_attention  # noqa: E402

DEVICE = "cuda"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = [torch.bfloat16, torch.float32]
HEADS = {"llama-h32-kv8-d64": (32, 8, 64), "qwen-h16-kv8-d128": (16, 8, 128)}


def slot_cache(
    lengths: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_slots, v_slots, slot_ids, context_lens, unused): random ``[num_slots, max_len, kv_heads, head_dim]``
    slots, max_len past the longest context and a multiple of no tile, each sequence in a random slot;
    ``unused [num_slots, max_len]`` marks every position outside the contexts."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    num_slots, max_len = len(lengths) + 4, max(lengths) + 37
    shape = (num_slots, max_len, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    v = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    slot_ids = torch.randperm(num_slots, generator=gen, device=DEVICE)[: len(lengths)].to(
        torch.int32
    )
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    unused = torch.ones(num_slots, max_len, dtype=torch.bool, device=DEVICE)
    unused[slot_ids.long()] = torch.arange(max_len, device=DEVICE)[None, :] >= context_lens[:, None]
    return k, v, slot_ids, context_lens, unused


def poisoned(cache: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    out = cache.clone()
    out[unused] = float("nan")
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
def test_contiguous_decode_matches_reference(dtype, heads, kv_heads, head_dim, split):
    torch.manual_seed(head_dim)
    lengths = [1, 15, 16, 17, 300, 1000, 4096, 2049] + torch.randint(1, 4096, (8,)).tolist()
    k, v, slot_ids, ctx, unused = slot_cache(lengths, kv_heads, head_dim, dtype, seed=head_dim)
    query = torch.randn(len(lengths), heads, head_dim, device=DEVICE).to(dtype)
    ref = torch.empty(query.shape, dtype=torch.float64, device=DEVICE)
    reference.contiguous_decode_attention(
        ref, query.double(), k.double(), v.double(), slot_ids, ctx, head_dim**-0.5, max(lengths)
    )
    out = torch.full_like(query, float("nan"))
    contiguous_decode_attention(
        out,
        query,
        poisoned(k, unused),
        poisoned(v, unused),
        slot_ids,
        ctx,
        head_dim**-0.5,
        max(lengths),
        split=split,
    )
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", HEADS.values(), ids=HEADS.keys())
def test_contiguous_prefill_with_prefix_hits_and_chunks_matches_reference(
    dtype, heads, kv_heads, head_dim
):
    """Plain prompts (2K, 300, 15 tokens), a prefix hit (1K cached + 500), chunks in the middle of prompts
    (one ending at 4096), and a one-token chunk, in one call."""
    torch.manual_seed(head_dim)
    cases = [(0, 2048), (1024, 500), (512, 512), (4000, 96), (0, 300), (16, 1), (0, 15), (33, 200)]
    k, v, slot_ids, ctx, unused = slot_cache(
        [c + n for c, n in cases], kv_heads, head_dim, dtype, seed=head_dim
    )
    cu = torch.tensor([0] + [n for _, n in cases], device=DEVICE).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), heads, head_dim, device=DEVICE).to(dtype)
    ref = torch.empty(query.shape, dtype=torch.float64, device=DEVICE)
    reference.contiguous_prefill_attention(
        ref, query.double(), k.double(), v.double(), slot_ids, cu, ctx, head_dim**-0.5
    )
    out = torch.full_like(query, float("nan"))
    contiguous_prefill_attention(
        out, query, poisoned(k, unused), poisoned(v, unused), slot_ids, cu, ctx, head_dim**-0.5
    )
    assert relative_error(out, ref) < TOLERANCE[dtype]


FAR_LENGTHS = [3000, 1000]


def far_slot_cache() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_slots, v_slots, slot_ids, packed_k, packed_v): bf16 slots of 2^19 positions of 8 x 128, so slot 4
    starts at element 4 * 2^29 = 2^31 (about 5.4 GB each for K and V); the sequences sit in slots 4 and 0,
    and ``packed_k/v [2, 3000, 8, 128]`` hold the same contexts for the reference. NaN everywhere else."""
    k = torch.full((5, 1 << 19, 8, 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v = torch.full_like(k, float("nan"))
    packed_k = torch.randn(2, max(FAR_LENGTHS), 8, 128, device=DEVICE).to(torch.bfloat16)
    packed_v = torch.randn_like(packed_k)
    slot_ids = torch.tensor([4, 0], dtype=torch.int32, device=DEVICE)
    for b, (slot, n) in enumerate(zip(slot_ids.tolist(), FAR_LENGTHS)):
        k[slot, :n], v[slot, :n] = packed_k[b, :n], packed_v[b, :n]
    return k, v, slot_ids, packed_k, packed_v


def test_decode_reads_slots_past_2_31_elements():
    """32-bit offsets would wrap slot 4 around onto slot 0's NaN."""
    k, v, slot_ids, packed_k, packed_v = far_slot_cache()
    ctx = torch.tensor(FAR_LENGTHS, dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, 32, 128, device=DEVICE).to(torch.bfloat16)
    ref = torch.empty(query.shape, dtype=torch.float64, device=DEVICE)
    reference.contiguous_decode_attention(
        ref,
        query.double(),
        packed_k.double(),
        packed_v.double(),
        torch.arange(2, dtype=torch.int32, device=DEVICE),
        ctx,
        128**-0.5,
        max(FAR_LENGTHS),
    )
    for split in (False, True):
        out = torch.full_like(query, float("nan"))
        contiguous_decode_attention(
            out, query, k, v, slot_ids, ctx, 128**-0.5, max(FAR_LENGTHS), split=split
        )
        assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


def test_prefill_reads_slots_past_2_31_elements():
    """A 100-token chunk after 2900 cached tokens in slot 4, a 1000-token prompt in slot 0."""
    k, v, slot_ids, packed_k, packed_v = far_slot_cache()
    ctx = torch.tensor(FAR_LENGTHS, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 100, 1100], dtype=torch.int32, device=DEVICE)
    query = torch.randn(1100, 32, 128, device=DEVICE).to(torch.bfloat16)
    ref = torch.empty(query.shape, dtype=torch.float64, device=DEVICE)
    reference.contiguous_prefill_attention(
        ref,
        query.double(),
        packed_k.double(),
        packed_v.double(),
        torch.arange(2, dtype=torch.int32, device=DEVICE),
        cu,
        ctx,
        128**-0.5,
    )
    out = torch.full_like(query, float("nan"))
    contiguous_prefill_attention(out, query, k, v, slot_ids, cu, ctx, 128**-0.5)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
