"""The native CPU step's paged attention (kernels/cpu_attention.cpp, the op ``paged_attention``) against a float64
reference, at every instruction-set level this CPU can run: rows alone and in runs (consecutive rows of one
sequence: a prompt's tokens, speculative decoding's verify rows), with sliding windows, contexts over several spans
of 128 positions, head dims a multiple of the level's vector (16 floats, 8 below AVX-512: the vector path) and not
(the row-at-a-time path). A row's result must not depend on the rows beside it (greedy output must not depend on
load): bit for bit against the row alone."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cpu_native import LEVELS, kernels_at

BLOCK = 16


def reference(q, k_cache, v_cache, tables, lens, window, scale) -> torch.Tensor:
    """softmax(q k^T scale) v per row in float64, positions [max(0, len - window), len)"""
    rows, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        length = int(lens[r])
        first = max(0, length - window) if window else 0
        positions = torch.arange(first, length)
        slots = tables[r, positions // BLOCK].long() * BLOCK + positions % BLOCK
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        if len(positions) == 0:
            continue
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[r].double(), k) * scale, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", weights, v)
    return out.flatten(1)


def cache(blocks: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, BLOCK, kv_heads, dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def batch(
    sequences: list[tuple[list[int], list[int]]], width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """rows from (block table, contexts) per sequence: one row per context, the sequence's table on each"""
    tables, lens = [], []
    for table, contexts in sequences:
        for length in contexts:
            tables.append(table + [0] * (width - len(table)))
            lens.append(length)
    return torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


# (heads, kv_heads, head_dim): SmolLM2's, Gemma 3's, a head dim of the row-at-a-time path (20), one KV head per
# query, 24 (the vector path in vectors of 8 below AVX-512, the row-at-a-time path with AVX-512's 16)
SHAPES = [(9, 3, 64), (4, 1, 256), (4, 2, 20), (2, 2, 16), (4, 2, 24)]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("window", [0, 40])
def test_rows_and_runs_match_the_float64_reference(level, heads, kv_heads, dim, window):
    ops = kernels_at(level).ops
    k_cache, v_cache = cache(48, kv_heads, dim, seed=dim + window)
    blocks = torch.randperm(47, generator=torch.Generator().manual_seed(1)) + 1
    long_table, other = blocks[:21].tolist(), blocks[21:30].tolist()
    shared = [long_table[0]] + other[1:]  # another sequence with the first block of the first
    sequences = [
        (long_table, [300, 301, 302, 303, 304]),  # verify rows over three spans: one run
        (long_table, list(range(1, 12))),  # a prompt's first tokens: runs of up to 8
        (shared, [305, 7]),  # the first block shared, a context one past the run's: not of it
        (other, [129, 0]),  # a span and one more position; a padding row (no context: zeros)
    ]
    tables, lens = batch(sequences, 21)
    g = torch.Generator().manual_seed(heads * dim)
    q = torch.randn(len(lens), heads, dim, generator=g)
    scale = dim**-0.5
    out = ops.paged_attention(q, k_cache, v_cache, tables, lens, window, scale)
    expected = reference(q, k_cache, v_cache, tables, lens, window, scale)
    assert (out.double() - expected).abs().max() < 1e-5
    assert torch.equal(out[-1], torch.zeros(heads * dim)), (
        "a row without context attends to nothing"
    )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_a_row_gives_the_same_floats_alone_and_in_a_run(level, heads, kv_heads, dim):
    ops = kernels_at(level).ops
    k_cache, v_cache = cache(40, kv_heads, dim, seed=7)
    table = (torch.randperm(39, generator=torch.Generator().manual_seed(2)) + 1).tolist()
    contexts = list(range(120, 140)) + [3, 4, 5, 6]  # runs across a span's end, then a short one
    tables, lens = batch([(table, contexts)], 39)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(3))
    for window in (0, 130):
        together = ops.paged_attention(q, k_cache, v_cache, tables, lens, window, 0.125)
        for r in range(len(lens)):
            alone = ops.paged_attention(
                q[r : r + 1], k_cache, v_cache, tables[r : r + 1], lens[r : r + 1], window, 0.125
            )
            assert torch.equal(alone[0], together[r]), (r, window)


def test_bad_tables_are_refused():
    ops = kernels_at("generic").ops
    k_cache, v_cache = cache(4, 1, 16, seed=0)
    q = torch.randn(1, 2, 16)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="a block id outside the cache"):
        ops.paged_attention(
            q, k_cache, v_cache, torch.tensor([[1, 9]], dtype=torch.int32), lens, 0, 1.0
        )
    with pytest.raises(RuntimeError, match="a context beyond its table"):
        ops.paged_attention(
            q, k_cache, v_cache, torch.tensor([[1]], dtype=torch.int32), lens, 0, 1.0
        )
