"""Attention over contiguous per-slot KV (the vAttention layout, kernels/contiguous_attention.py).

The Triton kernels are checked against the contiguous reference in float64; the contiguous reference itself
against the *paged* reference on the same KV copied into randomly permuted blocks (an independent
implementation of the same attention). On a machine without CUDA the kernels run in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set before triton is imported), so shapes are tiny. Positions of a slot past its
context, and slots no sequence owns, hold stale random data in the reference's input and NaN in the kernels'
input; every output starts as NaN: a kernel that reads past a context or leaves an element unwritten fails.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

pytest.importorskip("triton", reason="triton is not installed")

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.contiguous_attention import contiguous_decode_attention, contiguous_prefill_attention  # noqa: E402
from kernels.paged_attention import DecodeConfig  # noqa: E402
from kernels.prefill_attention import PrefillConfig  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
HEAD_DIM = 64
LENGTHS = [1, 15, 16, 17, 300]
# small tiles and partitions, so that the longest context spans several of them and split-K merges
DECODE_CONFIG = DecodeConfig(tile_n=32, split_tile_n=32, min_partition=64)
PREFILL_CONFIG = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


class SlotKV:
    """Random K/V of several sequences, each in a randomly chosen slot of a fresh ``[num_slots, max_len, ...]``
    cache. ``interleaved``: K and V are strided views of one buffer ``[num_slots, max_len, 2, kv_heads, d]``."""

    def __init__(
        self,
        lengths: list[int],
        kv_heads: int,
        head_dim: int = HEAD_DIM,
        seed: int = 0,
        interleaved: bool = False,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_slots, max_len = len(lengths) + 3, max(lengths) + 21
        # stale data, never zeros
        self.kv = torch.randn(num_slots, max_len, 2, kv_heads, head_dim, generator=gen)
        self.slot_ids = torch.randperm(num_slots, generator=gen)[: len(lengths)].to(torch.int32)
        self.context_lens = torch.tensor(lengths, dtype=torch.int32)
        self.used = torch.zeros(num_slots, max_len, dtype=torch.bool)
        for slot, n in zip(self.slot_ids.tolist(), lengths):
            self.used[slot, :n] = True
        self.interleaved = interleaved

    def caches(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """Clean (K, V) for the reference: every slot holds random data."""
        return self.kv[:, :, 0].to(dtype), self.kv[:, :, 1].to(dtype)

    def poisoned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) for the kernels, on the test device, NaN wherever no sequence's context is."""
        kv = self.kv.clone()
        kv[~self.used] = float("nan")
        kv = kv.to(DEVICE)
        if self.interleaved:
            return kv[:, :, 0], kv[:, :, 1]
        return kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖/‖ref‖ in float64; NaN anywhere gives NaN, which fails every ``<`` check."""
    return float((out.cpu().double() - ref.double()).norm() / ref.double().norm())


def run_decode(kv: SlotKV, heads: int, **kwargs) -> float:
    query = torch.randn(len(kv.context_lens), heads, kv.kv.shape[-1])
    scale = kv.kv.shape[-1] ** -0.5
    ref = torch.empty(query.shape, dtype=torch.float64)
    reference.contiguous_decode_attention(
        ref,
        query.double(),
        *kv.caches(),
        kv.slot_ids,
        kv.context_lens,
        scale,
        int(kv.context_lens.max()),
    )
    out = torch.full(query.shape, float("nan"), device=DEVICE)
    contiguous_decode_attention(
        out,
        query.to(DEVICE),
        *kv.poisoned(),
        kv.slot_ids.to(DEVICE),
        kv.context_lens.to(DEVICE),
        scale,
        int(kv.context_lens.max()),
        config=DECODE_CONFIG,
        **kwargs,
    )
    return relative_error(out, ref)


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 1)], ids=["gqa4", "mqa"])
def test_contiguous_decode_matches_reference(heads, kv_heads, split):
    torch.manual_seed(heads + split)
    assert run_decode(SlotKV(LENGTHS, kv_heads, seed=heads), heads, split=split) < 1e-5


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
def test_contiguous_decode_takes_rows_longest_first_with_the_same_output(split):
    """The step's longest-first ``order`` (as the paged kernel takes it): the same error against the reference,
    every row written where it belongs."""
    torch.manual_seed(5)
    kv = SlotKV(LENGTHS, 2, seed=5)
    order = torch.argsort(-kv.context_lens, stable=True).to(torch.int32).to(DEVICE)
    assert not torch.equal(order.cpu(), torch.arange(len(LENGTHS), dtype=torch.int32))
    assert run_decode(kv, 8, split=split, order=order) < 1e-5


def test_contiguous_decode_strided_views_and_padded_head():
    """K and V interleaved in one buffer (strides from the tensors, not the shape) and head 80 (padded to 128)."""
    torch.manual_seed(80)
    kv = SlotKV([3, 70], 2, head_dim=80, seed=80, interleaved=True)
    assert run_decode(kv, 4, split=True) < 1e-5


def run_prefill(
    cases: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int = HEAD_DIM,
    interleaved: bool = False,
) -> float:
    """``cases``: (tokens already cached, chunk length) per sequence; the chunk's K/V are in the slot too."""
    kv = SlotKV(
        [cached + chunk for cached, chunk in cases],
        kv_heads,
        head_dim,
        seed=heads,
        interleaved=interleaved,
    )
    chunks = [chunk for _, chunk in cases]
    cu = torch.tensor([0] + chunks, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(chunks), heads, head_dim)
    ref = torch.empty(query.shape, dtype=torch.float64)
    reference.contiguous_prefill_attention(
        ref, query.double(), *kv.caches(), kv.slot_ids, cu, kv.context_lens, 0.125
    )
    out = torch.full(query.shape, float("nan"), device=DEVICE)
    contiguous_prefill_attention(
        out,
        query.to(DEVICE),
        *kv.poisoned(),
        kv.slot_ids.to(DEVICE),
        cu.to(DEVICE),
        kv.context_lens.to(DEVICE),
        0.125,
        config=PREFILL_CONFIG,
    )
    return relative_error(out, ref)


# (cached, chunk): a plain prompt, a chunk after a cached prefix, and a batch of varied lengths mixing both with
# a one-token chunk
PREFILL_CASES = {
    "plain": [(0, 37)],
    "after-prefix": [(40, 19)],
    "mixed": [(0, 120), (32, 9), (5, 1), (48, 20), (0, 16)],
}


@pytest.mark.parametrize("cases", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_contiguous_prefill_matches_reference(cases):
    torch.manual_seed(len(cases))
    assert run_prefill(cases, 8, 2) < 1e-5


def test_contiguous_prefill_mqa_strided_views_and_padded_head():
    torch.manual_seed(5)
    assert run_prefill([(20, 13), (0, 7)], 4, 1, head_dim=80, interleaved=True) < 1e-5


def to_paged(
    kv: SlotKV, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): each sequence's context copied position by position into randomly
    permuted blocks of a fresh random paged cache."""
    gen = torch.Generator().manual_seed(seed)
    k_slots, v_slots = kv.caches()
    lengths = kv.context_lens.tolist()
    needed = [-(-n // block_size) for n in lengths]
    shape = (sum(needed) + 3, block_size, *k_slots.shape[2:])
    k_cache, v_cache = (
        torch.randn(shape, generator=gen).double(),
        torch.randn(shape, generator=gen).double(),
    )
    order = torch.randperm(shape[0], generator=gen).tolist()
    tables = []
    for slot, n, count in zip(kv.slot_ids.tolist(), lengths, needed):
        tables.append([order.pop() for _ in range(count)] + [0] * (max(needed) - count))
        for p in range(n):
            k_cache[tables[-1][p // block_size], p % block_size] = k_slots[slot, p]
            v_cache[tables[-1][p // block_size], p % block_size] = v_slots[slot, p]
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32)


def test_contiguous_decode_reference_equals_paged_reference():
    kv = SlotKV([1, 16, 17, 90], 2, seed=7)
    query = torch.randn(4, 8, HEAD_DIM, dtype=torch.float64)
    contiguous, paged = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    reference.contiguous_decode_attention(
        contiguous,
        query,
        *kv.caches(),
        kv.slot_ids,
        kv.context_lens,
        0.125,
        int(kv.context_lens.max()),
    )
    reference.paged_attention(paged, query, *to_paged(kv, 16, seed=7), kv.context_lens, 0.125)
    assert relative_error(contiguous, paged) < 1e-12


def test_contiguous_prefill_reference_equals_paged_reference():
    cases = [(0, 40), (32, 9), (16, 1), (0, 5)]
    kv = SlotKV([cached + chunk for cached, chunk in cases], 2, seed=8)
    cu = torch.tensor([0] + [chunk for _, chunk in cases]).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), 8, HEAD_DIM, dtype=torch.float64)
    contiguous, paged = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    reference.contiguous_prefill_attention(
        contiguous, query, *kv.caches(), kv.slot_ids, cu, kv.context_lens, 0.125
    )
    k_cache, v_cache, tables = to_paged(kv, 16, seed=8)
    reference.prefill_attention(paged, query, k_cache, v_cache, tables, cu, kv.context_lens, 0.125)
    assert relative_error(contiguous, paged) < 1e-12


def test_ops_dispatch_the_contiguous_kernels():
    """Registered in kernels.ops: Triton's (kernels.contiguous_attention) or the reference, same result."""
    assert kernels._triton_kernel("contiguous_decode_attention") is contiguous_decode_attention
    assert kernels._triton_kernel("contiguous_prefill_attention") is contiguous_prefill_attention
    kv = SlotKV([5, 30], 1, seed=9)
    query = torch.randn(2, 2, HEAD_DIM)
    out, ref = torch.full_like(query, float("nan")), torch.empty(query.shape, dtype=torch.float64)
    kernels.ops.contiguous_decode_attention(
        out, query, *kv.caches(torch.float32), kv.slot_ids, kv.context_lens, 0.1, 30
    )
    reference.contiguous_decode_attention(
        ref, query.double(), *kv.caches(), kv.slot_ids, kv.context_lens, 0.1, 30
    )
    assert relative_error(out, ref) < 1e-5
