"""Decode attention over a paged KV cache (Triton): one query token per sequence, keys/values gathered
through the sequence's block table.

Layout (see kernels/reference.py): K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
token ``p`` of a sequence lives in block ``block_tables[b, p // block_size]`` at offset ``p % block_size``.

Design, and why:
- One program per (KV head, sequence[, partition]) handles all ``group = heads // kv_heads`` query heads of
  that KV head as the rows of one small matrix, so every K/V byte is read from memory once (GQA/MQA).
- Keys are visited in tiles of ``tile_n`` positions, independent of the block size: each tile gathers the
  block id of each of its positions, so a tile can span several small blocks (block 16 reads as well as 128).
- Online softmax in base 2 (``exp2`` with the scale folded in ``log2(e)``): one pass over K and V.
- Split-K: for few programs per SM and long contexts, each program covers one partition of ``partition``
  positions and writes (max, sum, unnormalized output); a second kernel merges the partitions. The
  partition count comes from ``block_tables.shape[1]`` (host-known), so nothing waits on the device.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters (tuned on an H200 by benchmarks/decode_kernel.py --sweep; see docs/KERNELS_NOTES.md)."""

    tile_n: int = 64  # key positions per loop step
    partition: int = 512  # key positions per split-K program (a multiple of tile_n)
    split_programs_per_sm: int = 4  # split when (sequences x kv heads) < this x SMs
    num_warps: int = 4
    num_stages: int = 3


CONFIG = DecodeConfig()


@triton.jit
def kv_tile_offsets(table_row_ptr, pos, kv_head, dims, stride_block, stride_token, stride_head,
                    BLOCK_SIZE: tl.constexpr, mask):
    """Element offsets ``[len(pos), len(dims)]`` of positions ``pos`` of one sequence for one KV head:
    ``block_id * stride_block + (pos % block_size) * stride_token + kv_head * stride_head + dim``."""
    block_ids = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    rows = block_ids * stride_block + (pos % BLOCK_SIZE) * stride_token + kv_head * stride_head
    return rows[:, None] + dims[None, :]


@triton.jit
def _decode_kernel(out_ptr, q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
                   scale_log2, stride_qb, stride_qh, stride_ob, stride_oh, stride_block, stride_token, stride_head,
                   stride_table, num_heads, num_parts,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    kv_head, seq, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    if SPLIT:
        start = part * PARTITION
        end = tl.minimum(start + PARTITION, ctx)
    else:
        start = 0
        end = ctx
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    q_mask = (rows < GROUP)[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + tl.arange(0, TILE_N)
        valid = pos < end
        offs = kv_tile_offsets(table_row, pos, kv_head, dims, stride_block, stride_token, stride_head,
                               BLOCK_SIZE, valid)
        if HEAD_DIM == HEAD_PAD:
            kv_mask = valid[:, None]  # row-only mask keeps the loads 16 bytes wide
        else:
            kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        alpha = tl.exp2(row_max - new_max)  # row_max = -inf on the first tile: alpha = 0
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max
    if SPLIT:  # partials [seq, head, part(, dim)]; empty partitions are never read by the merge
        slot = (seq * num_heads + heads) * num_parts + part
        tl.store(part_max_ptr + slot, row_max, mask=rows < GROUP)
        tl.store(part_sum_ptr + slot, row_sum, mask=rows < GROUP)
        tl.store(part_acc_ptr + slot[:, None] * HEAD_PAD + dims[None, :], acc, mask=(rows < GROUP)[:, None])
    else:
        out = acc / row_sum[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_partitions_kernel(out_ptr, ctx_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, stride_ob, stride_oh,
                             num_heads, num_parts, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                             PARTITION: tl.constexpr, CHUNK: tl.constexpr):
    """out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p over the partitions that hold keys
    (M = max_p m_p), merged CHUNK partitions at a time with the same online rescaling as the main loop."""
    head, seq = tl.program_id(0), tl.program_id(1)
    used = tl.cdiv(tl.load(ctx_ptr + seq), PARTITION)
    base = (seq * num_heads + head) * num_parts
    dims = tl.arange(0, HEAD_PAD)
    total_max = tl.full([1], float("-inf"), tl.float32)
    total_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_PAD], tl.float32)
    for first in range(0, used, CHUNK):
        parts = first + tl.arange(0, CHUNK)
        ok = parts < used
        maxes = tl.load(part_max_ptr + base + parts, mask=ok, other=float("-inf"))
        sums = tl.load(part_sum_ptr + base + parts, mask=ok, other=0.0)
        accs = tl.load(part_acc_ptr + (base + parts)[:, None] * HEAD_PAD + dims[None, :], mask=ok[:, None],
                       other=0.0)
        new_max = tl.maximum(total_max, tl.max(maxes, axis=0))
        alpha = tl.exp2(total_max - new_max)
        weights = tl.exp2(maxes - new_max)  # masked partitions: 2^-inf = 0
        total_sum = total_sum * alpha + tl.sum(weights * sums, axis=0)
        acc = acc * alpha + tl.sum(weights[:, None] * accs, axis=0)
        total_max = new_max
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, (acc / total_sum).to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (host-side property; the interpreter gets a Hopper-like 132)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots in full precision (tf32 would cost ~3e-4 relative error); half types run on tensor cores anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def choose_partitions(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device,
                      config: DecodeConfig, split: bool | None) -> int:
    """Number of split-K partitions (1 = no split). ``max_tokens`` bounds every context from the block
    table's width, so the choice needs no device sync; partitions past a sequence's end exit at once."""
    parts = triton.cdiv(max_tokens, config.partition)
    if split is None:
        split = batch * num_kv_heads < config.split_programs_per_sm * num_sms(device)
    return parts if split and parts > 1 else 1


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                    split: bool | None = None, config: DecodeConfig | None = None) -> None:
    """Same contract as ``reference.paged_attention``; ``split`` forces split-K on/off (None: automatic)."""
    config = config or CONFIG
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "K and V: same layout, dim contiguous"
    assert query.stride(-1) == 1 and out.stride(-1) == 1
    group = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_dim)
    parts = choose_partitions(batch, num_kv_heads, block_tables.shape[1] * block_size, query.device, config, split)
    if parts > 1:  # the split path needs tile-aligned partitions
        config = replace(config, partition=triton.cdiv(config.partition, config.tile_n) * config.tile_n)
    part_max = part_sum = part_acc = out  # placeholders: never touched when not split
    if parts > 1:
        part_max = torch.empty(batch, num_heads, parts, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(batch, num_heads, parts, head_pad, dtype=torch.float32, device=query.device)
    _decode_kernel[(num_kv_heads, batch, parts)](
        out, query, k_cache, v_cache, block_tables, context_lens, part_max, part_sum, part_acc,
        scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), num_heads, parts,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE_N=config.tile_n, PARTITION=config.partition, SPLIT=parts > 1,
        DOT_PRECISION=dot_precision(query.dtype), num_warps=config.num_warps, num_stages=config.num_stages)
    if parts > 1:
        _merge_partitions_kernel[(num_heads, batch)](
            out, context_lens, part_max, part_sum, part_acc, out.stride(0), out.stride(1), num_heads, parts,
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, PARTITION=config.partition, CHUNK=16, num_warps=4)
