"""Pure-torch reference of every kernel: the oracle in tests and the CPU path.

KV cache layout (one tensor each for K and V, per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``;
``slot = block_id * block_size + offset``. Query heads are grouped over KV heads (GQA): query head h reads
KV head ``h // (num_heads // num_kv_heads)``.

Contiguous layout (vAttention: each request's KV contiguous in virtual memory, no block table):
``[num_slots, max_len, num_kv_heads, head_dim]``; sequence b's position p is ``k_slots[slot_ids[b], p]``.

FP8 cache (``torch.float8_e4m3fn``, ``--kv-cache-dtype fp8``): ``store_kv`` writes ``clamp(x / scale, -448, 448)``
rounded to the nearest e4m3 value (ties to even), and attention reads ``stored.to(float32) * scale``, with one K
and one V scale per layer (``k_scale``, ``v_scale``; 1.0 unless calibrated). A cache of any other dtype ignores
the scales. Block copies move bytes and do not care.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels.decoder_stack import DecoderStack

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` as stored in an FP8 cache: ``clamp(x / scale, -448, 448)`` in float32, rounded to e4m3."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V as attention reads it, in ``dtype``: ``cached.to(float32) * scale`` for an FP8 cache, the
    values themselves otherwise."""
    if cached.dtype != FP8:
        return cached
    return (cached.float() * scale).to(dtype)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as raw bytes, any other as itself: FP8 caches are indexed and copied as bytes (torch lacks
    some indexing ops for float8, e.g. ``index_copy_`` on the CPU)."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def select_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` along dim 0 (FP8: gathered as bytes)."""
    return as_bytes(cache).index_select(0, index).view(cache.dtype)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` ``[T, kv_heads, head_dim]`` into their slots; slot -1 (padding) is skipped. An FP8
    cache gets ``quantize_kv(key, k_scale)`` and ``quantize_kv(value, v_scale)``."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if k_cache.dtype == FP8:
        key, value = quantize_kv(key, k_scale), quantize_kv(value, v_scale)
    as_bytes(k_cache).view(-1, *k_cache.shape[2:])[slot_mapping] = as_bytes(key)
    as_bytes(v_cache).view(-1, *v_cache.shape[2:])[slot_mapping] = as_bytes(value)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    order: torch.Tensor | None = None,
) -> None:
    """Decode: one query token per sequence ``[B, heads, head_dim]`` attends to its first
    ``context_lens[b]`` cached tokens (its own token included, already stored); with ``window`` > 0 (a
    sliding-window layer) only the last ``window`` of them (blocks before those may be absent from the table).
    ``order``: the rows, longest context first (a permutation of ``range(B)`` or longer): the order a kernel may
    schedule them in; the result is the same in any order."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    blocks = block_tables[:, : -(-max_len // block_size)].reshape(-1)
    keys = dequantize_kv(select_rows(k_cache, blocks), k_scale, query.dtype)
    values = dequantize_kv(select_rows(v_cache, blocks), v_scale, query.dtype)
    keys = keys.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, kvh, L, d]
    values = values.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)[None, :]
    visible = positions < context_lens[:, None]
    if window > 0:
        visible &= positions >= context_lens[:, None] - window
    result = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        keys,
        values,
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out.copy_(result.squeeze(2))


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    chunk_k: torch.Tensor | None = None,
    chunk_v: torch.Tensor | None = None,
    window: int = 0,
) -> None:
    """Causal attention for variable-length query chunks ``[T, heads, head_dim]`` (sequence b owns rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``). Keys are the sequence's first ``context_lens[b]`` cached tokens:
    a cached prefix, earlier chunks, and this chunk (already stored). The chunk's last query sits at
    position ``context_lens[b] - 1``, so query i of a chunk of length q sees keys ``0 .. ctx - q + i``; with
    ``window`` > 0 (a sliding-window layer) only keys ``ctx - q + i - window + 1 ..`` of those (the blocks of
    earlier keys may be absent from the table: they are not read).
    ``chunk_k``/``chunk_v`` (optional, ``[T, kv_heads, head_dim]``): the chunk's K/V as they were stored, which
    a kernel may read in place of the cache's copy (the Triton kernel does on Hopper); the reference reads the
    cache."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, ctx in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        # (a window reads from the first block any query of the chunk sees; earlier keys drop out)
        first = max(0, ctx - (hi - lo) - window + 1) // block_size * block_size if window else 0
        table = block_tables[b, first // block_size : -(-ctx // block_size)].long()
        keys = select_rows(k_cache, table).reshape(-1, num_kv_heads, head_dim)[: ctx - first]
        values = select_rows(v_cache, table).reshape(-1, num_kv_heads, head_dim)[: ctx - first]
        keys, values = (
            dequantize_kv(keys, k_scale, query.dtype),
            dequantize_kv(values, v_scale, query.dtype),
        )
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
        k = keys.transpose(0, 1).unsqueeze(0)
        v = values.transpose(0, 1).unsqueeze(0)
        mask = None
        if hi - lo != ctx or window:  # causal mask aligned to the bottom-right, and the window
            rows = torch.arange(ctx - (hi - lo), ctx, device=query.device)[:, None]
            keys_at = torch.arange(first, ctx, device=query.device)[None, :]
            mask = keys_at <= rows
            if window:
                mask &= keys_at > rows - window
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[lo:hi] = o.squeeze(0).transpose(0, 1)


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
) -> None:
    """``paged_attention`` over the contiguous layout: query ``[B, heads, head_dim]`` attends to the first
    ``context_lens[b]`` positions of slot ``slot_ids[b]``. ``max_context`` (a host-known bound of
    ``context_lens``, which the Triton kernel sizes split-K with) and ``order`` (``paged_attention``'s) are not
    needed here."""
    num_heads, num_kv_heads = query.shape[1], k_slots.shape[2]
    max_len = int(context_lens.max())
    slots = slot_ids.long()
    # [B, kvh, L, d]
    keys = dequantize_kv(select_rows(k_slots[:, :max_len], slots), k_scale, query.dtype).transpose(
        1, 2
    )
    values = dequantize_kv(
        select_rows(v_slots[:, :max_len], slots), v_scale, query.dtype
    ).transpose(1, 2)
    visible = torch.arange(max_len, device=query.device)[None, :] < context_lens[:, None]
    result = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        keys,
        values,
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out.copy_(result.squeeze(2))


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
) -> None:
    """``prefill_attention`` over the contiguous layout (``chunk_k``/``chunk_v`` as there): sequence b's chunk (query rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``) sees the first ``context_lens[b]`` positions of slot
    ``slot_ids[b]``, causal aligned to the bottom-right (query i of a chunk of q sees keys ``0 .. ctx - q + i``)."""
    num_heads, num_kv_heads = query.shape[1], k_slots.shape[2]
    starts, lens, slots = cu_seqlens_q.tolist(), context_lens.tolist(), slot_ids.tolist()
    for b, ctx in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, heads, q, d]
        k = (
            dequantize_kv(k_slots[slots[b], :ctx], k_scale, query.dtype)
            .transpose(0, 1)
            .unsqueeze(0)
        )
        v = (
            dequantize_kv(v_slots[slots[b], :ctx], v_scale, query.dtype)
            .transpose(0, 1)
            .unsqueeze(0)
        )
        mask = None
        if hi - lo != ctx:  # chunk after a cached prefix: causal mask aligned to the bottom-right
            rows = torch.arange(ctx - (hi - lo), ctx, device=query.device)
            mask = torch.arange(ctx, device=query.device)[None, :] <= rows[:, None]
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[lo:hi] = o.squeeze(0).transpose(0, 1)


def copy_blocks(
    k_caches: torch.Tensor, v_caches: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Copy-on-write: for each row (src, dst) of ``block_mapping``, copy block src into block dst in every
    layer of ``[num_layers, num_blocks, ...]`` caches."""
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    k_caches, v_caches = as_bytes(k_caches), as_bytes(v_caches)
    k_caches[:, dst] = k_caches[:, src]
    v_caches[:, dst] = v_caches[:, src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Swap preemption: copy blocks (src_id, dst_id) between a device and a host cache of equal layout."""
    src_ids = block_mapping[:, 0].long().to(src.device)
    dst_ids = block_mapping[:, 1].long().to(dst.device)
    as_bytes(dst)[:, dst_ids] = as_bytes(src)[:, src_ids].to(dst.device)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
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


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate ``q`` ``[T, heads, head_dim]`` and ``k`` ``[T, kv_heads, head_dim]`` in place by their positions
    (rotate-half layout): ``x * cos + rotate_half(x) * sin``, with ``rotate_half(x) = cat(-x2, x1)`` and
    cos/sin rows ``[max_position, head_dim]`` gathered at ``positions``."""
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)
    q.copy_(q * cos + _rotate_half(q) * sin)
    k.copy_(k * cos + _rotate_half(k) * sin)


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
    """``rotary_embedding`` of ``q`` and ``k`` in place, then ``store_kv`` of the rotated ``k`` and of ``v``.
    With ``q_norm``/``k_norm`` (Qwen3's per-head norms, in q's dtype): ``rms_norm`` of each head of q and k by
    them first, in place."""
    if q_norm is not None:
        q.copy_(rms_norm(q, q_norm, eps))
        k.copy_(rms_norm(k, k_norm, eps))
    rotary_embedding(positions, q, k, cos_cache, sin_cache)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(gate) * up`` for ``gate, up`` the two halves of the last dim of ``[T, 2I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    config: object | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` (x ``[M, K]``, weight ``[N, K]`` as nn.Linear's), into ``out`` when given. ``config``
    (the Triton kernel's launch parameters) is ignored."""
    result = x @ weight.T
    return result if out is None else out.copy_(result)


def skinny_gemm_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    config: object | None = None,
) -> torch.Tensor:
    """The MLP's gate/up projection and its activation: ``silu_and_mul(x @ weight.T)`` (weight ``[2I, K]``, gate
    rows first), into ``out`` when given. ``config`` is ignored."""
    result = silu_and_mul(x @ weight.T)
    return result if out is None else out.copy_(result)


def persistent_decode(
    h: torch.Tensor,
    stack: DecoderStack,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    scale: float,
    config: object | None = None,
) -> None:
    """Every decoder layer of ``stack`` for one decode token per row of ``h`` ``[M, hidden]`` (the residual
    stream, updated in place to the stream after the last layer, before the final norm), as the engine's
    layer path computes it: norm, qkv, rotary + KV store at ``slot_mapping``, decode attention, o + residual,
    norm, gate/up + SiLU-and-mul, down + residual. ``config`` (the kernel's) is ignored."""
    heads, kv_heads, head_dim = stack.num_heads, stack.num_kv_heads, stack.head_dim
    rows = h.shape[0]
    for layer in stack.layers:
        x = rms_norm(h, layer.norm_in, stack.eps)
        q, k, v = skinny_gemm(x, layer.qkv).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        q = q.reshape(rows, heads, head_dim)
        k, v = k.reshape(rows, kv_heads, head_dim), v.reshape(rows, kv_heads, head_dim)
        rotary_store_kv(
            positions, q, k, v, cos_cache, sin_cache, layer.k_cache, layer.v_cache, slot_mapping
        )
        attn = torch.empty_like(q)
        paged_attention(attn, q, layer.k_cache, layer.v_cache, block_tables, context_lens, scale)
        x, _ = rms_norm(skinny_gemm(attn.view(rows, -1), layer.o), layer.norm_post, stack.eps, h)
        torch.add(skinny_gemm(skinny_gemm_silu_and_mul(x, layer.gate_up), layer.down), h, out=h)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value, the lowest among ties, as int64 ``[rows]`` (greedy sampling).
    NaN counts as the largest value, as in torch's argmax."""
    return logits.argmax(dim=-1)


def prepare_inputs(
    ids: torch.Tensor,
    feed: torch.Tensor,
    last_sampled: torch.Tensor,
    packed: torch.Tensor | None,
    table_at: torch.Tensor | None,
    static_tables: torch.Tensor | None,
) -> None:
    """A step's inputs made ready on its device, in place: ``ids[t] = last_sampled[feed[t]]`` where
    ``feed[t] >= 0`` (a token sampled by the step before, which the host does not know yet). With
    ``static_tables`` (a CUDA graph's static block table), ``table_at`` holds (offset, rows, width) and
    ``static_tables[:rows, :width] = packed[offset : offset + rows * width]`` (rows of ``width``)."""
    ids.copy_(torch.where(feed >= 0, last_sampled[feed.clamp(min=0).long()], ids))
    if static_tables is not None:
        offset, rows, width = table_at.tolist()
        static_tables[:rows, :width].copy_(packed[offset : offset + rows * width].view(rows, width))


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router (Qwen3-MoE's): softmax over the ``[T, E]`` logits in float32, the ``top_k``
    largest per token, renormalised to sum to 1 when asked; -> (weights float32, expert ids int32), ``[T, K]``.
    Plain torch on every device (the GPU path too): it is a few small ops beside the experts' matmuls."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: object | None = None,
) -> torch.Tensor:
    """Mixture-of-experts MLP: ``out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for
    ``e = topk_ids[t, k]``, with ``hidden`` ``[T, H]``, ``w_gate_up`` ``[E, 2I, H]`` (gate rows, then up rows),
    ``w_down`` ``[E, H, I]``, ``[T, K]`` weights and ids. Computed in float32 one expert at a time, only the
    experts some token chose; the output in hidden's dtype. ``config`` (the Triton kernel's) is ignored."""
    x, out = hidden.float(), torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        act = silu_and_mul(x[tokens] @ w_gate_up[expert].float().T)
        weighted = (act @ w_down[expert].float().T) * topk_weights[tokens, slots, None].float()
        out.index_add_(0, tokens, weighted)
    return out.to(hidden.dtype)
