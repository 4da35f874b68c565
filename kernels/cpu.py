"""The CPU decode path, lean: the reference's arithmetic (so float32 stays token-exact with transformers), with
what every layer of a pass would recompute done once per pass. The attention layers keep the per-pass values
in the forward context's ``memo``; tests/kernels/test_cpu_kernels.py checks each function against kernels/reference.py.

Per layer and step the reference spends most of a small model's CPU time outside the matmuls (measured with
torch.profiler: docs/BENCHMARKS.md, issue 15): gathering cos/sin rows, the block ids and visibility mask of
every decode row, and a host check for padding slots, each recomputed by all layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_plan(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int = 0
) -> tuple[torch.Tensor | int, torch.Tensor, int]:
    """For decode rows: what to gather — the flat block ids (``[B * blocks]``), or for a single sequence whose
    blocks are consecutive (a fresh pool hands them out in order) the first id, read as a view without any
    copy — the visibility mask ``[B, 1, 1, L]`` (the last ``window`` positions only, for a sliding-window layer)
    and ``L``, the gathered length."""
    max_len = int(context_lens.max())
    width = -(-max_len // block_size)
    blocks = block_tables[:, :width].reshape(-1)
    positions = torch.arange(width * block_size)[None, :]
    visible = positions < context_lens[:, None]
    if window > 0:
        visible &= positions >= context_lens[:, None] - window
    if len(context_lens) == 1:
        first = int(blocks[0])
        if bool((blocks == torch.arange(first, first + width, dtype=blocks.dtype)).all()):
            return first, visible[:, None, None, :], width * block_size
    return blocks, visible[:, None, None, :], width * block_size


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: tuple[torch.Tensor | int, torch.Tensor, int],
    scale: float,
) -> None:
    """``reference.paged_attention`` with its block ids and mask from ``decode_plan``."""
    blocks, visible, length = plan
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    # one sequence, consecutive blocks: the same values as the gather, in place
    if isinstance(blocks, int):
        width = length // k_cache.shape[1]
        keys, values = k_cache[blocks : blocks + width], v_cache[blocks : blocks + width]
    else:
        keys, values = k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)
    keys = keys.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, kvh, L, d]
    values = values.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    result = F.scaled_dot_product_attention(
        query.unsqueeze(2),
        keys,
        values,
        attn_mask=visible,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out.copy_(result.squeeze(2))


def store_plan(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots to write and, when some rows are padding (slot -1), the mask of the real rows."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping.long(), None
    return slot_mapping[keep].long(), keep


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor | None],
) -> None:
    """``reference.store_kv`` with its padding check from ``store_plan``."""
    slots, keep = plan
    if keep is not None:
        key, value = key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value)


def rotary_plan(
    positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos rows of the pass's positions and sin rows with the first half negated, ``[T, 1, head_dim]``:
    ``rotate_half(x) * sin == cat(x2, x1) * signed_sin`` exactly (a sign moves between factors)."""
    sin = sin_cache[positions].unsqueeze(1)
    half = sin.shape[-1] // 2
    return cos_cache[positions].unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """``reference.rotary_embedding`` (the same products and sum, bit for bit) with its cos/sin rows from
    ``rotary_plan``; when ``k``'s heads follow ``q``'s in memory (both views of one QKV projection output)
    the two are rotated as one tensor."""
    together = _adjacent(q, k)
    for x in (together,) if together is not None else (q, k):
        rotated(x, *plan, out=x)


def rotated(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` ``[T, heads, head_dim]`` rotated by ``rotary_plan``'s rows: ``x cos + cat(x2, x1) signed_sin``, into
    ``out`` (``x`` itself rotates in place: both products exist before the sum is written) or a new float32
    tensor (a bfloat16 ``x`` promotes exactly)."""
    first, second = x.chunk(2, dim=-1)
    return torch.add(x * cos, torch.cat((second, first), dim=-1) * signed_sin, out=out)


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``q`` and ``k`` as one ``[T, heads + kv_heads, head_dim]`` view, if ``k`` starts where ``q``'s heads end."""
    if (
        q.stride() != k.stride()
        or q.stride(2) != 1
        or q.stride(1) != q.shape[2]
        or q.dtype != k.dtype
    ):
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
