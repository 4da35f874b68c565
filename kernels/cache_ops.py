"""KV cache operations (Triton): write new K/V at their slots, copy blocks for copy-on-write, and swap
blocks between the device and a pinned host cache.

Layout (see kernels/reference.py): per layer ``[num_blocks, block_size, num_kv_heads, head_dim]``, and
``[num_layers, num_blocks, ...]`` for the whole cache; ``slot = block_id * block_size + offset``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.specialization import per_step


@triton.jit(**per_step("slot_ptr"))
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                     stride_vh, stride_block, stride_token, stride_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One program per token: copies its ``[kv_heads, head_dim]`` K and V rows into slot ``slot_mapping[t]``."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1 marks padding (e.g. CUDA-graph batch padding): nothing to write
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, HEAD_PAD)[None, :]
        mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
        dst = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_token + heads * stride_head + dims
        key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        tl.store(k_cache_ptr + dst, key, mask=mask)
        value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(v_cache_ptr + dst, value, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Same contract as ``reference.store_kv``; padding slots (-1) are skipped on the device, no host check."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "K and V: same layout, dim contiguous"
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], num_warps=4)


@triton.jit
def _copy_blocks_kernel(k_ptr, v_ptr, mapping_ptr, stride_layer, stride_block, BLOCK_NUMEL: tl.constexpr,
                        CHUNK: tl.constexpr):
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


def copy_blocks(k_caches: torch.Tensor, v_caches: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Same contract as ``reference.copy_blocks`` for copy-on-write, where no destination block is also a
    source (fresh blocks): pairs run in parallel, so a chain src -> dst -> dst2 would race."""
    if block_mapping.shape[0] == 0:
        return
    block_numel = k_caches[0, 0].numel()
    blocks_contiguous = k_caches[0, 0].is_contiguous() and k_caches.stride(1) >= block_numel
    if not blocks_contiguous or k_caches.stride() != v_caches.stride():
        reference.copy_blocks(k_caches, v_caches, block_mapping)  # odd layouts: correctness over speed
        return
    mapping = block_mapping.to(device=k_caches.device, dtype=torch.int64).contiguous()
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (mapping.shape[0], k_caches.shape[0], triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](k_caches, v_caches, mapping, k_caches.stride(0), k_caches.stride(1),
                              BLOCK_NUMEL=block_numel, CHUNK=chunk, num_warps=4)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Same contract as ``reference.swap_blocks``: copies block ``(src_id, dst_id)`` pairs of every layer
    between a device cache and a host cache (``[num_layers, num_blocks, ...]`` each).

    No Triton here: a block of one layer is one contiguous run of bytes on both sides, so each is a single
    asynchronous ``copy_`` (a DMA transfer when the host side is pinned; a sync copy when it is not). The pair
    list is read on the host: pass ``block_mapping`` as a CPU tensor (the scheduler's decision lives there);
    a device tensor costs one sync to read it. The copies are ordered on the current stream like any kernel
    (so freeing and reusing swapped-out device blocks is safe); synchronize before the CPU itself reads a
    host cache that was just written.
    """
    pairs = block_mapping.tolist()
    for layer in range(src.shape[0]):
        for src_id, dst_id in pairs:
            dst[layer, dst_id].copy_(src[layer, src_id], non_blocking=True)
