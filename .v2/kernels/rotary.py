"""Rotary position embedding applied in place (Triton), rotate-half (NeoX) layout.

Contract (that of ``reference.rotary_embedding``): ``q`` ``[T, heads, head_dim]`` and ``k``
``[T, kv_heads, head_dim]`` are overwritten with ``x * cos + rotate_half(x) * sin`` at their ``positions``.
They may be strided views (the split of the fused qkv output, row stride ``q_size + 2 * kv_size``): only the
last dim must be contiguous. One program per token rotates all its q and k heads, so cos/sin are read once
per token, and only their first half: the cache rows are ``cat(freqs, freqs)``.

Rounding follows torch's op order: each product, then the sum, rounded to the dtype of ``q * cos``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device_features import use_pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.specialization import per_step

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    cos,
    sin,
    dims,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = base_ptr + heads * stride_h + dims
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    # rotate_half(x) = cat(-x2, x1): out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin
    out1 = (x1 * cos).to(PRODUCT_DTYPE).to(tl.float32) + (-x2 * sin).to(PRODUCT_DTYPE).to(
        tl.float32
    )
    out2 = (x2 * cos).to(PRODUCT_DTYPE).to(tl.float32) + (x1 * sin).to(PRODUCT_DTYPE).to(tl.float32)
    element = base_ptr.dtype.element_ty
    tl.store(first, out1.to(PRODUCT_DTYPE).to(element), mask=mask)
    tl.store(first + HALF, out2.to(PRODUCT_DTYPE).to(element), mask=mask)


@triton.jit(**per_step("positions_ptr"))
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cos_ptr + position * stride_cos + dims, mask=dims < HALF).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_sin + dims, mask=dims < HALF).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt,
        stride_qh,
        cos,
        sin,
        dims,
        NUM_HEADS,
        HEADS_PAD,
        HALF,
        PRODUCT_DTYPE,
    )
    _rotate_heads(
        k_ptr + token * stride_kt,
        stride_kh,
        cos,
        sin,
        dims,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HALF,
        PRODUCT_DTYPE,
    )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Same contract as ``reference.rotary_embedding``: rotates ``q`` and ``k`` in place."""
    num_tokens, num_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(
            f"rotary_embedding: q {tuple(q.shape)} and k {tuple(k.shape)} need T and an even head_dim"
        )
    if (
        q.stride(-1) != 1
        or k.stride(-1) != 1
        or cos_cache.stride(-1) != 1
        or sin_cache.stride(-1) != 1
    ):
        raise ValueError(
            "rotary_embedding: q, k, cos_cache and sin_cache need a contiguous last dim"
        )
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_cache,
        sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=k.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        PRODUCT_DTYPE=_TL_DTYPE[torch.promote_types(q.dtype, cos_cache.dtype)],
        PDL=(pdl := use_pdl(q.device)),
        num_warps=4,
        launch_pdl=pdl,
    )
