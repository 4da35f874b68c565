"""Pure-torch reference of every kernel: the oracle in tests and the CPU path.

KV cache layout (one tensor each for K and V, per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``;
``slot = block_id * block_size + offset``. Query heads are grouped over KV heads (GQA): query head h reads
KV head ``h // (num_heads // num_kv_heads)``.

Contiguous layout (vAttention: each request's KV contiguous in virtual memory, no block table):
``[num_slots, max_len, num_kv_heads, head_dim]``; sequence b's position p is ``k_slots[slot_ids[b], p]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, kv_heads, head_dim]`` into their slots; slot -1 (padding) is skipped."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> None:
    """Decode: one query token per sequence ``[B, heads, head_dim]`` attends to its first
    ``context_lens[b]`` cached tokens (its own token included, already stored)."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    blocks = block_tables[:, : -(-max_len // block_size)].reshape(-1)
    keys = k_cache.index_select(0, blocks).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, kvh, L, d]
    values = v_cache.index_select(0, blocks).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    visible = torch.arange(keys.shape[2], device=query.device)[None, :] < context_lens[:, None]
    result = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=visible[:, None, None, :],
                                            scale=scale, enable_gqa=num_heads != num_kv_heads)
    out.copy_(result.squeeze(2))


def prefill_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      scale: float) -> None:
    """Causal attention for variable-length query chunks ``[T, heads, head_dim]`` (sequence b owns rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``). Keys are the sequence's first ``context_lens[b]`` cached tokens:
    a cached prefix, earlier chunks, and this chunk (already stored). The chunk's last query sits at
    position ``context_lens[b] - 1``, so query i of a chunk of length q sees keys ``0 .. ctx - q + i``."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, ctx in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        table = block_tables[b, : -(-ctx // block_size)].long()
        keys = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:ctx]
        values = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:ctx]
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
        k = keys.transpose(0, 1).unsqueeze(0)
        v = values.transpose(0, 1).unsqueeze(0)
        mask = None
        if hi - lo != ctx:  # chunk after a cached prefix: causal mask aligned to the bottom-right
            rows = torch.arange(ctx - (hi - lo), ctx, device=query.device)
            mask = torch.arange(ctx, device=query.device)[None, :] <= rows[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[lo:hi] = o.squeeze(0).transpose(0, 1)


def contiguous_decode_attention(out: torch.Tensor, query: torch.Tensor, k_slots: torch.Tensor,
                                v_slots: torch.Tensor, slot_ids: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, max_context: int) -> None:
    """``paged_attention`` over the contiguous layout: query ``[B, heads, head_dim]`` attends to the first
    ``context_lens[b]`` positions of slot ``slot_ids[b]``. ``max_context`` (a host-known bound of
    ``context_lens``, which the Triton kernel sizes split-K with) is not needed here."""
    num_heads, num_kv_heads = query.shape[1], k_slots.shape[2]
    max_len = int(context_lens.max())
    slots = slot_ids.long()
    keys = k_slots[slots, :max_len].transpose(1, 2)  # [B, kvh, L, d]
    values = v_slots[slots, :max_len].transpose(1, 2)
    visible = torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None]
    result = F.scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=visible[:, None, None, :],
                                            scale=scale, enable_gqa=num_heads != num_kv_heads)
    out.copy_(result.squeeze(2))


def contiguous_prefill_attention(out: torch.Tensor, query: torch.Tensor, k_slots: torch.Tensor,
                                 v_slots: torch.Tensor, slot_ids: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float) -> None:
    """``prefill_attention`` over the contiguous layout: sequence b's chunk (query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``) sees the first ``context_lens[b]`` positions of slot
    ``slot_ids[b]``, causal aligned to the bottom-right (query i of a chunk of q sees keys ``0 .. ctx - q + i``)."""
    num_heads, num_kv_heads = query.shape[1], k_slots.shape[2]
    starts, lens, slots = cu_seqlens_q.tolist(), context_lens.tolist(), slot_ids.tolist()
    for b, ctx in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
        k = k_slots[slots[b], :ctx].transpose(0, 1).unsqueeze(0)
        v = v_slots[slots[b], :ctx].transpose(0, 1).unsqueeze(0)
        mask = None
        if hi - lo != ctx:  # chunk after a cached prefix: causal mask aligned to the bottom-right
            rows = torch.arange(ctx - (hi - lo), ctx, device=query.device)
            mask = torch.arange(ctx, device=query.device)[None, :] <= rows[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[lo:hi] = o.squeeze(0).transpose(0, 1)


def copy_blocks(k_caches: torch.Tensor, v_caches: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for each row (src, dst) of ``block_mapping``, copy block src into block dst in every
    layer of ``[num_layers, num_blocks, ...]`` caches."""
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    k_caches[:, dst] = k_caches[:, src]
    v_caches[:, dst] = v_caches[:, src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Swap preemption: copy blocks (src_id, dst_id) between a device and a host cache of equal layout."""
    src_ids = block_mapping[:, 0].long().to(src.device)
    dst_ids = block_mapping[:, 1].long().to(dst.device)
    dst[:, dst_ids] = src[:, src_ids].to(dst.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / sqrt(mean(x², last dim) + eps)``, computed in float32 and rounded back to ``x``'s dtype
    before the weight multiplies (as transformers does). With ``residual``: ``s = x + residual`` is written
    into ``residual`` in place and ``(weight * norm(s), s)`` returned (``s`` is ``residual`` itself)."""
    if residual is not None:
        x = torch.add(x, residual, out=residual)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> None:
    """Rotate ``q`` ``[T, heads, head_dim]`` and ``k`` ``[T, kv_heads, head_dim]`` in place by their positions
    (rotate-half layout): ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = cat(-x2, x1)`` and
    cos/sin rows ``[max_position, head_dim]`` gathered at ``positions``."""
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)
    q.copy_(q * cos + _rotate_half(q) * sin)
    k.copy_(k * cos + _rotate_half(k) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(gate) * up`` for ``gate, up`` the two halves of the last dim of ``[T, 2I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                config: object | None = None) -> torch.Tensor:
    """``x @ weight.T`` (x ``[M, K]``, weight ``[N, K]`` as nn.Linear's), into ``out`` when given. ``config``
    (the Triton kernel's launch parameters) is ignored."""
    result = x @ weight.T
    return result if out is None else out.copy_(result)


def skinny_gemm_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                             config: object | None = None) -> torch.Tensor:
    """The MLP's gate/up projection and its activation: ``silu_and_mul(x @ weight.T)`` (weight ``[2I, K]``, gate
    rows first), into ``out`` when given. ``config`` is ignored."""
    result = silu_and_mul(x @ weight.T)
    return result if out is None else out.copy_(result)
