"""KV cache operations (Triton): write new K/V at their slots, copy blocks for copy-on-write, and swap
blocks between the device and a pinned host cache.

Layout (see kernels/reference.py): per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``, and
``[num_layers, num_blocks, ...]`` for the whole cache; ``slot = block_id * block_size + offset``. An FP8 cache
(float8_e4m3fn) is written quantized (``quantize_e4m3``) and copied and swapped as bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.device_features import use_pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.reference import FP8, as_bytes
from kernels.specialization import per_step


@triton.jit
def quantize_e4m3(x, scale):
    """``clamp(x / scale, -448, 448)`` rounded to the nearest e4m3 value, ties to even (torch's rounding), as
    float32: the rounding is done here in float32 arithmetic, so that the cast to float8 that follows is exact
    everywhere (Triton's interpreter truncates in its own fp32 -> fp8 cast). Normal range (|x| >= 2^-6): round
    the float32 bits to 3 mantissa bits. Below it e4m3 is subnormal, multiples of 2^-9: ``(|x| + 2^14) - 2^14``
    rounds there, float32's spacing at 2^14 being 2^-9."""
    x = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # (the sign goes on as a bit: a negation compiles to 0 - x on the GPU, which loses the sign of a zero, where
    # torch's conversion gives -0 for a negative value that rounds to zero)
    magnitude = ((tl.abs(x) + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)
    subnormal = (magnitude | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit(**per_step("slot_ptr"))
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_block,
    stride_token,
    stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: copies its ``[kv_heads, head_dim]`` K and V rows into slot ``slot_mapping[t]``
    (KV_FP8: quantized with ``k_scale`` / ``v_scale``)."""
    wait_for_previous(PDL)
    release_next(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1 marks padding (e.g. CUDA-graph batch padding): nothing to write
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_PAD)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        dst = (
            (slot // BLOCK_SIZE) * stride_block
            + (slot % BLOCK_SIZE) * stride_token
            + heads * stride_head
            + dims
        )
        key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        if KV_FP8:
            key = quantize_e4m3(key, k_scale).to(k_cache_ptr.dtype.element_ty)
            value = quantize_e4m3(value, v_scale).to(v_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + dst, key, mask=mask)
        tl.store(v_cache_ptr + dst, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Same contract as ``reference.store_kv``; padding slots (-1) are skipped on the device, no host check."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, (
        "K and V: same layout, dim contiguous"
    )
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        KV_FP8=k_cache.dtype == FP8,
        PDL=(pdl := use_pdl(key.device)),
        num_warps=4,
        launch_pdl=pdl,
    )


@triton.jit
def _copy_blocks_kernel(
    k_ptr,
    v_ptr,
    mapping_ptr,
    stride_layer,
    stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program (pair, layer, chunk): copies CHUNK elements of block ``src`` into block ``dst`` in K and V."""
    pair, layer, chunk = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    src_offs = layer * stride_layer + src * stride_block + offs
    dst_offs = layer * stride_layer + dst * stride_block + offs
    tl.store(k_ptr + dst_offs, tl.load(k_ptr + src_offs, mask=mask), mask=mask)
    tl.store(v_ptr + dst_offs, tl.load(v_ptr + src_offs, mask=mask), mask=mask)


def copy_blocks(
    k_caches: torch.Tensor, v_caches: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Same contract as ``reference.copy_blocks`` for copy-on-write, where no destination block is also a
    source (fresh blocks): pairs run in parallel, so a chain src -> dst -> dst2 would race."""
    if block_mapping.shape[0] == 0:
        return
    k_caches, v_caches = as_bytes(k_caches), as_bytes(v_caches)
    block_numel = k_caches[0, 0].numel()
    blocks_contiguous = k_caches[0, 0].is_contiguous() and k_caches.stride(1) >= block_numel
    if not blocks_contiguous or k_caches.stride() != v_caches.stride():
        # odd layouts: correctness over speed
        reference.copy_blocks(k_caches, v_caches, block_mapping)
        return
    mapping = block_mapping.to(device=k_caches.device, dtype=torch.int64).contiguous()
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (mapping.shape[0], k_caches.shape[0], triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        k_caches,
        v_caches,
        mapping,
        k_caches.stride(0),
        k_caches.stride(1),
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        num_warps=4,
    )


def swap_blocks(
    src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor, to_host: bool | None = None
) -> None:
    """Same contract as ``reference.swap_blocks``: copies block ``(src_id, dst_id)`` pairs of every layer
    between a device cache and a host cache (``[num_layers, num_blocks, ...]`` each).

    No Triton here (a kernel cannot address the host side): the copies are batched around the host link. Of
    the pairs, runs where both ids climb by one move as one slice per layer. The rest is gathered on the side
    that has the device (one index kernel into a contiguous staging tensor ``[num_layers, n, ...]``), and the
    staging tensor crosses the link as one slice per layer for each run of consecutive host ids (pairs are
    taken in host-id order, and the host pools hand out consecutive slots, so a sequence's blocks form few
    runs); a copy to the device ends with one scatter kernel. That is ``num_layers x runs`` transfers (DMA when the host side is pinned) and at most one
    kernel, where one copy per layer and block cost ``num_layers x n`` launches. The pair list is read on the
    host: pass ``block_mapping`` as a CPU tensor. Everything is ordered on the current stream like any kernel
    (freeing and reusing swapped-out device blocks is safe, and the staging tensor's memory is reused only by
    later work of the same stream); synchronize before the CPU itself reads a host cache just written.
    ``to_host`` names the direction where both caches are on the CPU (tests); by default it is ``dst`` on the
    CPU and ``src`` not.
    """
    pairs = block_mapping.tolist()
    if not pairs:
        return
    src, dst = as_bytes(src), as_bytes(dst)  # (float8 lacks index_copy_ on the CPU)
    if to_host is None:
        to_host = dst.device.type == "cpu" and src.device.type != "cpu"
    device_side = src if to_host else dst
    # the pairs are independent (each writes its own block), so they go in host-id order: a sequence's or a
    # prefix's blocks, stored tail first, then form one ascending run of host slots
    pairs.sort(key=lambda pair: pair[1] if to_host else pair[0])
    host_ids = [d for _, d in pairs] if to_host else [s for s, _ in pairs]
    if len(_runs(pairs, both=True)) == 1:
        s0, d0 = pairs[0]
        dst[:, d0 : d0 + len(pairs)].copy_(src[:, s0 : s0 + len(pairs)], non_blocking=True)
        return
    device_ids = torch.tensor(
        [s for s, _ in pairs] if to_host else [d for _, d in pairs], dtype=torch.int64
    ).to(device_side.device, non_blocking=True)
    if to_host:
        staging = src.index_select(1, device_ids)
        for begin, end in _runs([(h, h) for h in host_ids], both=False):
            h0 = host_ids[begin]
            for layer in range(src.shape[0]):
                dst[layer, h0 : h0 + end - begin].copy_(
                    staging[layer, begin:end], non_blocking=True
                )
    else:
        staging = torch.empty(
            (dst.shape[0], len(pairs), *dst.shape[2:]), dtype=dst.dtype, device=dst.device
        )
        for begin, end in _runs([(h, h) for h in host_ids], both=False):
            h0 = host_ids[begin]
            for layer in range(dst.shape[0]):
                staging[layer, begin:end].copy_(
                    src[layer, h0 : h0 + end - begin], non_blocking=True
                )
        dst.index_copy_(1, device_ids, staging)


def _runs(pairs: list[tuple[int, int]], both: bool) -> list[tuple[int, int]]:
    """Maximal index ranges ``[begin, end)`` of ``pairs`` whose first ids (and with ``both`` second ids too)
    climb by one from each pair to the next."""
    runs, begin = [], 0
    for i in range(1, len(pairs)):
        (s0, d0), (s1, d1) = pairs[i - 1], pairs[i]
        if s1 != s0 + 1 or (both and d1 != d0 + 1):
            runs.append((begin, i))
            begin = i
    runs.append((begin, len(pairs)))
    return runs
