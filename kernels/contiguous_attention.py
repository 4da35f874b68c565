"""Decode and prefill attention over a *contiguous* per-slot KV cache (Triton), for a vAttention backend.

vAttention keeps each request's KV contiguous in virtual memory (physical pages are mapped under it on
demand), so attention needs no block table: a request owns a slot, and its position ``p`` sits at
``k_slots[slot, p]``. Layout: K and V are ``[num_slots, max_len, num_kv_heads, head_dim]`` (same strides,
head dim contiguous; any other stride is read from the tensor); ``slot_ids[b]`` is sequence b's slot, and

    address(b, p, kv_head, dim) = slot_ids[b] * stride(0) + p * stride(1) + kv_head * stride(2) + dim

computed in int64 (one slot's start can pass 2^31 elements). These are the paged kernels themselves
(paged_attention.py, prefill_attention.py) compiled with ``CONTIGUOUS=True``: the slot id is passed as the
sequence's one-entry "block table", so grid, tiling, split-K and causal alignment are the same code.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import DecodeConfig, launch_decode
from kernels.prefill_attention import PrefillConfig, launch_prefill


def contiguous_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slot_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    order: torch.Tensor | None = None,
    *,
    split: bool | None = None,
    config: DecodeConfig | None = None,
) -> None:
    """Same contract as ``reference.contiguous_decode_attention``; ``split`` forces split-K on/off (None:
    automatic). Split-K partitions are sized from ``max_context``, the host-known bound of ``context_lens``;
    ``order``: the rows longest first (``paged_attention``'s)."""
    launch_decode(
        out,
        query,
        k_slots,
        v_slots,
        slot_ids,
        context_lens,
        scale,
        k_scale,
        v_scale,
        contiguous=True,
        split=split,
        config=config,
        max_context=max_context,
        order=order,
    )


def contiguous_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    chunk_k: torch.Tensor | None = None,
    chunk_v: torch.Tensor | None = None,
    *,
    config: PrefillConfig | None = None,
) -> None:
    """Same contract as ``reference.contiguous_prefill_attention``; no device sync."""
    launch_prefill(
        out,
        query,
        k_slots,
        v_slots,
        slot_ids,
        cu_seqlens_q,
        context_lens,
        scale,
        k_scale,
        v_scale,
        chunk_k,
        chunk_v,
        contiguous=True,
        config=config,
    )
