"""Attention over the KV cache: store this pass's K/V into their slots, then attend over each sequence's
block table (paged backend) or its contiguous request slot (vattention backend). Decode-shaped rows and
prefill chunks go to their own kernels."""
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, heads, head_dim]``, ``k``/``v`` ``[T, kv_heads, head_dim]`` -> ``[T, heads * head_dim]``."""
        meta = get_attention_metadata()
        if meta.slot_ids is None and lean_cpu(q):
            return self.forward_cpu(q, k, v, meta)
        kernel_ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if meta.slot_ids is not None:  # contiguous KV (vAttention): each sequence's slot, no block table
            if nd:
                kernel_ops.contiguous_decode_attention(out[:nd], q[:nd], self.k_cache, self.v_cache,
                                                       meta.slot_ids[:nd], meta.context_lens[:nd], self.scale,
                                                       meta.max_context_len)
            if nd < q.shape[0]:
                kernel_ops.contiguous_prefill_attention(out[nd:], q[nd:], self.k_cache, self.v_cache,
                                                        meta.slot_ids[nd:], meta.prefill_cu_seqlens_q,
                                                        meta.context_lens[nd:], self.scale)
            return out.view(q.shape[0], -1)
        if nd:
            kernel_ops.paged_attention(out[:nd], q[:nd], self.k_cache, self.v_cache,
                                    meta.block_tables[:nd], meta.context_lens[:nd], self.scale)
        if nd < q.shape[0]:
            kernel_ops.prefill_attention(out[nd:], q[nd:], self.k_cache, self.v_cache, meta.block_tables[nd:],
                                      meta.prefill_cu_seqlens_q, meta.context_lens[nd:], self.scale)
        return out.view(q.shape[0], -1)

    def forward_cpu(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
                     ) -> torch.Tensor:
        """The paged path on the CPU, with the per-pass slot, block and mask values computed by the first
        layer only (kernels/cpu.py)."""
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
