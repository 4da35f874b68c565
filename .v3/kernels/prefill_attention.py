"""Prefill attention over a paged KV cache (Triton): causal attention for a batch of variable-length query
chunks whose keys are the sequence's cached tokens (a prefix-cache hit, earlier chunks) followed by the chunk
itself, all read from the block table (the chunk's K/V were stored by ``store_kv`` just before). With
``CONTIGUOUS`` (kernels/contiguous_attention.py, the vAttention layout) keys are read from the sequence's
slot of a ``[num_slots, max_len, ...]`` cache instead: no block table.

Causality is aligned bottom-right: in a sequence with ``ctx`` tokens after this pass and a chunk of ``q``
queries, query ``i`` (0-based within the chunk) sits at position ``ctx - q + i`` and sees keys
``0 .. ctx - q + i``. Plain prefill (``q == ctx``), prefix hits and chunked prefill are the same kernel.

Grid: (query head, query tile). Sequence ``b``'s tiles are numbered from ``cu[b] // BLOCK_M + b``, which bounds
the tile count by ``num_tokens // BLOCK_M + num_seqs`` without reading the device; each program finds its
sequence by binary search over ``cu_seqlens_q`` and exits if its tile is past the chunk's end. Tiles with the
most keys are launched first (reverse order) so the causal tail does not run alone at the end.

Per tile, keys before ``prefix + first row`` are visible to every row and run unmasked; only the last
``BLOCK_M + BLOCK_N`` keys (the diagonal) pay for the causal mask.

Hopper (``CHUNK_TMA``): the chunk's own keys and values are also passed in as they left the projection
(``chunk_k``/``chunk_v``, ``[num_tokens, kv_heads, head_dim]`` rows, the values ``store_kv`` just wrote). Key
tiles wholly inside the chunk are then read from those rows through TMA descriptors (one bulk copy per tile,
pipelined), not gathered through the block table; tiles of the cached prefix are gathered as before, and the
tile the prefix ends in and the diagonal tiles read each position from where it lives. Tiles start at the same
positions either way, so the result is the same, bit for bit, as reading everything from the cache.

An FP8 cache (``KV_FP8``) is read as in the decode kernel (paged_attention.py): tiles widened to the query's
dtype, ``k_scale`` folded into the softmax scale, ``v_scale`` applied to the output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.device_features import has_tma
from kernels.paged_attention import (
    LOG2E,
    dot_precision,
    fit_shared_memory,
    kv_tile_offsets,
    sequence_kv,
)
from kernels.reference import FP8
from kernels.specialization import per_step


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Launch parameters (tuned by benchmarks/prefill_kernel.py --sweep; see docs/KERNELS_NOTES.md)."""

    block_m: int = 128  # query rows per program
    block_n: int = 128  # key positions per loop step
    num_warps: int = 8
    num_stages: int = 3


CONFIG = PrefillConfig()


@triton.jit
def _find_sequence(cu_ptr, tile, num_seqs, BLOCK_M: tl.constexpr):
    """Largest b with ``cu[b] // BLOCK_M + b <= tile`` (binary search; the left side grows with b)."""
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = tl.load(cu_ptr + mid) // BLOCK_M + mid <= tile
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    return lo


@triton.jit
def _cached_kv(
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
def _straddling_kv(
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
    k, v = _cached_kv(
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
def _attend(
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
def _attend_straddling(
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
    """``_attend`` over the one tile that holds both the prefix's end and the chunk's start."""
    k, v = _straddling_kv(
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
    return _attend(
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


@triton.jit(**per_step("table_ptr", "cu_ptr", "ctx_ptr", "stride_table", "num_seqs", "num_tiles"))
def _prefill_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    chunk_k_desc,
    chunk_v_desc,
    chunk_k_ptr,
    chunk_v_ptr,
    table_ptr,
    cu_ptr,
    ctx_ptr,
    scale_log2,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_block,
    stride_token,
    stride_head,
    stride_chunk,
    stride_table,
    num_seqs,
    num_tiles,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    KV_FP8: tl.constexpr,
    CHUNK_TMA: tl.constexpr,
):
    head = tl.program_id(0)
    tile = num_tiles - 1 - tl.program_id(1)  # heavy tiles (late in a sequence) first
    seq = _find_sequence(cu_ptr, tile, num_seqs, BLOCK_M)
    seq_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - seq_start
    first_row = (tile - seq_start // BLOCK_M - seq) * BLOCK_M
    if first_row < q_len:
        ctx = tl.load(ctx_ptr + seq)
        prefix = ctx - q_len
        kv_head = head // GROUP
        rows = first_row + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_PAD)
        io_mask = (rows < q_len)[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(
            q_ptr
            + (seq_start + rows)[:, None].to(tl.int64) * stride_qt
            + head * stride_qh
            + dims[None, :],
            mask=io_mask,
            other=0.0,
        )
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        table_row = table_ptr + seq.to(tl.int64) * stride_table
        k_seq, v_seq = sequence_kv(k_ptr, v_ptr, table_row, stride_block, CONTIGUOUS)
        unmasked_end = (prefix + first_row) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
        # tiles wholly in the cache: with CHUNK_TMA the prefix's, else every tile
        cached_end = (prefix if CHUNK_TMA else ctx) // BLOCK_N * BLOCK_N
        for start in range(0, tl.minimum(cached_end, unmasked_end), BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k, v = _cached_kv(
                k_seq,
                v_seq,
                table_row,
                pos,
                ctx,
                kv_head,
                dims,
                stride_block,
                stride_token,
                stride_head,
                BLOCK_SIZE,
                HEAD_DIM,
                HEAD_PAD,
                CONTIGUOUS,
                False,
            )
            row_max, row_sum, acc = _attend(
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
                False,
                DOT_PRECISION,
                KV_FP8,
            )
        if CHUNK_TMA:
            if cached_end < prefix and cached_end < unmasked_end:  # the tile the prefix ends in
                row_max, row_sum, acc = _attend_straddling(
                    q,
                    row_max,
                    row_sum,
                    acc,
                    k_seq,
                    v_seq,
                    chunk_k_ptr,
                    chunk_v_ptr,
                    table_row,
                    cached_end + tl.arange(0, BLOCK_N),
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
                    BLOCK_SIZE,
                    HEAD_DIM,
                    CONTIGUOUS,
                    False,
                    DOT_PRECISION,
                )
            # tiles wholly in the chunk: its own rows, contiguous, through TMA
            for start in range(tl.cdiv(prefix, BLOCK_N) * BLOCK_N, unmasked_end, BLOCK_N):
                k = chunk_k_desc.load([seq_start + start - prefix, kv_head * HEAD_DIM])
                v = chunk_v_desc.load([seq_start + start - prefix, kv_head * HEAD_DIM])
                row_max, row_sum, acc = _attend(
                    q,
                    k,
                    v,
                    row_max,
                    row_sum,
                    acc,
                    start + tl.arange(0, BLOCK_N),
                    rows,
                    prefix,
                    ctx,
                    scale_log2,
                    False,
                    DOT_PRECISION,
                    KV_FP8,
                )
        diagonal_end = tl.minimum(prefix + first_row + BLOCK_M, ctx)
        if CHUNK_TMA:
            diagonal_start = unmasked_end
            if cached_end < prefix and cached_end == unmasked_end:  # the prefix ends in this tile
                row_max, row_sum, acc = _attend_straddling(
                    q,
                    row_max,
                    row_sum,
                    acc,
                    k_seq,
                    v_seq,
                    chunk_k_ptr,
                    chunk_v_ptr,
                    table_row,
                    cached_end + tl.arange(0, BLOCK_N),
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
                    BLOCK_SIZE,
                    HEAD_DIM,
                    CONTIGUOUS,
                    True,
                    DOT_PRECISION,
                )
                diagonal_start = cached_end + BLOCK_N
            for start in range(diagonal_start, diagonal_end, BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)
                k = chunk_k_desc.load([seq_start + start - prefix, kv_head * HEAD_DIM])
                v = chunk_v_desc.load([seq_start + start - prefix, kv_head * HEAD_DIM])
                # rows past the chunk are the next sequence's: never let them in, even as 0 * inf
                pass
                row_max, row_sum, acc = _attend(
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
                    True,
                    DOT_PRECISION,
                    KV_FP8,
                )
        else:
            for start in range(unmasked_end, diagonal_end, BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)
                k, v = _cached_kv(
                    k_seq,
                    v_seq,
                    table_row,
                    pos,
                    ctx,
                    kv_head,
                    dims,
                    stride_block,
                    stride_token,
                    stride_head,
                    BLOCK_SIZE,
                    HEAD_DIM,
                    HEAD_PAD,
                    CONTIGUOUS,
                    True,
                )
                row_max, row_sum, acc = _attend(
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
                    True,
                    DOT_PRECISION,
                    KV_FP8,
                )
        out = acc / row_sum[:, None]
        if KV_FP8:
            out = out * v_scale
        tl.store(
            out_ptr
            + (seq_start + rows)[:, None].to(tl.int64) * stride_ot
            + head * stride_oh
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


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
    *,
    config: PrefillConfig | None = None,
) -> None:
    """Same contract as ``reference.prefill_attention``. No device sync: the grid is sized from the number
    of query tokens and sequences, both known on the host."""
    launch_prefill(
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        scale,
        k_scale,
        v_scale,
        chunk_k,
        chunk_v,
        contiguous=False,
        config=config,
    )


def chunk_rows(
    query: torch.Tensor, k_cache: torch.Tensor, chunk_k: torch.Tensor | None
) -> torch.Tensor | None:
    """``chunk_k`` as rows ``[num_tokens, kv_heads * head_dim]`` (a view) where the kernel can read the
    chunk's keys through TMA, else None: a Hopper-class GPU (compute capability 9.0+) or the interpreter,
    a cache of the query's dtype (an FP8 cache's stored values differ from the chunk's), a power-of-two
    head, and the 16-byte alignment TMA asks of the base and the row stride."""
    if chunk_k is None or k_cache.dtype != query.dtype or chunk_k.dtype != query.dtype:
        return None
    if not (has_tma(query.device) or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    head_dim = query.shape[-1]
    if head_dim & (head_dim - 1) or chunk_k.stride(-1) != 1 or chunk_k.stride(-2) != head_dim:
        return None
    rows = chunk_k.flatten(1)
    if rows.data_ptr() % 16 or rows.stride(0) * rows.element_size() % 16:
        return None
    return rows


def launch_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    chunk_k: torch.Tensor | None,
    chunk_v: torch.Tensor | None,
    *,
    contiguous: bool,
    config: PrefillConfig | None,
) -> None:
    """Launch ``_prefill_kernel`` over either layout: ``table`` is the block tables ``[num_seqs, width]``
    (paged) or the slot ids ``[num_slots]`` of a ``[num_slots, max_len, ...]`` cache (contiguous). The scales
    apply to an FP8 cache only. ``chunk_k``/``chunk_v`` (optional): the chunk's K/V as just stored, read in
    place of the cache's copy where ``chunk_rows`` allows (CHUNK_TMA)."""
    config = config or CONFIG
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, (
        "K and V: same layout, dim contiguous"
    )
    assert not contiguous or k_cache.shape[1] * k_cache.stride(1) < 2**31, (
        "a slot's offsets are int32"
    )
    assert query.stride(-1) == 1 and out.stride(-1) == 1
    num_tiles = num_tokens // config.block_m + num_seqs
    head_pad = triton.next_power_of_2(head_dim)
    block_n, stages = fit_shared_memory(
        config.block_n, config.num_stages, config.block_m, head_pad, query.element_size()
    )
    kv_fp8 = k_cache.dtype == FP8
    k_rows = chunk_rows(query, k_cache, chunk_k)
    v_rows = chunk_rows(query, v_cache, chunk_v) if k_rows is not None else None
    use_chunk = v_rows is not None and k_rows.stride(0) == v_rows.stride(0)
    if use_chunk:
        assert k_rows.shape == (num_tokens, num_kv_heads * head_dim), "one K row per query row"
        tiles = [block_n, head_dim]
        k_desc = TensorDescriptor(k_rows, list(k_rows.shape), list(k_rows.stride()), tiles)
        v_desc = TensorDescriptor(v_rows, list(v_rows.shape), list(v_rows.stride()), tiles)
    else:
        k_desc = v_desc = None
        k_rows = v_rows = k_cache  # never read
    _prefill_kernel[(num_heads, num_tiles)](
        out,
        query,
        k_cache,
        v_cache,
        k_desc,
        v_desc,
        k_rows,
        v_rows,
        table,
        cu_seqlens_q,
        context_lens,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0),
        v_scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_rows.stride(0) if use_chunk else 0,
        table.stride(0),
        num_seqs,
        num_tiles,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        # a constexpr the contiguous path never reads
        BLOCK_SIZE=1 if contiguous else k_cache.shape[1],
        BLOCK_M=config.block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        CONTIGUOUS=contiguous,
        KV_FP8=kv_fp8,
        CHUNK_TMA=use_chunk,
        num_warps=config.num_warps,
        num_stages=stages,
    )
