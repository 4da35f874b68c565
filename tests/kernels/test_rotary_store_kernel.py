"""``rotary_store_kv``: the rotary embedding and the KV store in one launch (kernels/rotary.py).

Its result must be the two launches it replaces, bit for bit: q and k rotated in place as ``rotary_embedding``
rotates them, and the cache holding what ``store_kv`` writes from the rotated k and from v (quantized alike in an
FP8 cache), padding slots (-1) untouched. Both sides run as Triton (the interpreter on a machine without CUDA);
the reference's composition is checked too. Inputs are random, the caches start as NaN so a slot the kernel
should not touch shows, and q/k/v are the strided split of one fused qkv output, as in the model.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from kernels import reference  # noqa: E402
from kernels.cache_ops import store_kv  # noqa: E402
from kernels.reference import FP8  # noqa: E402
from kernels.rotary import rotary_embedding, rotary_store_kv  # noqa: E402
from tests.interpreter_rounding import round_bfloat16_like_gpu  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
HEADS, KV_HEADS, MAX_POSITION = 6, 2, 300


@pytest.fixture(autouse=True)
def gpu_bfloat16_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE.type != "cuda":
        round_bfloat16_like_gpu(monkeypatch)


def split_qkv(tokens: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """One fused qkv output ``[T, (heads + 2 kv_heads) * head_dim]``, as the projection leaves it."""
    width = (HEADS + 2 * KV_HEADS) * head_dim
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, width, generator=gen) * 3).to(dtype).to(DEVICE)


def views(qkv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = qkv.split([HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], dim=-1)
    return (
        q.view(-1, HEADS, head_dim),
        k.view(-1, KV_HEADS, head_dim),
        v.view(-1, KV_HEADS, head_dim),
    )


def rotary_tables(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(MAX_POSITION, head_dim // 2, generator=torch.Generator().manual_seed(0))
    angles = torch.cat((angles, angles), dim=-1) * 40
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


def nan_caches(
    num_blocks: int, block_size: int, head_dim: int, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, KV_HEADS, head_dim)
    if cache_dtype == FP8:  # 0x7F is e4m3's NaN
        k = torch.full(shape, 0x7F, dtype=torch.uint8).view(FP8)
    else:
        k = torch.full(shape, float("nan"), dtype=cache_dtype)
    return k.to(DEVICE), k.clone().to(DEVICE)


def slots_for(tokens: int, num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """Distinct random slots, every third one padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1
    return slots.to(DEVICE)


def raw(cache: torch.Tensor) -> torch.Tensor:
    """The bytes (NaN compares equal to itself there)."""
    return cache.cpu().contiguous().view(torch.uint8)


CASES = [
    # dtype, cache dtype, head_dim, block_size (40: a vattention slot range's max_len)
    (torch.float32, torch.float32, 64, 16),
    (torch.bfloat16, torch.bfloat16, 128, 16),
    (torch.float16, torch.float16, 64, 40),
    (torch.bfloat16, FP8, 128, 16),
    (torch.float32, FP8, 64, 40),
]


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize(("dtype", "cache_dtype", "head_dim", "block_size"), CASES, ids=str)
def test_one_launch_equals_rotary_then_store_bit_for_bit(
    dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, block_size: int, tokens: int
) -> None:
    cos, sin = rotary_tables(head_dim, dtype)
    positions = torch.randint(
        0, MAX_POSITION, (tokens,), generator=torch.Generator().manual_seed(3)
    )
    positions = positions.to(DEVICE)
    slots = slots_for(tokens, 5, block_size, seed=tokens)
    k_scale, v_scale = (0.5, 2.0) if cache_dtype == FP8 else (1.0, 1.0)
    qkv = split_qkv(tokens, head_dim, dtype, seed=tokens + head_dim)
    two_qkv = qkv.clone()
    fused_caches = nan_caches(5, block_size, head_dim, cache_dtype)
    two_caches = nan_caches(5, block_size, head_dim, cache_dtype)

    q, k, v = views(qkv, head_dim)
    rotary_store_kv(positions, q, k, v, cos, sin, *fused_caches, slots, k_scale, v_scale)
    q2, k2, v2 = views(two_qkv, head_dim)
    rotary_embedding(positions, q2, k2, cos, sin)
    store_kv(k2, v2, *two_caches, slots, k_scale, v_scale)

    assert torch.equal(qkv.cpu(), two_qkv.cpu())  # q and k rotated alike, v untouched
    for fused, two in zip(fused_caches, two_caches):
        assert torch.equal(raw(fused), raw(two))
    # the stored slots hold numbers and every other slot is still NaN: nothing written at padding
    written = torch.zeros(5 * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    stored = fused_caches[0].cpu().float().view(5 * block_size, -1)
    assert not stored[written].isnan().any()
    assert stored[~written].isnan().all()


def norm_weights(head_dim: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's q and k norm weights: random, away from 1 so a skipped multiply shows."""
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.rand(2, head_dim, generator=gen) * 1.5 + 0.25).to(dtype).to(DEVICE))


@pytest.mark.parametrize("normed", [False, True], ids=["rotary", "qk-norm+rotary"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_launch_matches_the_reference_composition(dtype: torch.dtype, normed: bool) -> None:
    """The reference ``rotary_store_kv`` is (the q/k norm, then) ``rotary_embedding`` then ``store_kv``; the kernel
    follows it (to the kernels' tolerance in bfloat16, where the rounding order is the same and exp/sum are not
    involved; to 1e-5 in float32)."""
    head_dim, block_size, tokens = 64, 16, 9
    cos, sin = rotary_tables(head_dim, dtype)
    positions = torch.arange(tokens) * 31 % MAX_POSITION
    slots = slots_for(tokens, 4, block_size, seed=7)
    qkv = split_qkv(tokens, head_dim, dtype, seed=11)
    expected_qkv = qkv.cpu().clone()
    caches = nan_caches(4, block_size, head_dim, dtype)
    expected_caches = tuple(c.cpu().clone() for c in caches)
    weights = norm_weights(head_dim, dtype, seed=4) if normed else ()
    norm = (1.0, 1.0, *weights, 1e-5) if normed else ()

    rotary_store_kv(positions.to(DEVICE), *views(qkv, head_dim), cos, sin, *caches, slots, *norm)
    on_cpu = (cos.cpu(), sin.cpu(), *expected_caches, slots.cpu())
    on_cpu += tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in norm)
    reference.rotary_store_kv(positions, *views(expected_qkv, head_dim), *on_cpu)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(qkv.cpu(), expected_qkv, rtol=tol, atol=tol, equal_nan=True)
    for out, expected in zip(caches, expected_caches):
        torch.testing.assert_close(out.cpu(), expected, rtol=tol, atol=tol, equal_nan=True)


def small_call() -> tuple:
    """Arguments of a 2-token float32 ``rotary_store_kv`` up to the slots (head 64)."""
    cos, sin = rotary_tables(64, torch.float32)
    q, k, v = views(split_qkv(2, 64, torch.float32, seed=1), 64)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.long, device=DEVICE)
    return positions, q, k, v, cos, sin, *nan_caches(2, 16, 64, torch.float32), slots


def test_v_of_another_shape_is_refused() -> None:
    positions, q, k, v, *rest = small_call()
    with pytest.raises(ValueError, match="rotary_store_kv: v"):
        rotary_store_kv(positions, q, k, v[:, :1], *rest)


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.float32, 64), (torch.bfloat16, 128)], ids=str
)
def test_qk_norm_in_the_launch_equals_the_norm_launches_then_the_launch(
    dtype: torch.dtype, head_dim: int, tokens: int
) -> None:
    """Given the q/k norm weights, the launch norms each head of q and k before it rotates and stores, as
    kernels/rms_norm.py's launches would (its sum of squares adds the two halves: fp32 rounding apart)."""
    from kernels.rms_norm import rms_norm

    eps = 1e-6
    cos, sin = rotary_tables(head_dim, dtype)
    positions = torch.randint(
        0, MAX_POSITION, (tokens,), generator=torch.Generator().manual_seed(5)
    )
    positions = positions.to(DEVICE)
    slots = slots_for(tokens, 5, block_size=16, seed=tokens)
    q_weight, k_weight = norm_weights(head_dim, dtype, seed=head_dim)
    qkv = split_qkv(tokens, head_dim, dtype, seed=tokens + 3)
    unfused_qkv = qkv.clone()
    fused_caches = nan_caches(5, 16, head_dim, dtype)
    unfused_caches = nan_caches(5, 16, head_dim, dtype)

    normed = (1.0, 1.0, q_weight, k_weight, eps)
    rotary_store_kv(positions, *views(qkv, head_dim), cos, sin, *fused_caches, slots, *normed)
    q, k, v = views(unfused_qkv, head_dim)
    q.copy_(rms_norm(q, q_weight, eps))
    k.copy_(rms_norm(k, k_weight, eps))
    rotary_store_kv(positions, q, k, v, cos, sin, *unfused_caches, slots)

    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(qkv.cpu(), unfused_qkv.cpu(), **tol)
    for fused, unfused in zip(fused_caches, unfused_caches):
        torch.testing.assert_close(fused.cpu(), unfused.cpu(), equal_nan=True, **tol)
    # the norm did something: q and k differ from a launch without it
    plain_qkv = split_qkv(tokens, head_dim, dtype, seed=tokens + 3)
    plain_caches = nan_caches(5, 16, head_dim, dtype)
    rotary_store_kv(positions, *views(plain_qkv, head_dim), cos, sin, *plain_caches, slots)
    rotated = (HEADS + KV_HEADS) * head_dim
    assert not torch.allclose(
        qkv[:, :rotated].cpu(), plain_qkv[:, :rotated].cpu(), rtol=1e-2, atol=1e-2
    )


def test_qk_norm_needs_both_weights_in_qs_dtype() -> None:
    args = small_call()
    q_weight, k_weight = norm_weights(64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="go together"):
        rotary_store_kv(*args, 1.0, 1.0, q_weight, None)
    half = (q_weight.to(torch.bfloat16), k_weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="q's dtype"):
        rotary_store_kv(*args, 1.0, 1.0, *half)
