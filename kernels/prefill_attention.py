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

Hopper (``CHUNK_TMA``, kernels/prefill_chunk.py): the chunk's own keys and values are also passed in as they
left the projection (``chunk_k``/``chunk_v``, ``[num_tokens, kv_heads, head_dim]``, the values ``store_kv`` just
wrote). The query tile and every key tile wholly inside the chunk are then read from those rows through TMA
descriptors (one bulk copy per tile, pipelined), not gathered through the block table. Tiles of the cached
prefix are gathered as before, and the one tile the prefix ends in reads each position from where it lives.
Tiles start at the same positions either way, so the result is the same, bit for bit, as reading everything
from the cache. Measured on an H100: 1x8192 causal 389 -> 522 TFLOP/s (docs/BENCHMARKS.md).

An FP8 cache (``KV_FP8``) is read as in the decode kernel (paged_attention.py): tiles widened to the query's
dtype, ``k_scale`` folded into the softmax scale, ``v_scale`` applied to the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.paged_attention import LOG2E, dot_precision, fit_shared_memory, sequence_kv
from kernels.prefill_chunk import attend, attend_straddling, cached_kv, chunk_descriptors
from kernels.reference import FP8
from kernels.specialization import per_step


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Launch parameters (tuned by benchmarks/prefill_kernel.py --sweep; see docs/KERNELS_NOTES.md)."""

    block_m: int = 128  # query rows per program
    block_n: int = 128  # key positions per loop step
    num_warps: int = 8
    num_stages: int = 3
    # CHUNK_TMA only for passes of at least this many query tokens. Each launch then builds three TMA
    # descriptors on the host; below ~2K tokens the kernel (<= 0.1 ms) is short enough for that to show:
    # 1x2048 with 1024 cached measured 212-327 TFLOP/s through TMA against a steady ~300 from the cache.
    chunk_tma_min_tokens: int = 2048


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
def _attend_windowed(
    q, k, v, row_max, row_sum, acc, pos, rows, prefix, ctx, window, scale_log2,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """``attend`` for a sliding-window layer: row r sees keys ``prefix + r - window + 1 .. prefix + r``. A row may
    see none of a tile's keys (its window starts after it): its maximum stays -inf and adds nothing."""
    if KV_FP8:
        k, v = k.to(q.dtype), v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    query_at = prefix + rows[:, None]
    visible = (pos[None, :] <= query_at) & (pos[None, :] > query_at - window) & (pos < ctx)[None, :]
    scores = tl.where(visible, scores * scale_log2, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    p = tl.exp2(scores - safe[:, None])
    alpha = tl.exp2(row_max - safe)
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, row_sum, acc


@triton.jit(
    **per_step("table_ptr", "cu_ptr", "ctx_ptr", "window", "stride_table", "num_seqs", "num_tiles")
)
def _prefill_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_desc,
    chunk_k_desc,
    chunk_v_desc,
    chunk_k_ptr,
    chunk_v_ptr,
    table_ptr,
    cu_ptr,
    ctx_ptr,
    window,
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
    WINDOWED: tl.constexpr,
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
        if CHUNK_TMA:
            q = q_desc.load([seq_start + first_row, head * HEAD_DIM])
        else:
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
        if WINDOWED:  # every tile from the first key the tile's first row sees, masked
            first_key = tl.maximum(prefix + first_row - window + 1, 0) // BLOCK_N * BLOCK_N
            for start in range(first_key, tl.minimum(prefix + first_row + BLOCK_M, ctx), BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)
                k, v = cached_kv(k_seq, v_seq, table_row, pos, ctx, kv_head, dims, stride_block,
                                 stride_token, stride_head, BLOCK_SIZE, HEAD_DIM, HEAD_PAD, CONTIGUOUS,
                                 True)  # fmt: skip
                # keys before every row's window: p = 0 there, and 0 * a stale value must stay 0
                v = tl.where((pos >= prefix + first_row - window + 1)[:, None], v, 0.0)
                row_max, row_sum, acc = _attend_windowed(
                    q, k, v, row_max, row_sum, acc, pos, rows, prefix, ctx, window, scale_log2,
                    DOT_PRECISION, KV_FP8,
                )  # fmt: skip
            unmasked_end = 0
            cached_end = 0
            diagonal_end = 0
        else:
            unmasked_end = (
                (prefix + first_row) // BLOCK_N * BLOCK_N
            )  # keys every row of the tile sees
            # tiles wholly in the cache: with CHUNK_TMA the prefix's, else every tile
            cached_end = (prefix if CHUNK_TMA else ctx) // BLOCK_N * BLOCK_N
        for start in range(0, tl.minimum(cached_end, unmasked_end), BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k, v = cached_kv(
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
            row_max, row_sum, acc = attend(
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
                row_max, row_sum, acc = attend_straddling(
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
                row_max, row_sum, acc = attend(
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
        if not WINDOWED:
            diagonal_end = tl.minimum(prefix + first_row + BLOCK_M, ctx)
        if CHUNK_TMA:
            diagonal_start = unmasked_end
            if cached_end < prefix and cached_end == unmasked_end:  # the prefix ends in this tile
                row_max, row_sum, acc = attend_straddling(
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
                v = tl.where((pos < ctx)[:, None], v, 0.0)
                row_max, row_sum, acc = attend(
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
                k, v = cached_kv(
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
                row_max, row_sum, acc = attend(
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
    window: int = 0,
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
        window=window,
    )


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
    window: int = 0,
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
    # fp32 dots (not wgmma) take about one more query tile of shared memory than the operands: 262,672 bytes
    # against 232,448 measured at head 64 with 3 stages. Both paths count it, so their key tiles stay equal.
    fixed_rows = config.block_m * (2 if query.dtype == torch.float32 else 1)
    block_n, stages = fit_shared_memory(
        config.block_n, config.num_stages, fixed_rows, head_pad, query.element_size()
    )
    kv_fp8 = k_cache.dtype == FP8
    chunk = (
        chunk_descriptors(query, k_cache, chunk_k, chunk_v, config.block_m, block_n)
        if num_tokens >= config.chunk_tma_min_tokens and window == 0
        else None
    )
    _prefill_kernel[(num_heads, num_tiles)](
        out,
        query,
        k_cache,
        v_cache,
        chunk.query if chunk else None,
        chunk.k if chunk else None,
        chunk.v if chunk else None,
        chunk.k_rows if chunk else k_cache,  # never read without CHUNK_TMA
        chunk.v_rows if chunk else v_cache,
        table,
        cu_seqlens_q,
        context_lens,
        window,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0),
        v_scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        chunk.k_rows.stride(0) if chunk else 0,
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
        CHUNK_TMA=chunk is not None,
        WINDOWED=window > 0,
        num_warps=config.num_warps,
        num_stages=stages,
    )
