"""The Triton kernels against their torch references (kernels/reference.py) on random paged caches.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before
triton is imported); with CUDA they run compiled on the GPU at the same small sizes (tests/gpu/ holds the
real sizes). Cache slots that belong to no sequence are poisoned with NaN in the kernels' input (the
reference gets clean random data there), and every output buffer starts as NaN: a kernel that reads past a
context or leaves an element unwritten fails. The oracle is the reference in float64.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from kernels import reference  # noqa: E402
from kernels.cache_ops import copy_blocks, store_kv, swap_blocks  # noqa: E402
from kernels.paged_attention import (  # noqa: E402
    DecodeConfig,
    choose_partition,
    key_tile,
    paged_attention,
    reads_in_order,
)
from kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
HEAD_DIM = 64
LENGTHS = [1, 15, 16, 17, 300]


class PagedKV:
    """Random K/V of several sequences scattered over randomly permuted blocks of a fresh cache."""

    def __init__(
        self,
        lengths: list[int],
        block_size: int,
        kv_heads: int,
        head_dim: int = HEAD_DIM,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        needed = [-(-n // block_size) for n in lengths]
        num_blocks = sum(needed) + 3
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)  # stale random data, never zeros
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables, used = [], torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for n, count in zip(lengths, needed):
            table = [order.pop() for _ in range(count)]
            for p in range(n):
                used[table[p // block_size] * block_size + p % block_size] = True
            tables.append(table)
        width = max(needed)
        self.block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
        )
        self.context_lens = torch.tensor(lengths, dtype=torch.int32)
        self.unused_slots = ~used

    def poisoned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches with every slot outside the sequences set to NaN, on the test device."""
        k, v = self.k_cache.clone(), self.v_cache.clone()
        k.view(-1, *k.shape[2:])[self.unused_slots] = float("nan")
        v.view(-1, *v.shape[2:])[self.unused_slots] = float("nan")
        return k.to(DEVICE), v.to(DEVICE)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖/‖ref‖ in float64; NaN anywhere gives NaN, which fails every ``<`` check."""
    return float((out.cpu().double() - ref.double()).norm() / ref.double().norm())


def nan_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def run_decode(kv: PagedKV, heads: int, dtype: torch.dtype, **kwargs) -> float:
    query = torch.randn(len(kv.context_lens), heads, kv.k_cache.shape[-1]).to(dtype)
    scale = kv.k_cache.shape[-1] ** -0.5
    ref = torch.empty(query.shape, dtype=torch.float64)
    reference.paged_attention(
        ref,
        query.double(),
        kv.k_cache.double(),
        kv.v_cache.double(),
        kv.block_tables,
        kv.context_lens,
        scale,
    )
    out = nan_like(query.shape, dtype)
    k, v = kv.poisoned()
    paged_attention(
        out,
        query.to(DEVICE),
        k,
        v,
        kv.block_tables.to(DEVICE),
        kv.context_lens.to(DEVICE),
        scale,
        **kwargs,
    )
    return relative_error(out, ref)


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_paged_decode_matches_reference(block_size, heads, kv_heads, split):
    torch.manual_seed(block_size + heads)
    kv = PagedKV(LENGTHS, block_size, kv_heads, seed=heads)
    # small partitions so that the 300-token context spans five of them and the merge has work
    config = DecodeConfig(tile_n=32, split_tile_n=32, min_partition=64)
    assert run_decode(kv, heads, torch.float32, split=split, config=config) < 1e-5


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
def test_rows_taken_in_the_steps_order_give_the_same_output(split):
    """The programs take the rows through ``order`` (the step's longest-first permutation): each row's output
    lands in its own row, bit for bit as in row order; an order that names row 0 only leaves the others
    unwritten (so the order is read)."""
    kv = PagedKV(LENGTHS, 16, 2, seed=3)
    config = DecodeConfig(tile_n=32, split_tile_n=32, min_partition=64)
    assert reads_in_order(len(LENGTHS) * 2, HEAD_DIM, DEVICE, config)
    query = torch.randn(len(LENGTHS), 4, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    k, v = kv.poisoned()
    args = (query.to(DEVICE), k, v, kv.block_tables.to(DEVICE), kv.context_lens.to(DEVICE), 0.125)
    longest_first = torch.argsort(-kv.context_lens, stable=True).to(torch.int32)
    outs = {}
    for name, order in [
        ("rows", None),
        ("longest-first", longest_first),
        ("row 0 only", torch.zeros(len(LENGTHS), dtype=torch.int32)),
    ]:
        outs[name] = nan_like(query.shape, torch.float32)
        order = order.to(DEVICE) if order is not None else None
        paged_attention(outs[name], *args, 1.0, 1.0, 0, order, split=split, config=config)
    assert not outs["rows"].isnan().any()
    assert torch.equal(outs["longest-first"], outs["rows"])
    assert torch.equal(outs["row 0 only"][0], outs["rows"][0])
    assert outs["row 0 only"][1:].isnan().all()


def test_rows_are_ordered_for_wide_heads_or_a_few_waves_of_programs():
    config = DecodeConfig(ordered_below_programs_per_sm=6.0)
    cpu = torch.device("cpu")  # (132 SMs, as an H200)
    assert reads_in_order(256 * 8, 128, cpu, config)  # head 128: always
    assert not reads_in_order(256 * 8, 64, cpu, config)  # head 64, 2,048 programs: 15.5 waves
    assert reads_in_order(64 * 8, 64, cpu, config)  # 512 programs: under 6 waves


def test_short_contexts_under_a_graphs_wide_table_spread_over_every_partition():
    """A CUDA graph's table is as wide as max_model_len: the launch's partitions are sized for it, and each
    sequence spreads its own short context over all of them (here 1 .. 3 tiles each of 16 partitions)."""
    torch.manual_seed(7)
    kv = PagedKV([1, 40, 90, 17], 16, 2, seed=7)
    kv.block_tables = torch.cat(
        [kv.block_tables, torch.zeros(4, 64 - kv.block_tables.shape[1], dtype=torch.int32)], dim=1
    )
    config = DecodeConfig(split_tile_n=32, min_partition=64)
    assert choose_partition(4 * 2, 64 * 16, torch.device("cpu"), config, True) == 64
    assert run_decode(kv, 4, torch.float32, split=True, config=config) < 1e-5


@pytest.mark.parametrize(
    "block_size, tile_n",
    [(8, 64), (128, 32), (16, 16)],
    ids=["tile-spans-8-blocks", "block-spans-4-tiles", "tile-equals-block"],
)
def test_paged_decode_tile_independent_of_block_size(block_size, tile_n):
    torch.manual_seed(block_size)
    kv = PagedKV([3, 130, 257], block_size, 2, seed=block_size)
    assert run_decode(kv, 8, torch.float32, config=DecodeConfig(tile_n=tile_n)) < 1e-5


@pytest.mark.parametrize("head_dim", [128, 80], ids=["head128", "head80-padded"])
def test_paged_decode_other_head_sizes(head_dim):
    torch.manual_seed(head_dim)
    kv = PagedKV([1, 17, 100], 16, 2, head_dim=head_dim, seed=head_dim)
    config = DecodeConfig(split_tile_n=32, min_partition=32)
    assert run_decode(kv, 4, torch.float32, split=True, config=config) < 1e-5


def test_paged_decode_half_precision():
    torch.manual_seed(1)
    kv = PagedKV(LENGTHS, 16, 2, dtype=torch.float16, seed=1)
    assert run_decode(kv, 8, torch.float16) < 1e-2


def test_one_pass_half_precision_head_64_takes_the_wide_tile():
    """Head 64 in a 16-bit cache: the one-pass kernel's loop steps over 256 positions (the 300-token context
    is one full tile and a masked one); fp32, wider heads and the split kernel keep their tiles."""
    config = DecodeConfig()
    assert key_tile(config, False, 64, 2) == config.small_head_tile_n == 256
    assert key_tile(config, False, 64, 4) == config.tile_n == 128
    assert key_tile(config, False, 128, 2) == config.tile_n
    assert key_tile(config, True, 64, 2) == config.split_tile_n
    torch.manual_seed(2)
    kv = PagedKV(LENGTHS, 16, 2, dtype=torch.float16, seed=2)
    assert run_decode(kv, 8, torch.float16, split=False) < 1e-2


def test_split_k_fills_the_gpu_only_when_needed():
    config = DecodeConfig(
        split_below_programs_per_sm=1, programs_per_sm=2, min_partition=512, split_tile_n=128
    )
    cpu = torch.device("cpu")  # the interpreter's stand-in for an H100/H200: 132 SMs
    # 64 programs: 4 partitions, the most allowed
    assert choose_partition(8 * 8, 2048, cpu, config, None) == 512
    assert choose_partition(1 * 8, 8192, cpu, config, None) == 512  # 8 programs: 16 partitions
    # 32 programs: 8 partitions (wanted 9)
    assert choose_partition(4 * 8, 4096, cpu, config, None) == 512
    # 96 programs: 3 partitions of 22 tiles
    assert choose_partition(12 * 8, 8192, cpu, config, None) == 2816
    assert choose_partition(32 * 8, 8192, cpu, config, None) == 0  # 256 programs keep 132 SMs busy
    assert choose_partition(1 * 8, 300, cpu, config, None) == 0  # shorter than one partition
    # forced: at least two partitions
    assert choose_partition(128 * 8, 8192, cpu, config, True) == 4096
    assert choose_partition(1 * 8, 8192, cpu, config, False) == 0


def run_prefill(
    cases: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    config: PrefillConfig | None = None,
) -> float:
    """``cases``: (tokens already cached, chunk length) per sequence; the chunk's K/V are in the cache too."""
    kv = PagedKV(
        [cached + chunk for cached, chunk in cases],
        block_size,
        kv_heads,
        seed=heads + block_size,
        dtype=dtype,
    )
    chunks = [chunk for _, chunk in cases]
    cu = torch.tensor([0] + chunks, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(chunks), heads, HEAD_DIM).to(dtype)
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
    out = nan_like(query.shape, dtype)
    k, v = kv.poisoned()
    prefill_attention(
        out,
        query.to(DEVICE),
        k,
        v,
        kv.block_tables.to(DEVICE),
        cu.to(DEVICE),
        kv.context_lens.to(DEVICE),
        0.125,
        config=config,
    )
    return relative_error(out, ref)


# (cached, chunk): a plain prefill of a few hundred tokens, a prefix-cache hit, a chunk in the middle of a
# prompt, a one-token chunk, and a short plain prompt
MIXED_BATCH = [(0, 300), (32, 9), (48, 20), (16, 1), (0, 15)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 2)], ids=["mha", "gqa3", "gqa4"])
def test_prefill_with_cached_prefix_and_chunks_matches_reference(block_size, heads, kv_heads):
    torch.manual_seed(block_size + heads)
    assert run_prefill(MIXED_BATCH, heads, kv_heads, block_size) < 1e-5


def test_prefill_small_tiles_cover_every_boundary():
    """Tiles of 16 queries x 16 keys: many unmasked tiles, diagonals that start mid-tile, tiles past a chunk."""
    torch.manual_seed(3)
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    assert run_prefill([(0, 70), (100, 33), (5, 16)], 4, 2, 16, config=config) < 1e-5


def test_prefill_half_precision():
    torch.manual_seed(4)
    assert run_prefill(MIXED_BATCH, 8, 2, 16, dtype=torch.float16) < 1e-2


def test_store_kv_writes_slots_and_skips_padding():
    kv = PagedKV([40], 16, 2)
    # key and value as strided views, as the attention layer passes them
    fused = torch.randn(5, 3, 2, HEAD_DIM)
    key, value = fused[:, 0], fused[:, 2]
    slots = torch.tensor([5, -1, 40, 17, -1])
    expected_k, expected_v = kv.k_cache.clone(), kv.v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    k_cache, v_cache = kv.k_cache.to(DEVICE), kv.v_cache.to(DEVICE)
    store_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


def test_copy_blocks_copies_every_layer():
    k, v = torch.randn(3, 6, 16, 2, HEAD_DIM), torch.randn(3, 6, 16, 2, HEAD_DIM)
    mapping = torch.tensor([[1, 4], [2, 5], [0, 3]])
    expected_k, expected_v = k.clone(), v.clone()
    reference.copy_blocks(expected_k, expected_v, mapping)
    k, v = k.to(DEVICE), v.to(DEVICE)
    copy_blocks(k, v, mapping.to(DEVICE))
    assert torch.equal(k.cpu(), expected_k) and torch.equal(v.cpu(), expected_v)


def test_swap_blocks_moves_blocks_between_caches():
    device_cache = torch.randn(2, 5, 16, 2, HEAD_DIM, device=DEVICE)
    host_cache = torch.randn(2, 7, 16, 2, HEAD_DIM)
    mapping = torch.tensor([[4, 0], [1, 6]])
    expected = host_cache.clone()
    reference.swap_blocks(device_cache.cpu(), expected, mapping)
    swap_blocks(device_cache, host_cache, mapping)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host_cache, expected)
    back = torch.randn_like(device_cache)
    expected_back = back.cpu().clone()
    reference.swap_blocks(host_cache, expected_back, mapping.flip(1))
    swap_blocks(host_cache, back, mapping.flip(1))
    assert torch.equal(back.cpu(), expected_back)


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize(
    "pairs",
    [
        [(3, 0), (4, 1), (5, 2)],  # one run on both sides: one slice
        [
            (9, 4),
            (2, 5),
            (7, 6),
            (0, 1),
            (5, 2),
            (6, 3),
        ],  # scattered device ids, two runs of host ids
        [(1, 1), (8, 0)],  # descending host ids: sorted into one run
        # stored tail first (as evictions and swap-outs go): one run once sorted
        [(2, 6), (7, 5), (4, 4), (0, 3)],
    ],
)
def test_swap_blocks_batched_paths_match_reference(to_host, pairs):
    """The staged copy (gather, one slice per layer and host run, scatter) equals the reference in both
    directions; host ids are the second column going out and the first coming back."""
    gen = torch.Generator().manual_seed(len(pairs))
    device_cache = torch.randn(3, 10, 4, 2, 8, generator=gen)
    host_cache = torch.randn(3, 7, 4, 2, 8, generator=gen)
    mapping = torch.tensor(pairs)
    src, dst = (device_cache, host_cache) if to_host else (host_cache, device_cache)
    if not to_host:
        mapping = mapping.flip(1)
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)
    swap_blocks(src, dst, mapping, to_host=to_host)
    assert torch.equal(dst, expected)
