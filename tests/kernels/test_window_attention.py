"""Sliding-window attention (Gemma 3's local layers): a query at position p sees keys p - window + 1 .. p. The
Triton decode and prefill kernels (under TRITON_INTERPRET=1 on the CPU) against the torch references, with every
slot a window never sees poisoned with NaN (a kernel that reads before the window fails), and the references
against a dense causal-with-window softmax."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import reference  # noqa: E402
from kernels.paged_attention import DecodeConfig, paged_attention  # noqa: E402
from kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402
from tests.kernels.test_triton_kernels import (  # noqa: E402
    DEVICE,
    HEAD_DIM,
    PagedKV,
    nan_like,
    relative_error,
)


def poison_before(kv: PagedKV, firsts: list[int]) -> None:
    """Slots of positions before ``firsts[b]`` of sequence b are never read: poisoned too."""
    block_size = kv.k_cache.shape[1]
    for b, first in enumerate(firsts):
        for p in range(first):
            kv.unused_slots[
                int(kv.block_tables[b, p // block_size]) * block_size + p % block_size
            ] = True


def dense_reference(q, keys, values, positions, window, scale):
    """softmax over keys at positions in (p - window, p] for each query position p, in float64."""
    scores = (q.double() @ keys.double().t()) * scale
    key_at = torch.arange(keys.shape[0])[None, :]
    visible = (key_at <= positions[:, None]) & (key_at > positions[:, None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values.double()


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("window", [1, 20, 64, 1000])
def test_windowed_decode_matches_reference_and_reads_only_the_window(window: int, split: bool):
    torch.manual_seed(window)
    lengths = [1, 15, 17, 90, 300]
    kv = PagedKV(lengths, 16, 2, seed=window)
    poison_before(kv, [max(0, n - window) for n in lengths])
    heads = 4
    query = torch.randn(len(lengths), heads, HEAD_DIM)
    ref = torch.empty(query.shape, dtype=torch.float64)
    reference.paged_attention(
        ref, query.double(), kv.k_cache.double(), kv.v_cache.double(), kv.block_tables,
        kv.context_lens, 0.125, window=window,
    )  # fmt: skip
    out = nan_like(query.shape, torch.float32)
    k, v = kv.poisoned()
    config = DecodeConfig(tile_n=32, split_tile_n=32, min_partition=32)
    paged_attention(
        out, query.to(DEVICE), k, v, kv.block_tables.to(DEVICE), kv.context_lens.to(DEVICE), 0.125,
        window=window, split=split, config=config,
    )  # fmt: skip
    assert relative_error(out, ref) < 1e-5


@pytest.mark.parametrize("window", [1, 16, 37, 500])
def test_windowed_prefill_matches_reference_and_reads_only_the_window(window: int):
    torch.manual_seed(window)
    cases = [(0, 70), (100, 33), (5, 16), (40, 1)]  # (cached, chunk)
    kv = PagedKV([c + n for c, n in cases], 16, 2, seed=window)
    poison_before(kv, [max(0, c - window + 1) for c, _ in cases])
    chunks = [n for _, n in cases]
    cu = torch.tensor([0] + chunks, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(chunks), 4, HEAD_DIM)
    ref = torch.empty(query.shape, dtype=torch.float64)
    reference.prefill_attention(
        ref, query.double(), kv.k_cache.double(), kv.v_cache.double(), kv.block_tables, cu,
        kv.context_lens, 0.125, window=window,
    )  # fmt: skip
    out = nan_like(query.shape, torch.float32)
    k, v = kv.poisoned()
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    prefill_attention(
        out, query.to(DEVICE), k, v, kv.block_tables.to(DEVICE), cu.to(DEVICE),
        kv.context_lens.to(DEVICE), 0.125, window=window, config=config,
    )  # fmt: skip
    assert relative_error(out, ref) < 1e-5


def test_the_references_equal_a_dense_windowed_softmax():
    """One sequence of 50 tokens in blocks of 16, window 7: the decode reference for its last token and the
    prefill reference for a chunk of its last 20, against the dense softmax."""
    torch.manual_seed(0)
    kv = PagedKV([50], 16, 1, seed=0)
    block_size = 16
    flat = [
        int(kv.block_tables[0, p // block_size]) * block_size + p % block_size for p in range(50)
    ]
    keys = kv.k_cache.view(-1, 1, HEAD_DIM)[flat, 0]
    values = kv.v_cache.view(-1, 1, HEAD_DIM)[flat, 0]
    q = torch.randn(20, 1, HEAD_DIM)
    expected = dense_reference(q[:, 0], keys, values, torch.arange(30, 50), 7, 0.125)
    out = torch.empty(20, 1, HEAD_DIM, dtype=torch.float64)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    reference.prefill_attention(
        out, q.double(), kv.k_cache.double(), kv.v_cache.double(), kv.block_tables, cu,
        kv.context_lens, 0.125, window=7,
    )  # fmt: skip
    torch.testing.assert_close(out[:, 0], expected)
    last = torch.empty(1, 1, HEAD_DIM, dtype=torch.float64)
    reference.paged_attention(
        last, q[-1:].double(), kv.k_cache.double(), kv.v_cache.double(), kv.block_tables,
        kv.context_lens, 0.125, window=7,
    )  # fmt: skip
    torch.testing.assert_close(last[0, 0], expected[-1])
