"""Decode attention over a paged KV cache (Triton): one query token per sequence, keys/values gathered
through the sequence's block table.

Layout (see kernels/reference.py): K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
token ``p`` of a sequence lives in block ``block_tables[b, p // block_size]`` at offset ``p % block_size``.
With ``CONTIGUOUS`` (kernels/contiguous_attention.py, the vAttention layout) the same kernel reads
``[num_slots, max_len, ...]`` caches at ``slot_ids[b]``, position ``p``: no block table.

Design, and why:
- One program per (KV head, sequence[, partition]) handles all ``group = heads // kv_heads`` query heads of
  that KV head as the rows of one small matrix, so every K/V byte is read from memory once (GQA/MQA).
- Keys are visited in tiles of ``tile_n`` positions, independent of the block size: each tile gathers the
  block id of each of its positions, so a tile can span several small blocks (block 16 reads as well as 128).
- Online softmax in base 2 (``exp2`` with the scale folded in ``log2(e)``): one pass over K and V.
- Split-K: when (sequences x KV heads) programs leave SMs idle, each program covers one partition of
  the context and writes (max, sum, unnormalized output) for its heads; the last partition of a (sequence,
  KV head) to finish (an atomic counter) merges them in the same launch, so split-K costs no second kernel.
  The counters reset themselves after use (one launch at a time per device: the engine's single stream).
  The partition count comes from ``block_tables.shape[1]`` (contiguous: the slot length), host-known, so
  nothing waits on the device; each sequence then spreads its own context over all of them (whole tiles), so
  a short context under a long table (a CUDA graph's, sized for ``max_model_len``) still gets as many
  programs as it has tiles, not the one or two a partition sized for the table would give it.
- FP8 cache (``KV_FP8``, a constexpr from the cache's dtype: other caches compile exactly as before): K and V
  tiles are loaded as e4m3 and widened to the query's dtype (exact: e4m3 has 3 mantissa bits), the dots run as
  for that dtype, and the scales are applied outside the loop: ``k_scale`` folded into the softmax scale on the
  host, ``v_scale`` once on the accumulated output (attention is linear in V). A bfloat16 query is taken to
  float16 first (``Q_TO_F16``): e4m3 widens to float16 in one instruction on Ada and Hopper, to bfloat16 only
  by way of float32, which kept the kernel at ~60% of the copy bandwidth. float16 holds every e4m3 value and
  gives q and the probabilities 3 more mantissa bits; only a |q| over 65504 would not fit.
- Launched without programmatic dependent launch (kernels/pdl.py), unlike the step's small kernels: it starts
  when the kernel before it has finished, and the one after it when it has. With PDL, llama-3.2-1b's decode step
  at 32 sequences of 8,000 positions took 3.16 ms against 2.99 (this kernel 2.18 against 2.05 ms of it), and two
  of these kernels back to back (32 x 8K, head 128) 0.337 against 0.250 ms; a step at one sequence gained nothing
  from it (0.849 against 0.846 ms). docs/BENCHMARKS.md, "Decode-kernel roofline".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.counters import zeroed_counters
from kernels.device_features import num_sms
from kernels.reference import FP8
from kernels.specialization import per_step

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters (tuned on an H200 by benchmarks/kernel/decode_attention.py --sweep; see
    docs/KERNELS_NOTES.md)."""

    tile_n: int = 128  # key positions per loop step, one-pass kernel
    # ... where the head is at most 64 wide in a 16-bit cache (3 stages of these tiles still fit shared memory)
    small_head_tile_n: int = 256
    split_tile_n: int = 64  # key positions per loop step, split-K kernel
    # split-K only when (sequences x kv heads) < this x SMs
    split_below_programs_per_sm: float = 1.0
    # rows read through the step's longest-first order (``order``) where the head is wider than 64, or
    # (sequences x kv heads) < this x SMs: a launch of a few waves ends with its longest rows, not a tail of them
    ordered_below_programs_per_sm: float = 6.0
    programs_per_sm: int = 2  # then aim for this many programs per SM ...
    min_partition: int = 512  # ... with partitions of at least this many positions
    num_warps: int = 4
    num_stages: int = 3


CONFIG = DecodeConfig()


@triton.jit
def kv_tile_offsets(
    table_row_ptr,
    pos,
    kv_head,
    dims,
    stride_block,
    stride_token,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    mask,
    CONTIGUOUS: tl.constexpr,
):
    """Element offsets ``[len(pos), len(dims)]`` of positions ``pos`` of one sequence for one KV head.
    Paged: ``block_id * stride_block + (pos % block_size) * stride_token + kv_head * stride_head + dim``.
    CONTIGUOUS: ``pos * stride_token + kv_head * stride_head + dim`` from the sequence's slot base (see
    ``sequence_kv``): plain strided offsets, as for a dense tensor, so the loads are as wide as the layout allows."""
    if CONTIGUOUS:
        rows = pos * stride_token + kv_head * stride_head
    else:
        block_ids = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
        rows = block_ids * stride_block + (pos % BLOCK_SIZE) * stride_token + kv_head * stride_head
    return rows[:, None] + dims[None, :]


@triton.jit
def sequence_kv(k_ptr, v_ptr, table_row_ptr, stride_block, CONTIGUOUS: tl.constexpr):
    """K and V base pointers of one sequence: its slot's start (``slot * stride_block``, int64: a slot's start
    can pass 2^31 elements) when CONTIGUOUS (``table_row_ptr`` points at the slot id), else the cache's."""
    if CONTIGUOUS:
        base = tl.load(table_row_ptr).to(tl.int64) * stride_block
        return k_ptr + base, v_ptr + base
    return k_ptr, v_ptr


@triton.jit(
    **per_step(
        "table_ptr",
        "ctx_ptr",
        "window",
        "part_max_ptr",
        "part_sum_ptr",
        "counter_ptr",
        "stride_table",
        "num_parts",
        "order_ptr",
    )
)
def _decode_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    ctx_ptr,
    order_ptr,
    window,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    counter_ptr,
    scale_log2,
    v_scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_block,
    stride_token,
    stride_head,
    stride_table,
    num_kv_heads,
    num_parts,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    KV_FP8: tl.constexpr,
    Q_TO_F16: tl.constexpr,
    ORDERED: tl.constexpr,
):
    kv_head, seq, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if ORDERED:  # programs start in grid order: the row this one serves, longest contexts first
        seq = tl.load(order_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_PAD)
    q = tl.load(
        q_ptr + seq * stride_qb + (kv_head * GROUP + rows)[:, None] * stride_qh + dims[None, :],
        mask=(rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    if Q_TO_F16:
        q = q.to(tl.float16)  # (K, V and the probabilities follow q's dtype)
    ctx = tl.load(ctx_ptr + seq)
    decode_task(
        q,
        kv_head,
        seq,
        part,
        out_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        ctx,
        tl.where(window > 0, tl.maximum(ctx - window, 0), 0),
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        counter_ptr,
        scale_log2,
        v_scale,
        stride_ob,
        stride_oh,
        stride_block,
        stride_token,
        stride_head,
        stride_table,
        num_kv_heads,
        num_parts,
        GROUP,
        GROUP_PAD,
        GROUP_POW2,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_SIZE,
        TILE_N,
        SPLIT,
        MERGE_CHUNK,
        DOT_PRECISION,
        CONTIGUOUS,
        KV_FP8,
        1,
    )


@triton.jit
def partition_bounds(ctx, part, num_parts, TILE_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """Key positions ``start .. end - 1`` of partition ``part`` of a context of ``ctx`` split ``num_parts``
    ways, and the partition's length: the sequence's own context over all of the launch's partitions, in whole
    tiles of at least ``MIN_TILES`` (a short context in a launch sized for the longest still spreads over as
    many programs as it has tiles; partitions past the context are empty)."""
    partition = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_parts), TILE_N), MIN_TILES) * TILE_N
    start = part * partition
    return start, tl.minimum(start + partition, ctx), partition


@triton.jit
def decode_task(
    q,
    kv_head,
    seq,
    part,
    out_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    ctx,
    first,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    counter_ptr,
    scale_log2,
    v_scale,
    stride_ob,
    stride_oh,
    stride_block,
    stride_token,
    stride_head,
    stride_table,
    num_kv_heads,
    num_parts,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    KV_FP8: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    """One (KV head, sequence[, partition]) of decode attention for the query rows ``q`` ``[GROUP_PAD,
    HEAD_PAD]`` (that KV head's query heads, loaded by the caller): the one-pass output, or the partition's
    partials and, for the last partition to finish, the merge. A partition is at least ``MIN_TILES`` tiles
    (partitions past the context are empty). The decode kernel runs one a program; the
    persistent decode kernel (kernels/persistent_decode.py) runs them as tasks of its attention phase.
    ``ctx``: the sequence's context length (loaded by the caller, which may have it early); ``first``: the first
    key position it attends (a sliding-window layer's ``ctx - window``, else 0): partitions split ``first ..
    ctx - 1``."""
    if SPLIT:
        start, end, partition = partition_bounds(ctx - first, part, num_parts, TILE_N, MIN_TILES)
        start += first
        end += first
    else:
        start = first
        end = ctx
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_PAD)
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    k_seq, v_seq = sequence_kv(k_ptr, v_ptr, table_row, stride_block, CONTIGUOUS)
    row_max, row_sum, acc = _attend_range(
        q,
        k_seq,
        v_seq,
        table_row,
        start,
        end,
        kv_head,
        dims,
        scale_log2,
        stride_block,
        stride_token,
        stride_head,
        GROUP_PAD,
        HEAD_DIM,
        HEAD_PAD,
        BLOCK_SIZE,
        TILE_N,
        DOT_PRECISION,
        CONTIGUOUS,
        KV_FP8,
    )
    if KV_FP8:
        acc = acc * v_scale  # (before split-K's partials: the merge is linear in them)
    if SPLIT:
        used = tl.cdiv(ctx - first, partition)
        if part < used:  # partitions past the context hold no keys: they neither count nor write
            num_heads = num_kv_heads * GROUP
            slot = (seq * num_heads + heads) * num_parts + part  # partials [seq, head, part(, dim)]
            tl.store(part_max_ptr + slot, row_max, mask=rows < GROUP)
            tl.store(part_sum_ptr + slot, row_sum, mask=rows < GROUP)
            tl.store(
                part_acc_ptr + slot[:, None] * HEAD_PAD + dims[None, :],
                acc,
                mask=(rows < GROUP)[:, None],
            )
            tl.debug_barrier()  # every thread's partials are written before the release below
            counter = counter_ptr + seq * num_kv_heads + kv_head
            finished = tl.atomic_add(counter, 1, sem="acq_rel")
            # the last partition merges all of them, then re-arms the counter
            if finished == used - 1:
                tl.store(counter, 0)
                _merge_partitions(
                    out_ptr,
                    part_max_ptr,
                    part_sum_ptr,
                    part_acc_ptr,
                    seq,
                    kv_head,
                    used,
                    num_heads,
                    num_parts,
                    stride_ob,
                    stride_oh,
                    GROUP,
                    GROUP_POW2,
                    HEAD_DIM,
                    HEAD_PAD,
                    MERGE_CHUNK,
                )
    else:
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@triton.jit
def _attend_range(
    q,
    k_ptr,
    v_ptr,
    table_row,
    start,
    end,
    kv_head,
    dims,
    scale_log2,
    stride_block,
    stride_token,
    stride_head,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax of the query rows ``q`` over key positions ``start .. end - 1``: returns (row max, row
    sum, unnormalized output), all in base 2. KV_FP8: K and V widened to ``q``'s dtype, scales applied by the
    caller."""
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < end
        offs = kv_tile_offsets(
            table_row,
            pos,
            kv_head,
            dims,
            stride_block,
            stride_token,
            stride_head,
            BLOCK_SIZE,
            valid,
            CONTIGUOUS,
        )
        if HEAD_DIM == HEAD_PAD:
            kv_mask = valid[:, None]  # row-only mask keeps the loads 16 bytes wide
        else:
            kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp2(row_max - new_max)  # row_max = -inf on the first tile: alpha = 0
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max
    return row_max, row_sum, acc


@triton.jit
def _merge_partitions(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    seq,
    kv_head,
    used,
    num_heads,
    num_parts,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p over the ``used`` partitions (M = max_p m_p),
    CHUNK partitions at a time with the same online rescaling as the main loop. Loads bypass L1 (``.cg``):
    the partials were written by other programs."""
    rows = tl.arange(0, GROUP_POW2)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_PAD)
    # padding rows (group not a power of two) merge a copy of the last real head and are never stored
    base = (seq * num_heads + kv_head * GROUP + tl.minimum(rows, GROUP - 1)) * num_parts
    total_max = tl.full([GROUP_POW2], float("-inf"), tl.float32)
    total_sum = tl.zeros([GROUP_POW2], tl.float32)
    acc = tl.zeros([GROUP_POW2, HEAD_PAD], tl.float32)
    for first in range(0, used, CHUNK):
        parts = first + tl.arange(0, CHUNK)
        ok = (rows >= 0)[:, None] & (parts < used)[None, :]
        idx = base[:, None] + parts[None, :]
        maxes = tl.load(part_max_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(part_sum_ptr + idx, mask=ok, other=0.0, cache_modifier=".cg")
        accs = tl.load(
            part_acc_ptr + idx[:, :, None] * HEAD_PAD + dims[None, None, :],
            mask=ok[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        new_max = tl.maximum(total_max, tl.max(maxes, axis=1))
        alpha = tl.exp2(total_max - new_max)
        weights = tl.exp2(maxes - new_max[:, None])  # missing partitions: 2^-inf = 0
        total_sum = total_sum * alpha + tl.sum(weights * sums, axis=1)
        acc = acc * alpha[:, None] + tl.sum(weights[:, :, None] * accs, axis=1)
        total_max = new_max
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
        (acc / total_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=(rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :],
    )


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots in full precision (tf32 would cost ~3e-4 relative error); half types run on tensor cores anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def choose_partition(
    programs: int, max_tokens: int, device: torch.device, config: DecodeConfig, split: bool | None
) -> int:
    """Positions per split-K partition of a ``max_tokens`` context, or 0 for the one-pass kernel: the launch
    gets ``max_tokens / partition`` partitions, over which each sequence spreads its own context. ``max_tokens``
    bounds every context (block-table width x block size, or a contiguous slot's length), so the choice needs
    no device sync. Split only when the one-pass grid leaves SMs idle (measured on an H200: at 256 programs
    one-pass already matches SDPA); then enough partitions for ``programs_per_sm`` programs per SM, none shorter
    than ``min_partition`` of ``max_tokens``, each a multiple of the tile."""
    if split is False or (
        split is None and programs >= config.split_below_programs_per_sm * num_sms(device)
    ):
        return 0
    wanted = math.ceil(config.programs_per_sm * num_sms(device) / programs)
    parts = min(wanted, math.ceil(max_tokens / config.min_partition))
    if split is None and parts < 2:
        return 0
    parts = max(parts, 2) if split else parts
    return math.ceil(math.ceil(max_tokens / parts) / config.split_tile_n) * config.split_tile_n


def reads_in_order(
    programs: int, head_pad: int, device: torch.device, config: DecodeConfig
) -> bool:
    """Whether the programs take the rows longest-first. Measured on an H200 at the nano run's own contexts
    (benchmarks.kernel.decode_attention_mixed, 2026-11-30): head 128 (qwen3-0.6b) +1.5 to +12% from 256 rows
    down to 59; head 64 (llama-3.2-1b) -3% at 256 rows, +4 to +6% at 59-100 rows (a few waves of programs)."""
    return head_pad > 64 or programs < config.ordered_below_programs_per_sm * num_sms(device)


SHARED_MEMORY_BYTES = 227 * 1024  # per program on Hopper (H100/H200)


def key_tile(config: DecodeConfig, split: bool, head_pad: int, itemsize: int) -> int:
    """The key positions a program's loop step starts from (``fit_shared_memory`` may shrink them): the split
    kernel's tile, or the one-pass kernel's, twice as wide where the head is at most 64 wide in a 16-bit
    cache (llama-3.2-1b: 3.75 against 3.52 TB/s at 256 sequences of 672 positions on an H200)."""
    if split:
        return config.split_tile_n
    return config.small_head_tile_n if head_pad <= 64 and itemsize <= 2 else config.tile_n


def fit_shared_memory(
    tile: int, stages: int, fixed_rows: int, head_pad: int, itemsize: int
) -> tuple[int, int]:
    """Shrink (key tile, pipeline stages) until ``stages`` K+V tiles plus ``fixed_rows`` query rows fit in
    shared memory: the tuned tiles are for half types and head 128; fp32 or head 256 need smaller ones."""
    while (
        2 * stages * tile + fixed_rows
    ) * head_pad * itemsize > SHARED_MEMORY_BYTES and tile > 16:
        if stages > 2:
            stages -= 1
        else:
            tile //= 2
    return tile, stages


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
    *,
    split: bool | None = None,
    config: DecodeConfig | None = None,
) -> None:
    """Same contract as ``reference.paged_attention``; ``split`` forces split-K on/off (None: automatic)."""
    launch_decode(
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        k_scale,
        v_scale,
        contiguous=False,
        split=split,
        config=config,
        window=window,
        order=order,
    )


def launch_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    *,
    contiguous: bool,
    split: bool | None,
    config: DecodeConfig | None,
    max_context: int = 0,
    window: int = 0,
    order: torch.Tensor | None = None,
) -> None:
    """Launch ``_decode_kernel`` over either layout. Paged: ``table`` is the block tables ``[B, width]`` of a
    ``[num_blocks, block_size, ...]`` cache. Contiguous: ``table`` is the slot ids ``[B]`` of a
    ``[num_slots, max_len, ...]`` cache, and ``max_context`` the host-known bound on every context, rounded
    up to 16 positions as a table of 16-token blocks bounds it (so both layouts split a batch alike). The
    scales apply to an FP8 cache only. ``order`` (int32 ``[>= B]``, a permutation of the rows, longest context
    first): the programs take the rows in that order where ``reads_in_order`` says it pays."""
    config = config or CONFIG
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if batch == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, (
        "K and V: same layout, dim contiguous"
    )
    assert not contiguous or k_cache.shape[1] * k_cache.stride(1) < 2**31, (
        "a slot's offsets are int32"
    )
    assert query.stride(-1) == 1 and out.stride(-1) == 1
    # a constexpr the contiguous path never reads
    block_size = 1 if contiguous else k_cache.shape[1]
    max_tokens = (
        min(-(-max_context // 16) * 16, k_cache.shape[1])
        if contiguous
        else table.shape[1] * block_size
    )
    if window > 0:  # (a sliding-window layer attends at most its window)
        max_tokens = min(max_tokens, window + block_size)
    group = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_dim)
    partition = choose_partition(batch * num_kv_heads, max_tokens, query.device, config, split)
    parts = triton.cdiv(max_tokens, partition) if partition else 1
    group_pad = max(16, triton.next_power_of_2(group))
    tile, stages = fit_shared_memory(
        key_tile(config, partition > 0, head_pad, query.element_size()),
        config.num_stages,
        group_pad,
        head_pad,
        query.element_size(),
    )
    # placeholders: never touched by the one-pass kernel
    part_max = part_sum = part_acc = counters = out
    if partition:  # one allocation for all partials: host time matters at small batch sizes
        partials = torch.empty(
            batch * num_heads * parts * (head_pad + 2), dtype=torch.float32, device=query.device
        )
        part_acc, part_max, part_sum = partials.split(
            [
                partials.numel() - 2 * parts * batch * num_heads,
                parts * batch * num_heads,
                parts * batch * num_heads,
            ]
        )
        counters = zeroed_counters("decode", query.device, batch * num_kv_heads)
    kv_fp8 = k_cache.dtype == FP8
    ordered = order is not None and reads_in_order(
        batch * num_kv_heads, head_pad, query.device, config
    )
    _decode_kernel[(num_kv_heads, batch, parts)](
        out,
        query,
        k_cache,
        v_cache,
        table,
        context_lens,
        order if ordered else context_lens,  # (a placeholder, never read unordered)
        window,
        part_max,
        part_sum,
        part_acc,
        counters,
        scale * LOG2E * (k_scale if kv_fp8 else 1.0),
        v_scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        table.stride(0),
        num_kv_heads,
        parts,
        GROUP=group,
        GROUP_PAD=group_pad,
        GROUP_POW2=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile,
        SPLIT=partition > 0,
        MERGE_CHUNK=8,
        DOT_PRECISION=dot_precision(query.dtype),
        CONTIGUOUS=contiguous,
        KV_FP8=kv_fp8,
        Q_TO_F16=kv_fp8 and query.dtype == torch.bfloat16,
        ORDERED=ordered,
        num_warps=config.num_warps,
        num_stages=stages,
    )
