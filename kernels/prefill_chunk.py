"""Where the prefill kernel (prefill_attention.py) reads a key tile from, and the online-softmax step it
folds each tile into.

A tile's positions live in the cache (the cached prefix; every position without ``CHUNK_TMA``) or in the
chunk's own K/V rows as they left the projection (``chunk_k``/``chunk_v``, the values ``store_kv`` just wrote).
``chunk_rows`` decides on the host whether those rows can be read through TMA descriptors; ``cached_kv``
gathers a tile through the block table (or a contiguous slot), ``straddling_kv`` reads the one tile that holds
both the prefix's end and the chunk's start, and ``attend`` is the softmax step, the same for every source.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.device_features import has_tma
from kernels.paged_attention import kv_tile_offsets


def tma_rows(heads: torch.Tensor) -> torch.Tensor | None:
    """``[tokens, heads, head_dim]`` as the rows ``[tokens, heads * head_dim]`` (a view) when TMA can read them:
    a power-of-two head, dims contiguous, and the 16-byte alignment TMA asks of the base and the row stride."""
    head_dim = heads.shape[-1]
    if head_dim & (head_dim - 1) or heads.stride(-1) != 1 or heads.stride(-2) != head_dim:
        return None
    rows = heads.flatten(1)
    if rows.data_ptr() % 16 or rows.stride(0) * rows.element_size() % 16:
        return None
    return rows


def chunk_rows(
    query: torch.Tensor, k_cache: torch.Tensor, chunk_k: torch.Tensor | None
) -> torch.Tensor | None:
    """``chunk_k`` as TMA rows (``tma_rows``) where the kernel can read the chunk's keys from them, else None:
    a Hopper-class GPU (compute capability 9.0+) or the interpreter, and a cache of the query's dtype (an FP8
    cache's stored values differ from the chunk's)."""
    if chunk_k is None or k_cache.dtype != query.dtype or chunk_k.dtype != query.dtype:
        return None
    if not (has_tma(query.device) or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    return tma_rows(chunk_k)


@dataclass(frozen=True, slots=True)
class ChunkDescriptors:
    """What the kernel's CHUNK_TMA path is given: TMA descriptors of the query rows (``block_m`` rows a
    tile) and of the chunk's K and V rows (``block_n``), and the K/V rows themselves (for the one tile that
    straddles the prefix's end, read with plain loads)."""

    query: TensorDescriptor
    k: TensorDescriptor
    v: TensorDescriptor
    k_rows: torch.Tensor
    v_rows: torch.Tensor


def chunk_descriptors(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    chunk_k: torch.Tensor | None,
    chunk_v: torch.Tensor | None,
    block_m: int,
    block_n: int,
) -> ChunkDescriptors | None:
    """The CHUNK_TMA inputs, or None where the chunk's rows cannot be read through TMA (``chunk_rows``)."""
    k_rows = chunk_rows(query, k_cache, chunk_k)
    v_rows = chunk_rows(query, k_cache, chunk_v) if k_rows is not None else None
    q_rows = tma_rows(query) if v_rows is not None else None
    if q_rows is None or k_rows.stride(0) != v_rows.stride(0):
        return None
    assert k_rows.shape == v_rows.shape and k_rows.shape[0] == query.shape[0], "a K/V row per query"
    head_dim = query.shape[-1]

    def describe(rows: torch.Tensor, tile_rows: int) -> TensorDescriptor:
        return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [tile_rows, head_dim])

    return ChunkDescriptors(
        describe(q_rows, block_m),
        describe(k_rows, block_n),
        describe(v_rows, block_n),
        k_rows,
        v_rows,
    )


@triton.jit
def cached_kv(
    k_seq,
    v_seq,
    table_row,
    pos,
    limit,
    kv_head,
    dims,
    stride_block,
    stride_token,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K and V of positions ``pos`` from the cache. MASKED: positions at or past ``limit`` read as zero and
    are never loaded; unmasked tiles are plain wide loads."""
    in_range = pos < limit
    offs = kv_tile_offsets(
        table_row,
        pos,
        kv_head,
        dims,
        stride_block,
        stride_token,
        stride_head,
        BLOCK_SIZE,
        in_range,
        CONTIGUOUS,
    )
    if MASKED:
        kv_mask = in_range[:, None]
        if HEAD_DIM != HEAD_PAD:
            kv_mask = kv_mask & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_seq + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_seq + offs, mask=kv_mask, other=0.0)
    elif HEAD_DIM != HEAD_PAD:
        k = tl.load(k_seq + offs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(v_seq + offs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    else:  # every key of the tile exists: plain wide loads
        k = tl.load(k_seq + offs)
        v = tl.load(v_seq + offs)
    return k, v


@triton.jit
def straddling_kv(
    k_seq,
    v_seq,
    chunk_k_ptr,
    chunk_v_ptr,
    table_row,
    pos,
    prefix,
    ctx,
    seq_start,
    kv_head,
    dims,
    stride_block,
    stride_token,
    stride_head,
    stride_chunk,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
):
    """K and V of a tile that may hold cached positions (``< prefix``, from the cache) and chunk positions
    (``prefix .. ctx - 1``, from the chunk's own rows); positions past ``ctx`` read as zero."""
    k, v = cached_kv(
        k_seq,
        v_seq,
        table_row,
        pos,
        prefix,
        kv_head,
        dims,
        stride_block,
        stride_token,
        stride_head,
        BLOCK_SIZE,
        HEAD_DIM,
        HEAD_DIM,
        CONTIGUOUS,
        True,
    )
    fresh = (pos >= prefix) & (pos < ctx)
    rows = (seq_start + pos - prefix).to(tl.int64) * stride_chunk + kv_head * HEAD_DIM
    offs = rows[:, None] + dims[None, :]
    k_new = tl.load(chunk_k_ptr + offs, mask=fresh[:, None], other=0.0)
    v_new = tl.load(chunk_v_ptr + offs, mask=fresh[:, None], other=0.0)
    return tl.where(fresh[:, None], k_new, k), tl.where(fresh[:, None], v_new, v)


@triton.jit
def attend(
    q,
    k,
    v,
    row_max,
    row_sum,
    acc,
    pos,
    rows,
    prefix,
    ctx,
    scale_log2,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One online-softmax step over keys ``pos``. MASKED (diagonal tiles only): row r sees keys
    ``<= prefix + r`` and none at or past ``ctx``."""
    if KV_FP8:
        k, v = k.to(q.dtype), v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        visible = (pos[None, :] <= prefix + rows[:, None]) & (pos < ctx)[None, :]
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        p = tl.exp2(scores - new_max[:, None])
    else:
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * scale_log2)
        p = tl.exp2(scores * scale_log2 - new_max[:, None])
    alpha = tl.exp2(row_max - new_max)
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, row_sum, acc


@triton.jit
def attend_straddling(
    q,
    row_max,
    row_sum,
    acc,
    k_seq,
    v_seq,
    chunk_k_ptr,
    chunk_v_ptr,
    table_row,
    pos,
    rows,
    prefix,
    ctx,
    seq_start,
    kv_head,
    dims,
    stride_block,
    stride_token,
    stride_head,
    stride_chunk,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``attend`` over the one tile that holds both the prefix's end and the chunk's start."""
    k, v = straddling_kv(
        k_seq,
        v_seq,
        chunk_k_ptr,
        chunk_v_ptr,
        table_row,
        pos,
        prefix,
        ctx,
        seq_start,
        kv_head,
        dims,
        stride_block,
        stride_token,
        stride_head,
        stride_chunk,
        BLOCK_SIZE,
        HEAD_DIM,
        CONTIGUOUS,
    )
    return attend(
        q,
        k,
        v,
        row_max,
        row_sum,
        acc,
        pos,
        rows,
        prefix,
        ctx,
        scale_log2,
        MASKED,
        DOT_PRECISION,
        False,
    )
