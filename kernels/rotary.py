"""Rotary position embedding applied in place (Triton), rotate-half (NeoX) layout, alone or fused with the
KV store that follows it.

Contract (that of ``reference.rotary_embedding``): ``q`` ``[T, heads, head_dim]`` and ``k``
``[T, kv_heads, head_dim]`` are overwritten with ``x * cos + rotate_half(x) * sin`` at their ``positions``.
They may be strided views (the split of the fused qkv output, row stride ``q_size + 2 * kv_size``): only the
last dim must be contiguous. One program per token rotates all its q and k heads, so cos/sin are read once
per token, and only their first half: the cache rows are ``cat(freqs, freqs)``.

Rounding follows torch's op order: each product, then the sum, rounded to the dtype of ``q * cos``.

``rotary_store_kv`` (contract of ``reference.rotary_store_kv``) also writes the rotated K and the V rows into the
cache at each token's slot, as ``store_kv`` would: one launch instead of two per layer (measured on an H100,
llama-3.2-1b: 154 -> 138 kernels a decode step, 0.5% of the 1-stream step, 1.5% at 16 streams). Given Qwen3's
q/k norm weights it RMS-norms each q and k head first, in the same program: the two norm launches a layer it
replaces are launch-bound at decode sizes (~3.75 us each at 256 rows on an H200, 56 a qwen3-0.6b step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.cache_ops import quantize_e4m3
from kernels.device_features import use_pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.reference import FP8
from kernels.specialization import per_step

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _norm_halves(x1, x2, weight_ptr, eps, dims, HALF: tl.constexpr, element: tl.constexpr):
    """One head's RMSNorm (Qwen3's q/k norm) over its two halves, rounded as ``kernels/rms_norm.py`` rounds:
    the normed value to the input dtype, then times the weight, rounded again."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(weight_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    x1 = (w1 * (x1 * rstd[:, None]).to(element).to(tl.float32)).to(element).to(tl.float32)
    x2 = (w2 * (x2 * rstd[:, None]).to(element).to(tl.float32)).to(element).to(tl.float32)
    return x1, x2


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    cos,
    sin,
    dims,
    norm_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
    NORM: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = base_ptr + heads * stride_h + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _norm_halves(x1, x2, norm_ptr, eps, dims, HALF, base_ptr.dtype.element_ty)
    # rotate_half(x) = cat(-x2, x1): out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin
    out1 = (x1 * cos).to(PRODUCT_DTYPE).to(tl.float32) + (-x2 * sin).to(PRODUCT_DTYPE).to(
        tl.float32
    )
    out2 = (x2 * cos).to(PRODUCT_DTYPE).to(tl.float32) + (x1 * sin).to(PRODUCT_DTYPE).to(tl.float32)
    element = base_ptr.dtype.element_ty
    out1 = out1.to(PRODUCT_DTYPE).to(element)
    out2 = out2.to(PRODUCT_DTYPE).to(element)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _store_halves(cache_ptr, first, second, mask, scale, HALF: tl.constexpr, KV_FP8: tl.constexpr):
    """Write one token's rows, given as their two halves, at ``cache_ptr`` (the slot's first element + the
    heads' and dims' offsets); quantized with ``scale`` in an FP8 cache, as ``store_kv`` does."""
    if KV_FP8:
        first = quantize_e4m3(first, scale)
        second = quantize_e4m3(second, scale)
    element = cache_ptr.dtype.element_ty
    tl.store(cache_ptr, first.to(element), mask=mask)
    tl.store(cache_ptr + HALF, second.to(element), mask=mask)


@triton.jit(**per_step("positions_ptr", "slot_ptr"))
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
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_vt,
    stride_vh,
    stride_block,
    stride_token,
    stride_head,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: rotates its q and k heads in place (with NORM: RMS-normed per head first); with
    STORE also writes the rotated k and its v into slot ``slot_ptr[token]`` of the caches (slot -1, padding:
    nothing)."""
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
        q_norm_ptr,
        eps,
        NUM_HEADS,
        HEADS_PAD,
        HALF,
        PRODUCT_DTYPE,
        NORM,
    )
    k1, k2 = _rotate_heads(
        k_ptr + token * stride_kt,
        stride_kh,
        cos,
        sin,
        dims,
        k_norm_ptr,
        eps,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HALF,
        PRODUCT_DTYPE,
        NORM,
    )
    if STORE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            heads = tl.arange(0, KV_HEADS_PAD)[:, None]
            mask = (heads < NUM_KV_HEADS) & (dims < HALF)
            at = (
                (slot // BLOCK_SIZE) * stride_block
                + (slot % BLOCK_SIZE) * stride_token
                + heads * stride_head
                + dims
            )
            _store_halves(k_cache_ptr + at, k1, k2, mask, k_scale, HALF, KV_FP8)
            v_row = v_ptr + token * stride_vt + heads * stride_vh + dims
            v1 = tl.load(v_row, mask=mask)
            v2 = tl.load(v_row + HALF, mask=mask)
            _store_halves(v_cache_ptr + at, v1, v2, mask, v_scale, HALF, KV_FP8)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Same contract as ``reference.rotary_embedding``: rotates ``q`` and ``k`` in place."""
    _launch(positions, q, k, cos_cache, sin_cache, None)


def rotary_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """Same contract as ``reference.rotary_store_kv``: (the q/k norm, then) ``rotary_embedding``, then
    ``store_kv`` of the rotated ``k`` and of ``v``, in one launch."""
    if v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(
            f"rotary_store_kv: v {tuple(v.shape)} needs k's shape {tuple(k.shape)} and a contiguous last dim"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("rotary_store_kv: K and V caches need one layout with head_dim contiguous")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rotary_store_kv: q_norm and k_norm go together")
    if q_norm is not None and (
        q_norm.shape != (q.shape[-1],)
        or k_norm.shape != (q.shape[-1],)
        or q_norm.dtype != q.dtype
        or k_norm.dtype != q.dtype
    ):
        raise ValueError(
            "rotary_store_kv: q_norm and k_norm need shape [head_dim] and q's dtype (normed in place)"
        )
    _launch(
        positions,
        q,
        k,
        cos_cache,
        sin_cache,
        (v, k_cache, v_cache, slot_mapping, k_scale, v_scale),
        (q_norm, k_norm, eps) if q_norm is not None else None,
    )


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    store: tuple | None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
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
    # without a store, k stands in for the store's tensors (never read: STORE is off)
    v, k_cache, v_cache, slots, k_scale, v_scale = store or (k, k, k, positions, 1.0, 1.0)
    q_norm, k_norm, eps = norm or (q, k, 0.0)  # (never read without NORM)
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
        v,
        k_cache,
        v_cache,
        slots,
        k_scale,
        v_scale,
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        q_norm,
        k_norm,
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=k.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        PRODUCT_DTYPE=_TL_DTYPE[torch.promote_types(q.dtype, cos_cache.dtype)],
        STORE=store is not None,
        BLOCK_SIZE=k_cache.shape[1] if store is not None else 1,
        KV_FP8=k_cache.dtype == FP8,
        NORM=norm is not None,
        PDL=(pdl := use_pdl(q.device)),
        num_warps=4,
        launch_pdl=pdl,
    )
