"""An FP8 KV cache (float8 e4m3, ``--kv-cache-dtype fp8``) in the kernels: ``store_kv`` writes
``clamp(x / scale, -448, 448)`` rounded to the nearest e4m3 value (ties to even), attention reads
``stored * scale``, and block copies move the bytes unchanged.

The expected bytes come from an e4m3 table decoded here from the format (sign, 4 exponent bits of bias 7,
3 mantissa bits; exponent 0 subnormal; S.1111.111 NaN), never from torch's conversion; attention is checked in
float64 on caches de-quantized by hand. The Triton kernels run in the interpreter without CUDA (small shapes),
on caches whose slots outside every sequence hold NaN; scales other than 1.0 are used throughout. Half-precision
queries are float16 here: the interpreter cannot run bfloat16 dots (tests/gpu/test_kv_fp8_gpu.py runs bfloat16).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

pytest.importorskip("triton", reason="triton is not installed")

from kernels import reference  # noqa: E402
from kernels.cache_ops import copy_blocks, store_kv, swap_blocks  # noqa: E402
from kernels.contiguous_attention import contiguous_decode_attention, contiguous_prefill_attention  # noqa: E402
from kernels.paged_attention import DecodeConfig, paged_attention  # noqa: E402
from kernels.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402
from tests.kernels.test_triton_kernels import PagedKV, relative_error  # noqa: E402

FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
HEAD_DIM = 32
K_SCALE, V_SCALE = 0.37, 2.5  # below and above 1.0, neither a power of two
# the 150-token context: 3 partitions
DECODE_CONFIG = DecodeConfig(tile_n=32, split_tile_n=32, min_partition=64)
PREFILL_CONFIG = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, values) of the non-negative finite e4m3 numbers, by value: exponent e and mantissa m give
    (1 + m/8) 2^(e-7), or (m/8) 2^-6 for e = 0; code 0x7F (e = 15, m = 7) is NaN."""
    codes, values = [], []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        codes.append(code)
        values.append((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(codes, dtype=torch.uint8), torch.tensor(values, dtype=torch.float64)


def expected_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The e4m3 byte of each ``clamp(x / scale, -448, 448)``: the nearest value, the even code on a tie."""
    codes, values = e4m3_table()
    y = (x.float() / scale).double().clamp(-448, 448).reshape(-1)
    distance = (y.abs()[:, None] - values[None, :]).abs()
    # the smallest distance; among equal ones the even code (codes are in ascending order of value)
    best = (distance - distance.min(dim=1, keepdim=True).values == 0) & (codes[None, :] % 2 == 0)
    nearest = torch.where(best.any(dim=1), best.float().argmax(dim=1), distance.argmin(dim=1))
    sign = torch.where(y < 0, 0x80, 0).to(torch.uint8)
    return (codes[nearest] | sign).reshape(x.shape)


def spread_values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values from 1e-4 to 1e3 (subnormal, normal and clipped e4m3 after any scale here), with exact
    midpoints between e4m3 neighbours (x 0.5: ties survive the division) at the start."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-4, 3, shape[0])[:, None, None]
    _, values = e4m3_table()
    midpoints = ((values[1:] + values[:-1]) / 2 * 0.5).float()
    x.view(-1)[: 2 * len(midpoints)] = torch.cat((midpoints, -midpoints))
    return x


@pytest.mark.parametrize("store", [reference.store_kv, store_kv], ids=["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_rounds_to_the_nearest_e4m3_value_ties_to_even(store, dtype):
    key, value = (
        spread_values((64, 2, HEAD_DIM), 0).to(dtype),
        spread_values((64, 2, HEAD_DIM), 1).to(dtype),
    )
    slots = torch.randperm(100, generator=torch.Generator().manual_seed(2))[:64]
    slots[::7] = -1  # padding rows: nothing written
    k_cache = torch.randn(7, 16, 2, HEAD_DIM).to(FP8)  # stale data, never zeros
    v_cache = torch.randn(7, 16, 2, HEAD_DIM).to(FP8)
    expected_k, expected_v = k_cache.view(torch.uint8).clone(), v_cache.view(torch.uint8).clone()
    real = slots >= 0
    expected_k.view(-1, 2, HEAD_DIM)[slots[real]] = expected_codes(key[real], 0.5)
    expected_v.view(-1, 2, HEAD_DIM)[slots[real]] = expected_codes(value[real], 2.0)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    store(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), 0.5, 2.0)
    assert torch.equal(k_cache.cpu().view(torch.uint8), expected_k)
    assert torch.equal(v_cache.cpu().view(torch.uint8), expected_v)


@pytest.mark.parametrize("store", [reference.store_kv, store_kv], ids=["reference", "triton"])
def test_store_then_read_is_within_e4m3_rounding(store):
    """Read back as ``stored * scale``: within 2^-4 relative (3 mantissa bits, half a step) where x / scale is
    a normal e4m3 number, within half a subnormal step (2^-10 scale) below 2^-6, and clipped at +-448 scale."""
    x = spread_values((40, 2, HEAD_DIM), 3)
    cache = torch.zeros(3, 16, 2, HEAD_DIM, dtype=FP8, device=DEVICE)
    spare = torch.zeros_like(cache)
    store(x.to(DEVICE), x.to(DEVICE), cache, spare, torch.arange(40, device=DEVICE), K_SCALE, 1.0)
    read = cache.cpu().view(-1, 2, HEAD_DIM)[:40].double() * K_SCALE
    y = x.double() / K_SCALE
    normal = (y.abs() >= 2.0**-6) & (y.abs() <= 448)
    assert (
        bool(normal.any())
        and bool((~normal & (y.abs() < 2.0**-6)).any())
        and bool((y.abs() > 448).any())
    )
    error = (read - x.double()).abs()
    assert bool((error[normal] <= 2.0**-4 * x.double().abs()[normal] * (1 + 1e-6)).all())
    assert bool((error[y.abs() < 2.0**-6] <= 2.0**-10 * K_SCALE * (1 + 1e-6)).all())
    clipped = y.abs() > 448
    assert torch.equal(read[clipped], (448 * K_SCALE * torch.sign(x.double()))[clipped])


def fp8_cache(kv: PagedKV) -> PagedKV:
    """``kv`` with its caches in e4m3 (random values of a few units: normal e4m3 numbers, never zeros)."""
    kv.k_cache, kv.v_cache = (kv.k_cache * 4).to(FP8), (kv.v_cache * 4).to(FP8)
    return kv


def poisoned(kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 caches with every slot outside the sequences NaN (byte 0x7F), on the test device."""
    k, v = kv.k_cache.view(torch.uint8).clone(), kv.v_cache.view(torch.uint8).clone()
    for cache in (k, v):
        cache.view(-1, *cache.shape[2:])[kv.unused_slots] = 0x7F
    return k.view(FP8).to(DEVICE), v.view(FP8).to(DEVICE)


def dequantized(kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as attention must read them, in float64: stored value times scale."""
    return kv.k_cache.double() * K_SCALE, kv.v_cache.double() * V_SCALE


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-k"])
@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 1e-2)], ids=["fp32", "fp16"]
)
def test_paged_decode_reads_fp8_times_scale(split, dtype, tolerance):
    kv = fp8_cache(PagedKV([1, 17, 150], 16, 2, head_dim=HEAD_DIM, seed=5))
    query = torch.randn(3, 6, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    expected = torch.empty(query.shape, dtype=torch.float64)
    reference.paged_attention(
        expected, query.double(), *dequantized(kv), kv.block_tables, kv.context_lens, 0.2
    )
    ref_fp8 = torch.empty(query.shape, dtype=torch.float64)  # the reference's own FP8 path
    reference.paged_attention(
        ref_fp8,
        query.double(),
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        kv.context_lens,
        0.2,
        K_SCALE,
        V_SCALE,
    )
    assert relative_error(ref_fp8, expected) < 1e-6
    out = torch.full(query.shape, float("nan"), dtype=dtype, device=DEVICE)
    k, v = poisoned(kv)
    paged_attention(
        out,
        query.to(dtype).to(DEVICE),
        k,
        v,
        kv.block_tables.to(DEVICE),
        kv.context_lens.to(DEVICE),
        0.2,
        K_SCALE,
        V_SCALE,
        split=split,
        config=DECODE_CONFIG,
    )
    assert relative_error(out, expected) < tolerance


@pytest.mark.parametrize(
    "dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 1e-2)], ids=["fp32", "fp16"]
)
def test_prefill_with_cached_prefix_reads_fp8_times_scale(dtype, tolerance):
    # (cached, chunk): a plain prompt, a prefix hit, a one-token chunk
    cases = [(0, 40), (32, 9), (16, 1)]
    kv = fp8_cache(
        PagedKV([cached + chunk for cached, chunk in cases], 16, 2, head_dim=HEAD_DIM, seed=7)
    )
    cu = torch.tensor([0] + [chunk for _, chunk in cases]).cumsum(0).to(torch.int32)
    query = torch.randn(int(cu[-1]), 4, HEAD_DIM, generator=torch.Generator().manual_seed(8))
    expected = torch.empty(query.shape, dtype=torch.float64)
    reference.prefill_attention(
        expected, query.double(), *dequantized(kv), kv.block_tables, cu, kv.context_lens, 0.2
    )
    ref_fp8 = torch.empty(query.shape, dtype=torch.float64)
    reference.prefill_attention(
        ref_fp8,
        query.double(),
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        cu,
        kv.context_lens,
        0.2,
        K_SCALE,
        V_SCALE,
    )
    assert relative_error(ref_fp8, expected) < 1e-6
    out = torch.full(query.shape, float("nan"), dtype=dtype, device=DEVICE)
    k, v = poisoned(kv)
    prefill_attention(
        out,
        query.to(dtype).to(DEVICE),
        k,
        v,
        kv.block_tables.to(DEVICE),
        cu.to(DEVICE),
        kv.context_lens.to(DEVICE),
        0.2,
        K_SCALE,
        V_SCALE,
        config=PREFILL_CONFIG,
    )
    assert relative_error(out, expected) < tolerance


def test_contiguous_decode_and_prefill_read_fp8_times_scale():
    """The vAttention layout ``[slots, max_len, kv_heads, d]``: split-K decode and a prefill after a prefix."""
    gen = torch.Generator().manual_seed(9)
    k_slots, v_slots = (
        (torch.randn(5, 160, 2, HEAD_DIM, generator=gen) * 4).to(FP8) for _ in range(2)
    )
    slot_ids = torch.tensor([3, 0], dtype=torch.int32)
    lens = torch.tensor([150, 20], dtype=torch.int32)
    poisoned_k, poisoned_v = k_slots.clone(), v_slots.clone()
    for slot, n in zip(slot_ids.tolist(), lens.tolist()):
        poisoned_k[slot, n:] = float("nan")
        poisoned_v[slot, n:] = float("nan")
    poisoned_k, poisoned_v = poisoned_k.to(DEVICE), poisoned_v.to(DEVICE)
    clean = (k_slots.double() * K_SCALE, v_slots.double() * V_SCALE)
    query = torch.randn(2, 4, HEAD_DIM, generator=gen)
    expected = torch.empty(query.shape, dtype=torch.float64)
    reference.contiguous_decode_attention(
        expected, query.double(), *clean, slot_ids, lens, 0.2, 150
    )
    out = torch.full(query.shape, float("nan"), device=DEVICE)
    contiguous_decode_attention(
        out,
        query.to(DEVICE),
        poisoned_k,
        poisoned_v,
        slot_ids.to(DEVICE),
        lens.to(DEVICE),
        0.2,
        150,
        K_SCALE,
        V_SCALE,
        split=True,
        config=DECODE_CONFIG,
    )
    assert relative_error(out, expected) < 1e-5
    # 12 new tokens after 138 cached, then a whole prompt
    cu = torch.tensor([0, 12, 32], dtype=torch.int32)
    query = torch.randn(32, 4, HEAD_DIM, generator=gen)
    expected = torch.empty(query.shape, dtype=torch.float64)
    reference.contiguous_prefill_attention(
        expected, query.double(), *clean, slot_ids, cu, lens, 0.2
    )
    out = torch.full(query.shape, float("nan"), device=DEVICE)
    contiguous_prefill_attention(
        out,
        query.to(DEVICE),
        poisoned_k,
        poisoned_v,
        slot_ids.to(DEVICE),
        cu.to(DEVICE),
        lens.to(DEVICE),
        0.2,
        K_SCALE,
        V_SCALE,
        config=PREFILL_CONFIG,
    )
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("ops", [reference, None], ids=["reference", "triton"])
def test_copy_and_swap_move_fp8_blocks_byte_for_byte(ops):
    copy, swap = (ops.copy_blocks, ops.swap_blocks) if ops else (copy_blocks, swap_blocks)
    gen = torch.Generator().manual_seed(10)
    k, v = ((torch.randn(2, 6, 4, 2, 8, generator=gen) * 4).to(FP8) for _ in range(2))
    host = (torch.randn(2, 5, 4, 2, 8, generator=gen) * 4).to(FP8)
    before_k, before_v, before_host = (t.view(torch.uint8).clone() for t in (k, v, host))
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for src, dst in ((1, 4), (2, 5)):
        expected_k[:, dst], expected_v[:, dst] = before_k[:, src], before_v[:, src]
    expected_host = before_host.clone()
    # swapped out after the copies: block 4 holds block 1's bytes
    for src, dst in ((4, 0), (0, 3), (5, 1)):
        expected_host[:, dst] = expected_k[:, src]
    k, v = k.to(DEVICE), v.to(DEVICE)
    copy(k, v, torch.tensor([[1, 4], [2, 5]], device=DEVICE))
    assert torch.equal(k.cpu().view(torch.uint8), expected_k) and torch.equal(
        v.cpu().view(torch.uint8), expected_v
    )
    swap(k, host, torch.tensor([[4, 0], [0, 3], [5, 1]]))
    assert torch.equal(host.view(torch.uint8), expected_host)
    back = torch.zeros_like(k)
    swap(host, back, torch.tensor([[0, 2], [1, 0], [3, 5]]))  # and in again, to other blocks
    for src, dst in ((0, 2), (1, 0), (3, 5)):
        assert torch.equal(back.cpu().view(torch.uint8)[:, dst], expected_host[:, src])
