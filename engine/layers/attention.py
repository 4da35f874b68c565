"""Attention over the KV cache: store this pass's K/V into their slots, then attend over each sequence's
block table (paged backend) or its contiguous request slot (vattention backend). Decode-shaped rows and
prefill chunks go to their own kernels.

An FP8 cache (``--kv-cache-dtype fp8``, float8 e4m3) is written as ``clamp(x / scale, -448, 448)`` in e4m3 and
read as ``stored * scale``, with this layer's ``k_scale`` and ``v_scale``: 1.0, vLLM's default without calibrated
scales, so K and V values beyond +-448 are clipped and the rest keep 3 mantissa bits (relative error <= 2^-4).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import cpu as cpu_kernels
from kernels import lean_cpu, ops as kernel_ops
from engine.worker.forward_context import AttentionMetadata, get_attention_metadata


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # this layer's KV, bound at start: [num_blocks, block_size, kv_heads, head_dim] (paged) or
        # [num_slots, max_len, kv_heads, head_dim] (vattention)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # an FP8 cache's per-layer scales (stored = x / scale, read = stored * scale); other caches ignore them
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def kv_fp8(self) -> bool:
        """Whether this layer's cache is FP8 (float8_e4m3fn)."""
        return self.k_cache.dtype == torch.float8_e4m3fn

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, heads, head_dim]``, ``k``/``v`` ``[T, kv_heads, head_dim]`` -> ``[T, heads * head_dim]``."""
        meta = get_attention_metadata()
        if meta.slot_ids is None and lean_cpu(q):
            return self.forward_cpu(q, k, v, meta)
        return self.forward_kernels(q, k, v, meta)

    def forward_kernels(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
                        ) -> torch.Tensor:
        """Through the kernel dispatch (kernels.ops): Triton on CUDA, the torch references on the CPU."""
        ks, vs = self.k_scale, self.v_scale
        kernel_ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, ks, vs)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if meta.slot_ids is not None:  # contiguous KV (vAttention): each sequence's slot, no block table
            if nd:
                kernel_ops.contiguous_decode_attention(out[:nd], q[:nd], self.k_cache, self.v_cache,
                                                       meta.slot_ids[:nd], meta.context_lens[:nd], self.scale,
                                                       meta.max_context_len, ks, vs)
            if nd < q.shape[0]:
                kernel_ops.contiguous_prefill_attention(out[nd:], q[nd:], self.k_cache, self.v_cache,
                                                        meta.slot_ids[nd:], meta.prefill_cu_seqlens_q,
                                                        meta.context_lens[nd:], self.scale, ks, vs)
            return out.view(q.shape[0], -1)
        if nd:
            kernel_ops.paged_attention(out[:nd], q[:nd], self.k_cache, self.v_cache,
                                       meta.block_tables[:nd], meta.context_lens[:nd], self.scale, ks, vs)
        if nd < q.shape[0]:
            kernel_ops.prefill_attention(out[nd:], q[nd:], self.k_cache, self.v_cache, meta.block_tables[nd:],
                                         meta.prefill_cu_seqlens_q, meta.context_lens[nd:], self.scale, ks, vs)
        return out.view(q.shape[0], -1)

    def forward_cpu(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
                     ) -> torch.Tensor:
        """The paged path on the CPU, with the per-pass slot, block and mask values computed by the first
        layer only (kernels/cpu.py). Those lean functions read float caches only: an FP8 cache goes through
        ``forward_kernels`` (the torch references, which quantize and dequantize) instead."""
        if self.kv_fp8:
            return self.forward_kernels(q, k, v, meta)
        memo = meta.memo
        if (store := memo.get("store")) is None:
            store = memo["store"] = cpu_kernels.store_plan(meta.slot_mapping)
        cpu_kernels.store_kv(k, v, self.k_cache, self.v_cache, store)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            if (plan := memo.get("decode")) is None:
                plan = memo["decode"] = cpu_kernels.decode_plan(meta.block_tables[:nd], meta.context_lens[:nd],
                                                                self.k_cache.shape[1])
            cpu_kernels.paged_decode_attention(out[:nd], q[:nd], self.k_cache, self.v_cache, plan, self.scale)
        if nd < q.shape[0]:
            kernel_ops.prefill_attention(out[nd:], q[nd:], self.k_cache, self.v_cache, meta.block_tables[nd:],
                                         meta.prefill_cu_seqlens_q, meta.context_lens[nd:], self.scale)
        return out.view(q.shape[0], -1)
