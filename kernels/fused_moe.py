"""Mixture-of-experts MLP (Triton): each token through its top-K experts' SwiGLU MLPs, weighted and summed.

Contract (that of ``reference.fused_moe``): ``hidden`` ``[T, H]`` (bf16, fp16 or fp32), ``w_gate_up``
``[E, 2I, H]`` (per expert the gate rows, then the up rows), ``w_down`` ``[E, H, I]``, ``topk_weights`` ``[T, K]``
float32 and ``topk_ids`` ``[T, K]`` int32/int64 (each in ``[0, E)``; the router, ``reference.route``, stays in
torch). Out ``[T, H]`` in hidden's dtype: ``out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``,
``e = topk_ids[t, k]``.

Design, and why (numbers: an H200, bf16, Qwen3-30B-A3B's layer, ``python -m benchmarks.kernel.fused_moe``):
- Three launches, chained with programmatic dependent launch (kernels/pdl.py) on Hopper; no host
  synchronisation anywhere (every size is a bound known on the host), so a CUDA graph holds the whole layer.
- Align (one program): the T*K (token, k) pairs, numbered ``pair = t * K + k``, are grouped by expert and each
  expert's run is padded to a multiple of ``block_m`` rows (padding rows hold the sentinel ``T * K``), so every
  GEMM block of rows belongs to one expert; ``block_experts`` names it (``E`` for blocks past the last run, which
  exit at once). ``rows <= T*K + min(E, T*K) * (block_m - 1)``. An expert no pair chose has no block, so its
  weights are never read: at decode the kernels read only the chosen experts. A pair's rank inside its run
  comes from a one-hot cumsum in registers up to ``REGISTER_PAIRS`` pairs (small decode batches: one global
  round trip), else from atomic counters, whose order varies between runs; each output row's dot products are
  its own, so the result does not.
- Gate/up: a grouped GEMM over the blocks, the hidden rows gathered by token (``pair // K``), gate and up rows of
  the expert streamed together, ``silu(gate) * up`` in fp32 in the epilogue, stored (input dtype) by sorted row.
- Down: the same over the activation rows; the epilogue multiplies by the pair's routing weight and stores the
  row at its pair's place in ``[T*K, H]``; the program that stores a token's last of K rows (an atomic counter
  per token and column block, re-armed by it, as in kernels/skinny_gemm.py's split-K) adds the K rows in k order
  into the output: deterministic, and one launch fewer than a torch sum (2.6 us at one token). With PDL its
  programs fetch the first 64 elements of their weight rows into L2 while gate/up still runs (0.3-0.6 us at 1-8
  tokens; 256 and more cost time). The same prefetch in gate/up while align runs (pair b's expert's rows for
  block b) gained nothing at 256-512 elements and lost up to 7 us at 2048: left out.
- Tiles compute ``out.T = w @ x.T`` (weight rows on the MMA's M side): at decode a block holds 1-2 real tokens
  padded to 16, and this orientation keeps the weight stream on the wide side of the MMA (kernels/skinny_gemm.py
  measured it best for skinny matmuls). The grid runs blocks of rows fastest, so the blocks of one expert
  (consecutive rows) read the same weight tile at about the same time (one read from memory, the rest from L2).
- Launch parameters: ``TABLE`` for measured shapes, else ``heuristic_config`` by tokens per expert;
  ``python -m benchmarks.kernel.fused_moe --sweep`` measures both and prints table entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.counters import zeroed_counters
from kernels.device_features import use_pdl
from kernels.pdl import prefetch_l2, release_next, wait_for_previous
from kernels.specialization import per_step

MAX_EXPERTS = 256
_PAIR_CHUNK = _ROW_CHUNK = 1024  # pairs (counted) and sorted rows (padded) per align step
# up to this many pairs the align program ranks them in registers (a one-hot cumsum over [pairs, E]); measured
# at E = 128: 3.6 us against 3.9 with atomics at 8 pairs, but 9.4 against 5.9 at 128
REGISTER_PAIRS = 32
_ALIGN_WARPS = 8  # 4 and 2 measured no faster at 8 and 128 pairs


@dataclass(frozen=True, slots=True)
class Tile:
    """One grouped GEMM's launch parameters: output columns and reduction elements per step of a program."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    # down only: weight-row elements fetched into L2 while gate/up still runs (PDL); 0: none
    prefetch_k: int = 0

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "prefetch_k"):
            value = getattr(self, name)
            if (value < 16 and not (name == "prefetch_k" and value == 0)) or value & (value - 1):
                raise ValueError(f"Tile.{name}: must be a power of two >= 16, not {value}")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Rows per block (every expert's run is padded to it) and the two GEMMs' tiles; by default the decode
    config."""

    block_m: int = 16
    gate_up: Tile = Tile(64, 128, 4, 4)
    down: Tile = Tile(64, 128, 4, 3, prefetch_k=64)

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"MoeConfig.block_m: must be a power of two >= 16, not {self.block_m}")


# (experts, hidden, intermediate, pairs rounded up to a power of two) -> config, where measured better than the
# heuristic by over 3% (H200, 2026-11-28, ``python -m benchmarks.kernel.fused_moe --sweep`` and graph timings of
# the decode tiles at 1-16 tokens): Qwen3-30B-A3B at 2 tokens, 45.2 us against 47.5.
TABLE: dict[tuple[int, int, int, int], MoeConfig] = {
    (128, 2048, 768, 16): MoeConfig(16, Tile(64, 64, 4, 4), Tile(64, 64, 4, 3, prefetch_k=64)),
}

# The heuristic's tiles: the best of the sweep for Qwen3-30B-A3B at 1 token (decode; 64 x 64 tiles lose 2-5 us
# there), 256 tokens (middle: 313 against 330 us with 64 x 128 tiles) and 2048 (prefill: 706 against 764 us).
DECODE = MoeConfig()
MIDDLE = MoeConfig(block_m=32, gate_up=Tile(64, 64, 4, 3), down=Tile(64, 64, 4, 3))
PREFILL = MoeConfig(block_m=64, gate_up=Tile(64, 64, 4, 3), down=Tile(128, 64, 8, 3))


def heuristic_config(num_pairs: int, num_experts: int) -> MoeConfig:
    """By the mean pairs per expert: under 16 (decode; Qwen3-30B-A3B below 256 tokens) blocks of 16 rows; under
    64, blocks of 32; beyond, 64-row blocks (prefill: the GEMMs are compute-bound)."""
    per_expert = num_pairs / num_experts
    return DECODE if per_expert < 16 else MIDDLE if per_expert < 64 else PREFILL


def choose_config(num_pairs: int, num_experts: int, hidden: int, intermediate: int) -> MoeConfig:
    key = (num_experts, hidden, intermediate, triton.next_power_of_2(num_pairs))
    return TABLE.get(key) or heuristic_config(num_pairs, num_experts)


@dataclass(frozen=True, slots=True)
class Alignment:
    """The (token, k) pairs grouped by expert, in blocks of ``block_m`` rows of one expert each."""

    # [rows] int32: pair ids by expert, each run padded with num_pairs to a multiple of block_m
    sorted_pairs: torch.Tensor
    # [rows // block_m] int32: each block's expert; num_experts for blocks past the runs
    block_experts: torch.Tensor
    block_m: int
    num_pairs: int  # T * K, also the padding rows' sentinel

    @property
    def num_blocks(self) -> int:
        return self.block_experts.numel()


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Bound on the padded rows: each expert that has pairs adds at most ``block_m - 1`` padding rows."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _write_blocks(
    block_expert_ptr,
    sorted_ptr,
    ends,
    num_pairs,
    num_rows,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
):
    """Each block's expert (from the runs' ends) and the padding sentinel in every sorted row."""
    for start in range(0, num_rows // BLOCK_M, BLOCK_CHUNK):
        # a block's expert = the number of runs that end at or before its first row
        blocks = start + tl.arange(0, BLOCK_CHUNK)
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        in_grid = blocks < num_rows // BLOCK_M
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, NUM_EXPERTS), mask=in_grid)
    for start in range(0, num_rows, ROW_CHUNK):
        rows = start + tl.arange(0, ROW_CHUNK)
        padding = tl.zeros([ROW_CHUNK], tl.int32) + num_pairs
        tl.store(sorted_ptr + rows, padding, mask=rows < num_rows)


@triton.jit(**per_step("num_pairs", "num_rows"))
def _align_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    rank_ptr,
    scratch_ptr,
    num_pairs,
    num_rows,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIR_CHUNK: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
    STARTS: tl.constexpr,
    IN_REGISTERS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program. A pair's rank among its expert's pairs: with IN_REGISTERS (all pairs in one chunk) from a
    one-hot cumsum, else from atomic counters in ``scratch`` (zero on entry, re-armed on exit; each expert's
    first sorted row from ``STARTS`` on, so calls with different E never see each other's rows as counts).
    The barriers order the program's own global writes and reads (counts before they are read, padding before
    the scatter)."""
    wait_for_previous(PDL)
    release_next(PDL)
    experts = tl.arange(0, EXPERTS_POW2)
    if IN_REGISTERS:  # the decode path: no global round trip but the ids' load
        pairs = tl.arange(0, PAIR_CHUNK)
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=EXPERTS_POW2)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # padding pairs match no expert
        counts = tl.sum(onehot, axis=0)
        rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
    else:
        for start in range(0, num_pairs, PAIR_CHUNK):
            pairs = start + tl.arange(0, PAIR_CHUNK)
            valid = pairs < num_pairs
            ids = tl.load(ids_ptr + pairs, mask=valid, other=0)
            tl.store(rank_ptr + pairs, tl.atomic_add(scratch_ptr + ids, 1, mask=valid), mask=valid)
        tl.debug_barrier()
        counts = tl.load(scratch_ptr + experts, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # experts past NUM_EXPERTS have no pairs: their runs are empty
    _write_blocks(
        block_expert_ptr,
        sorted_ptr,
        ends,
        num_pairs,
        num_rows,
        NUM_EXPERTS,
        BLOCK_M,
        ROW_CHUNK,
        BLOCK_CHUNK,
    )
    if IN_REGISTERS:
        first = tl.sum(onehot * (ends - padded)[None, :], axis=1)
        tl.debug_barrier()
        tl.store(sorted_ptr + first + rank, pairs, mask=pairs < num_pairs)
    else:
        tl.store(scratch_ptr + STARTS + experts, ends - padded)
        tl.debug_barrier()
        for start in range(0, num_pairs, PAIR_CHUNK):  # each pair to its run's first row + its rank
            pairs = start + tl.arange(0, PAIR_CHUNK)
            valid = pairs < num_pairs
            ids = tl.load(ids_ptr + pairs, mask=valid, other=0)
            first = tl.load(scratch_ptr + STARTS + ids, mask=valid, cache_modifier=".cg")
            rank = tl.load(rank_ptr + pairs, mask=valid, cache_modifier=".cg")
            tl.store(sorted_ptr + first + rank, pairs, mask=valid)
        tl.store(scratch_ptr + experts, tl.zeros([EXPERTS_POW2], tl.int32))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Group the pairs of ``topk_ids`` ``[T, K]`` by expert in blocks of ``block_m`` rows (module docstring)."""
    ids = topk_ids.reshape(-1)
    num_pairs, device = ids.numel(), ids.device
    rows = max_rows(num_pairs, num_experts, block_m)
    experts_pow2 = triton.next_power_of_2(num_experts)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    scratch = zeroed_counters("fused_moe_align", device, 2 * MAX_EXPERTS)
    in_registers = num_pairs <= REGISTER_PAIRS
    _align_kernel[(1,)](
        ids,
        sorted_pairs,
        block_experts,
        ranks,
        scratch,
        num_pairs,
        rows,
        NUM_EXPERTS=num_experts,
        EXPERTS_POW2=experts_pow2,
        BLOCK_M=block_m,
        PAIR_CHUNK=max(16, triton.next_power_of_2(num_pairs)) if in_registers else _PAIR_CHUNK,
        ROW_CHUNK=_ROW_CHUNK,
        BLOCK_CHUNK=max(16, 8192 // experts_pow2),
        STARTS=MAX_EXPERTS,
        IN_REGISTERS=in_registers,
        PDL=(pdl := use_pdl(device)),
        num_warps=_ALIGN_WARPS,
        launch_pdl=pdl,
    )
    return Alignment(sorted_pairs, block_experts, block_m, num_pairs)


@triton.jit
def _expert_product(
    x_ptrs,
    w_ptrs,
    second_offset,
    x_rows,
    w_rows,
    REDUCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TWO: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_M]`` fp32 ``w @ x.T`` over ``REDUCE`` elements; with TWO also the product of the weight
    rows ``second_offset`` further on (the up rows), in the same pass over x."""
    first = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    second = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, REDUCE, BLOCK_K):
        x_mask, w_mask = x_rows, w_rows  # row-only masks keep the loads 16 bytes wide
        if REDUCE % BLOCK_K != 0:
            in_k = (k0 + tl.arange(0, BLOCK_K) < REDUCE)[None, :]
            x_mask, w_mask = x_rows & in_k, w_rows & in_k
        x_t = tl.trans(tl.load(x_ptrs, mask=x_mask, other=0.0))
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        first = tl.dot(w, x_t, first, input_precision=DOT_PRECISION)
        if TWO:
            w2 = tl.load(w_ptrs + second_offset, mask=w_mask, other=0.0)
            second = tl.dot(w2, x_t, second, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return first, second


# the number of tokens (so of pairs) changes every step: one variant for all
@triton.jit(**per_step("num_pairs"))
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    INTER: tl.constexpr,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (block of rows, column block): ``silu(gate) * up`` of the block's pairs for columns ``cols``,
    stored at the block's sorted rows (padding rows: zeros)."""
    wait_for_previous(PDL)  # the alignment is the previous kernel's
    release_next(PDL)
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    tokens = (pairs // TOP_K).to(tl.int64)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    gate, up = _expert_product(
        x_ptrs,
        w_ptrs + ks[None, :],
        INTER * stride_wn,
        (pairs < num_pairs)[:, None],
        (cols < INTER)[:, None],
        HIDDEN,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        True,
        DOT_PRECISION,
    )
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = out_ptr + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=(cols < INTER)[:, None])


@triton.jit
def _sum_finished_tokens(
    part_ptr,
    out_ptr,
    counter_ptr,
    pairs,
    valid,
    cols,
    col_mask,
    stride_pm,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """After this program's rows are stored: count them per (token, column block); the program that stores a
    token's last of K rows adds the K rows in k order (deterministic) into ``out`` and re-arms the counter."""
    tl.debug_barrier()  # every thread's rows are written before the count says so
    tokens = pairs // TOP_K
    counters = counter_ptr + tokens * tl.num_programs(1) + tl.program_id(1)
    last = valid & (tl.atomic_add(counters, 1, mask=valid, sem="acq_rel") == TOP_K - 1)
    mask = col_mask & last[None, :]
    total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.static_range(TOP_K):  # rows other programs wrote: past L1
        rows = part_ptr + (tokens * TOP_K + k).to(tl.int64)[None, :] * stride_pm + cols[:, None]
        total += tl.load(rows, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    out = out_ptr + tokens.to(tl.int64)[None, :] * stride_om + cols[:, None]
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(counters, 0, mask=last)


@triton.jit(**per_step("num_pairs"))
def _down_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    out_ptr,
    counter_ptr,
    sorted_ptr,
    block_expert_ptr,
    routing_ptr,
    num_pairs,
    num_experts,
    stride_xm,
    stride_we,
    stride_wn,
    stride_pm,
    stride_om,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,
):
    """Program (block of rows, column block): the down projection of the block's activation rows times each
    pair's routing weight, stored at the pairs' rows of ``part`` ``[T*K, H]`` (padding rows: nothing), then
    summed per token into ``out`` (``part`` is ``out`` when K = 1). With PDL the block's expert (written by the
    align kernel, which completed before the gate/up kernel started) is known before the wait, and the first
    ``PREFETCH_K`` elements of its weight rows are fetched into L2 while the gate/up kernel runs."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = (cols < HIDDEN)[:, None]
    if PDL and PREFETCH_K > 0:
        early = tl.load(block_expert_ptr + block, cache_modifier=".cg")
        if early < num_experts:
            ks = tl.arange(0, PREFETCH_K // LINE) * LINE
            rows = tl.minimum(cols, HIDDEN - 1).to(tl.int64)[:, None] * stride_wn
            prefetch_l2(w_ptr + early.to(tl.int64) * stride_we + rows + ks[None, :], PDL)
    wait_for_previous(PDL)
    release_next(PDL)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    valid = pairs < num_pairs
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    acc, _ = _expert_product(
        x_ptrs,
        w_ptrs + ks[None, :],
        0,
        valid[:, None],
        col_mask,
        INTER,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        False,
        DOT_PRECISION,
    )
    acc *= tl.load(routing_ptr + pairs, mask=valid, other=0.0)[None, :]
    part = part_ptr + pairs.to(tl.int64)[None, :] * stride_pm + cols[:, None]
    tl.store(part, acc.to(part_ptr.dtype.element_ty), mask=col_mask & valid[None, :])
    if TOP_K > 1:
        _sum_finished_tokens(
            part_ptr,
            out_ptr,
            counter_ptr,
            pairs,
            valid,
            cols,
            col_mask,
            stride_pm,
            stride_om,
            TOP_K,
            BLOCK_M,
            BLOCK_N,
        )


def _check(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    if hidden.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            "fused_moe: hidden [T, H], w_gate_up [E, 2I, H] and w_down [E, H, I] expected"
        )
    (tokens, size), (experts, two_inter, _) = hidden.shape, w_gate_up.shape
    inter = two_inter // 2
    if w_gate_up.shape != (experts, 2 * inter, size) or w_down.shape != (experts, size, inter):
        raise ValueError(
            f"fused_moe: w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not fit "
            f"hidden {size}: [E, 2I, {size}] and [E, {size}, I] expected"
        )
    if size % 16 or inter % 16 or not 0 < experts <= MAX_EXPERTS:
        raise ValueError(
            f"fused_moe: H and I must be multiples of 16 and E in 1..{MAX_EXPERTS}, not H={size}, "
            f"I={inter}, E={experts}"
        )
    if w_gate_up.dtype != hidden.dtype or w_down.dtype != hidden.dtype:
        raise ValueError(f"fused_moe: weights must be {hidden.dtype} like hidden")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, not {topk_ids.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or len(topk_ids) != tokens:
        raise ValueError(f"fused_moe: topk_weights and topk_ids must both be [{tokens}, K]")


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.fused_moe``; ``config`` overrides ``choose_config``'s launch parameters."""
    _check(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    tokens, size = hidden.shape
    experts, inter, top_k = w_gate_up.shape[0], w_down.shape[2], topk_ids.shape[1]
    if topk_ids.numel() == 0:
        return torch.zeros_like(hidden)
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    config = config or choose_config(topk_ids.numel(), experts, size, inter)
    align = moe_align(topk_ids.contiguous(), experts, config.block_m)
    act = _gate_up(hidden, w_gate_up, align, top_k, config.gate_up)
    routing = topk_weights.to(torch.float32).contiguous().view(-1)
    return _down(act, w_down, align, routing, tokens, config.down)


def _prefetch(tile: Tile, row: int, weight: torch.Tensor) -> int:
    """Elements of each weight row to fetch into L2 early: the tile's, within the row, at least one line."""
    line = 128 // weight.element_size()
    return tile.prefetch_k and max(line, min(tile.prefetch_k, triton.next_power_of_2(row)))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 only matters for fp32 inputs


def _gate_up(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, align: Alignment, top_k: int, tile: Tile
) -> torch.Tensor:
    """``silu(gate) * up`` ``[rows, I]`` by sorted row (rows of blocks past the runs: unwritten)."""
    size, inter = hidden.shape[1], w_gate_up.shape[1] // 2
    act = torch.empty(align.sorted_pairs.numel(), inter, dtype=hidden.dtype, device=hidden.device)
    _gate_up_kernel[(align.num_blocks, triton.cdiv(inter, tile.block_n))](
        hidden,
        w_gate_up,
        act,
        align.sorted_pairs,
        align.block_experts,
        align.num_pairs,
        w_gate_up.shape[0],
        hidden.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        act.stride(0),
        INTER=inter,
        HIDDEN=size,
        TOP_K=top_k,
        BLOCK_M=align.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        DOT_PRECISION=_precision(hidden.dtype),
        PDL=(pdl := use_pdl(hidden.device)),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        launch_pdl=pdl,
    )
    return act


def _down(
    act: torch.Tensor,
    w_down: torch.Tensor,
    align: Alignment,
    routing: torch.Tensor,
    tokens: int,
    tile: Tile,
) -> torch.Tensor:
    """The weighted down projections summed per token ``[T, H]`` (each pair's row first into ``[T*K, H]``)."""
    experts, size, inter = w_down.shape
    top_k, device, dtype = align.num_pairs // tokens, act.device, act.dtype
    out = torch.empty(tokens, size, dtype=dtype, device=device)
    part = out if top_k == 1 else torch.empty(align.num_pairs, size, dtype=dtype, device=device)
    col_blocks = triton.cdiv(size, tile.block_n)
    counters = zeroed_counters("fused_moe", device, tokens * col_blocks) if top_k > 1 else out
    pdl, line = use_pdl(device), 128 // w_down.element_size()
    _down_kernel[(align.num_blocks, col_blocks)](
        act,
        w_down,
        part,
        out,
        counters,
        align.sorted_pairs,
        align.block_experts,
        routing,
        align.num_pairs,
        experts,
        act.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        part.stride(0),
        out.stride(0),
        HIDDEN=size,
        INTER=inter,
        TOP_K=top_k,
        BLOCK_M=align.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        DOT_PRECISION=_precision(dtype),
        PDL=pdl,
        PREFETCH_K=_prefetch(tile, inter, w_down),
        LINE=line,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        launch_pdl=pdl,
    )
    return out
