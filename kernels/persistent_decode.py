"""Persistent decode (Triton): every decoder layer of a llama-family model, for one decode step of at most 16
sequences, in ONE launch (issue 26; the experiment that measured the idea first: benchmarks/persistent_chain.py).

Contract (that of ``reference.persistent_decode``): ``h`` ``[M, hidden]`` is the residual stream entering the
first layer (the embeddings); on return it holds the stream after the last layer, before the model's final norm.
Each layer is the engine's layer path (engine/models/llama.py: RMSNorm, qkv, rotary with the KV store,
paged decode attention, o + residual, RMSNorm, gate/up + SiLU-and-mul, down + residual), with the same roundings;
the new tokens' K and V are written into the paged caches at ``slot_mapping`` (-1: padding, nothing written).
Only the norms differ: ``norm(x) @ W`` is computed as ``(round(x * weight) @ W) / rms(x)``, the 1/rms applied to
the projection's fp32 sums (one rounding moved; within the layer path's own bf16 error, tests/gpu), and the
sums of squares are added per 64-column block, then over the blocks. A result never depends on timing (every
sum has a fixed order).

Design, and why:
- One program per SM, all resident (a cooperative launch on CUDA: it fails instead of hanging when they do not
  fit). Five phases a layer: qkv | attention (+ rotary and the KV store) | o (+ residual) | gate/up (+ SiLU) |
  down (+ residual). No grid-wide barrier separates them (one, an arrival counter and a spin on it, ~1 us
  on an H100, follows the first layer's weighing): a task waits only for the writers of what it reads, on a
  counter they raise (release) and it reads (acquire). An attention task waits for its KV head's qkv tasks, an
  o task for the KV heads its K split reads, gate/up for o's 32 column blocks, a down task for the gate/up
  blocks of its K split, the next layer for down's 32 blocks. Every writer of a buffer depends, through
  these waits, on every reader of the buffer's previous contents, so nothing is overwritten early. Measured
  against grid barriers: o per KV head 1.00–1.02x at 1–16 rows (``o_waits_on_heads``); gate/up, down and the
  next qkv 1.7–3.2% a launch at 1–16 rows (thirteenth session).
- A matmul phase's tasks (column block, K split) go round-robin over the programs; split-K merges as
  kernels/skinny_gemm.py's does (the last split of a column block adds the fp32 partials in split order), and the
  writer of a block also runs the phase's epilogue for it.
- The qkv phase has no writer: its tasks (a head, a K split) only leave fp32 partials, and each attention task
  adds those of its own heads in split order, scales them by 1/rms, rotates q, and, when its partition ends the
  context, rotates k and stores the new K and V where its own loop then reads them. The merge's chain (a
  counter's round trip, the partials' reload, the epilogue) left the qkv phase; with the grid barrier after qkv
  replaced by the per-KV-head wait, 2.0–2.4% a launch at 1–16 rows (thirteenth session; alone, the merge
  gained 0–1.1% and the wait -0.6 to 2.3%).
- A norm is no phase of its own: the writer of each column block of the stream (the o and down residual adds)
  also leaves the block's sums of squares and the block times the next norm's weight (``_weigh``); the next
  matmul phase reads that copy as it is, and its writers scale their fp32 sums by 1/rms, which every program
  gets from the sums of squares (one L2 read a phase). Only the first layer's input, which no writer produced,
  is weighed in a phase of its own. Measured against a norm phase of its own (a barrier and ~1 us each, 32 a
  step): the same at one row (0.963 against 0.965 ms), 1.04x against 1.01x the layer path at four rows, 1.01x
  against 0.97x at eight; normalizing inside the matmul's loop (x transformed between its load and the dot)
  cost ~0.19 ms a step.
- Attention tasks are (KV head, sequence, partition) of ``paged_attention.decode_task``: the decode kernel's own
  code, split-K with its in-launch merge. At most one task a program (a second round costs a whole task's
  latency), partitions of at least two 64-position tiles (fewer partials to merge): measured best from one row
  to eight (benchmarks/persistent_decode.py ``--attention-parts``). With one partition a sequence (nine rows
  and more) a task writes its output directly, with no partials, counter or merge; and each program loads its
  first task's context length once a launch, not once a layer (twelfth session: attention 15.1 -> 13.1 us at
  16 rows, 2.5% a launch; 0.6% at one and four rows).
- Before a program waits for the next phase it asks L2 for the first ``prefetch_k`` elements of the weight
  rows of its next matmul task: weights never depend on activations, so HBM keeps streaming while it waits.
  Attention leaves HBM nearly idle (a chain of round trips over ~1.4 MB of KV a layer at one row): once its
  attention tasks are done, a program also asks L2 for the first ``bubble_gate_up_k`` elements of its gate/up
  task's rows (no eviction hint: lines kept evict_last pile up over a launch). Measured 1.7–1.8% at 1–4 rows,
  0.5–0.8% at 16 (tenth session); deeper, 512–1024, wins at one row and loses at 4 and 16, so one row asks
  for 512 (``bubble_gate_up_k_one_row``).
- The qkv phase has 96 tasks for 132 programs: while it runs, the 36 left idle ask L2 for the first
  ``kv_prefetch`` (64) positions of every attention task's K and V, which attention then finds there
  (eleventh session: 5.4 against 6.4 us at one row; 0.5–1.7% a launch at 1–16 rows). Asked by each attention
  task's own program before the barrier instead, the asking delays the barrier; deeper, at 16 rows the
  22 MB of KV compete with the weights. (A stream-K qkv, which leaves no program idle, lost 3–4%:
  thirteenth session.)
- A writer's epilogue operands that no matmul feeds (the sums of squares behind 1/rms, the stream block and
  the norm weight of ``_add_residual``, rotary's cos and sin) are loaded before its matmul loop and used
  after it: their L2 round trips hide under the weight stream instead of following the split-K merge
  (0.25–0.5 us a matmul phase at one row, 2% a launch; eleventh session).
- A profile (``trace``, ``benchmarks/persistent_decode.py --trace``): each program stamps the GPU's ns timer
  at each phase's end and after each wait; the benchmark gives each segment its share of the critical
  path. At one row a layer takes ~53 us (thirteenth session): qkv 5.6 (12.6 MB: 2.2 TB/s), attention 6.1–6.4
  (its wait for qkv included), o 4.9 (8.4 MB), a wait 0.5, gate/up 22.3 (67 MB: 3.0 TB/s), down 12.3–12.5
  (33.5 MB: 2.7 TB/s), a wait 0.5. The three small segments around attention are where the time is lost.
- Everything another program wrote in this launch is loaded past L1 (``.cg``); weights and caches are addressed
  from one base pointer plus 16-byte-aligned offsets (kernels/decoder_stack.py), which keeps loads vectorized.
- In Triton's CPU interpreter, which runs programs one after another, a barrier over several programs would wait
  forever: there the kernel runs as one program, which takes every task (tests/kernels/test_persistent_decode.py).

Measured on an H100 (benchmarks/persistent_decode.py, docs/BENCHMARKS.md, thirteenth session): llama-3.2-1b's
16 layers and final norm at context 700 take 0.860–0.870 ms against 1.007 ms for the engine's launches at one
sequence, 1.018–1.025 against 1.175 ms at 16. The engine takes it for decode passes of up to 16 rows
(engine/models/llama_persistent.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.counters import zeroed_counters
from kernels.decoder_stack import DecoderStack
from kernels.device_features import num_sms
from kernels.paged_attention import LOG2E, decode_task, dot_precision, partition_bounds
from kernels.pdl import prefetch_l2
from kernels.rotary import _TL_DTYPE
from kernels.skinny_gemm import store_out, sum_partials

QKV, O, GATE_UP, DOWN, NORM_IN, NORM_POST = range(6)  # columns of the weight table


@dataclass(frozen=True, slots=True)
class PersistentConfig:
    """Split-K of each matmul phase, tiles, prefetch depth (measured: benchmarks/persistent_chain.py)."""

    qkv_splits: int = 2
    o_splits: int = 4
    gate_up_splits: int = 1
    down_splits: int = 4
    block_n: int = 64  # o, gate/up, down (qkv: the head dim)
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 5
    prefetch_k: int = 256  # weight-row elements asked of L2 before each barrier; 0: none
    tile_n: int = 64  # attention: key positions per loop step
    # partitions of each context (split-K); 0: as many tasks as programs, at most (a second round of tasks
    # costs a whole task's latency)
    attention_parts: int = 0
    attention_min_tiles: int = 2  # a partition's least length, in tiles (fewer partials to merge)
    programs: int = 0  # 0: one per SM
    # the o phase waits per KV head (a counter its attention tasks raise) instead of at a grid barrier
    o_waits_on_heads: bool = True
    # the first elements of each gate/up row asked of L2 (no hint) by the program that reads them once its
    # attention tasks are done (HBM is idle in attention); 0: none. One row has the longest idle window
    # (least KV): deeper there (512 against 256: -0.05 to -1.6% in five calls; +0.7% at 4 rows, +1.7% at 16)
    bubble_gate_up_k: int = 256
    bubble_gate_up_k_one_row: int = 512
    # the first positions of K and V of every attention task asked of L2 (no hint) by the programs that
    # the qkv phase leaves idle, while it runs; 0: none
    kv_prefetch: int = 64


@triton.jit
def _spin_until(counter_ptr, target):
    """Spin until the counter reaches ``target`` (acquire: what its raisers wrote before raising it is seen
    by this thread)."""
    while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
        pass


@triton.jit
def _count_done(counter_ptr):
    """Raise the counter by one (release) once every thread of the program has made its stores: whoever
    then sees the count (``_wait_for_count``) sees what the program wrote."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait_for_count(counter_ptr, target):
    """Wait until the counter reaches ``target``; then every thread of the program sees what its raisers
    wrote."""
    _spin_until(counter_ptr, target)
    tl.debug_barrier()


@triton.jit
def grid_barrier(counter_ptr, target):
    """Every program waits here until ``target`` arrivals are counted (release: its writes are seen first).
    ~1.05 us on an H100 (132 programs, benchmarks/persistent_chain.py). Two other forms measured slower: a spin
    on plain (volatile) loads, then one acquire (~1.26 us); a slot per program, written by its owner and read
    by all in one vector load (~1.5 us)."""
    _count_done(counter_ptr)
    _spin_until(counter_ptr, target)
    tl.debug_barrier()


# the trace's slots a layer (``_stamp``; the kernel spells it 9; benchmarks/persistent_decode.py --trace)
STAMPS_PER_LAYER = 9


@triton.jit
def _stamp(trace_ptr, pid, slot, layers, TRACE: tl.constexpr):
    """With TRACE, when this program got here (the GPU's nanosecond timer) into ``trace[pid, slot]``
    (``[programs, 2 + 9 * layers]`` int64), once every warp of the program is here; without TRACE nothing is
    compiled."""
    if TRACE:
        tl.debug_barrier()
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64,
                                        is_pure=False, pack=1)  # fmt: skip
        tl.store(trace_ptr + pid * (2 + 9 * layers) + slot, now)


@triton.jit
def _load_squares(squares_ptr, BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The sums of squares ``[BLOCKS, BLOCK_M]`` that the writers of the stream's column blocks left
    (``_add_residual``): one L2 round trip, issued before a matmul loop and used after it (``_rstd``)."""
    ptrs = squares_ptr + tl.arange(0, BLOCKS)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    return tl.load(ptrs, cache_modifier=".cg")


@triton.jit
def _rstd(squares, eps, H: tl.constexpr):
    """``1 / rms`` of each row from its sums of squares per column block, added in block order."""
    return tl.rsqrt(tl.sum(squares, axis=0) / H + eps)


@triton.jit
def _weigh(stream, squares_ptr, gamma, weighted_ptr, M, block, H: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Column block ``block`` of the stream (``stream``, ``[BLOCK_N, BLOCK_M]``, rounded as stored), for the
    next norm: each row's sum of squares over the block, and ``round(stream * gamma)`` (``gamma``: the norm's
    weight over the block, fp32; its 1/rms, known only once every block is written, scales the next
    projection's output)."""
    rows = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    value = stream.to(tl.float32)
    tl.store(squares_ptr + block * BLOCK_M + rows, tl.sum(value * value, axis=0))
    tl.store(weighted_ptr + rows[None, :] * H + cols[:, None], (value * gamma[:, None]).to(stream.dtype),
             mask=(rows < M)[None, :])  # fmt: skip


@triton.jit
def _weigh_phase(h_ptr, squares_ptr, gamma_ptr, weighted_ptr, M, pid, programs, H: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """``_weigh`` for every column block of the stream entering the first layer, which no writer produced."""
    rows = tl.arange(0, BLOCK_M)
    for block in range(pid, H // BLOCK_N, programs):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = h_ptr + rows[None, :] * H + cols[:, None]
        stream = tl.load(ptrs, mask=(rows < M)[None, :], other=0.0, cache_modifier=".cg")
        gamma = tl.load(gamma_ptr + cols).to(tl.float32)
        _weigh(stream, squares_ptr, gamma, weighted_ptr, M, block, H, BLOCK_M, BLOCK_N)


@triton.jit
def partial_sums(x_ptr, stride_x, w_ptr, K, n_cols, block, split, M, SPLITS: tl.constexpr,
                 GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Column block ``block``, K split ``split`` of ``x @ w.T`` (GATE_UP: gate rows, then up rows ``n_cols``
    on): ``(gate, up)``, fp32 sums ``[BLOCK_N, BLOCK_M]`` (out.T) over the split's part of K."""
    rows = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    x_rows = x_ptr + rows[:, None] * stride_x
    k_per_split = K // SPLITS
    gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(x_rows + ks, mask=(rows < M)[:, None], other=0.0, cache_modifier=".cg")
        gate = tl.dot(tl.load(w_rows + ks), tl.trans(x), gate, input_precision=DOT_PRECISION)
        if GATE_UP:
            up = tl.dot(tl.load(w_rows + n_cols * K + ks), tl.trans(x), up,
                        input_precision=DOT_PRECISION)  # fmt: skip
    return gate, up


@triton.jit
def store_partial(part_ptr, gate, up, block, split, M, n_cols, GATE_UP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """A split's sums into the partials ``[splits, M, width]`` (width ``2 n_cols`` with GATE_UP: gate, then
    up), as ``sum_partials`` reads them."""
    rows = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    width = 2 * n_cols if GATE_UP else n_cols
    part = part_ptr + split * M * width + rows[None, :] * width + cols[:, None]
    tl.store(part, gate, mask=(rows < M)[None, :])
    if GATE_UP:
        tl.store(part + n_cols, up, mask=(rows < M)[None, :])


@triton.jit
def matmul_task(
    x_ptr,
    stride_x,
    w_ptr,
    K,
    n_cols,
    block,
    split,
    M,
    part_ptr,
    counter_ptr,
    SPLITS: tl.constexpr,
    GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``partial_sums`` and split-K's merge: ``(gate, up, writer)``, the block's fp32 sums ``[BLOCK_N,
    BLOCK_M]`` (out.T) when this task is the one that writes the block (``writer``: no split, or the last
    split to finish)."""
    gate, up = partial_sums(x_ptr, stride_x, w_ptr, K, n_cols, block, split, M, SPLITS, GATE_UP,
                            BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)  # fmt: skip
    writer = block >= 0
    if SPLITS > 1:
        store_partial(part_ptr, gate, up, block, split, M, n_cols, GATE_UP, BLOCK_M, BLOCK_N)
        tl.debug_barrier()  # every thread's partials are written before the release below
        writer = tl.atomic_add(counter_ptr + block, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
        if writer:
            tl.store(counter_ptr + block, 0)  # re-armed for the next layer
            rows = tl.arange(0, BLOCK_M)
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            gate, up = sum_partials(
                part_ptr, rows, cols, M, n_cols, SPLITS, GATE_UP, BLOCK_M, BLOCK_N
            )
    return gate, up, writer


@triton.jit
def _stream_block(h_ptr, gamma_ptr, M, block, H: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """Column block ``block`` of the stream ``[BLOCK_N, BLOCK_M]`` and of the next norm's weight (fp32): what
    ``_add_residual`` needs besides the projection, loaded before its matmul loop (their L2 round trips hide
    under the weight stream instead of following the split-K merge)."""
    rows = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = h_ptr + rows[None, :] * H + cols[:, None]
    stream = tl.load(ptrs, mask=(rows < M)[None, :], other=0.0, cache_modifier=".cg")
    return stream, tl.load(gamma_ptr + cols).to(tl.float32)


@triton.jit
def _add_residual(h_ptr, squares_ptr, weighted_ptr, stream, gamma, total, M, block, H: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """``h[:, block] = round(stream + round(total))`` (``stream``: the block as ``_stream_block`` loaded
    it): the projection's output added to the stream, as the norm kernel's residual add rounds it; then
    ``_weigh`` for the next norm (its weight over the block ``gamma``)."""
    rows = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = h_ptr + rows[None, :] * H + cols[:, None]
    element = h_ptr.dtype.element_ty
    stream = (total.to(element).to(tl.float32) + stream.to(tl.float32)).to(element)
    tl.store(ptrs, stream, mask=(rows < M)[None, :])
    _weigh(stream, squares_ptr, gamma, weighted_ptr, M, block, H, BLOCK_M, BLOCK_N)


@triton.jit
def _row_slots(positions_ptr, slot_ptr, M, BLOCK_M: tl.constexpr):
    """Each row's position and cache slot (int64 ``[1, BLOCK_M]``; padding rows: 0 and -1)."""
    rows = tl.arange(0, BLOCK_M)[None, :]
    position = tl.load(positions_ptr + rows, mask=rows < M, other=0).to(tl.int64)
    return position, tl.load(slot_ptr + rows, mask=rows < M, other=-1).to(tl.int64)


@triton.jit
def _summed_heads(qkv_part_ptr, seq, heads, rstd, cos, sin, rotate, live, M, S_QKV: tl.constexpr,
                  QKV_W: tl.constexpr, HEAD_DIM: tl.constexpr, PRODUCT_DTYPE: tl.constexpr,
                  ELEMENT: tl.constexpr):  # fmt: skip
    """Heads ``heads`` ``[R]`` of row ``seq`` of the qkv output ``[R, HEAD_DIM]``, from the qkv phase's
    split-K partials (added in split order, scaled by the row's ``rstd``), rotated where ``rotate`` (``cos``,
    ``sin``: ``[HEAD_DIM]`` at the row's position, each half's repeated); rows not ``live``: 0. Rounded as the
    layer path rounds them: the projection's output as stored (store_out), then kernels/rotary.py's
    ``_rotate_heads`` (each half's partner, the other half, loaded as well: no shuffle in registers)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    base = qkv_part_ptr + seq * QKV_W + heads[:, None] * HEAD_DIM
    own_ptrs = base + dims[None, :]
    partner_ptrs = base + ((dims + HALF) % HEAD_DIM)[None, :]  # rotate_half's other half
    # (0.0 + ...: the sum starts at zero, as sum_partials' does)
    own = 0.0 + tl.load(own_ptrs, mask=live[:, None], other=0.0, cache_modifier=".cg")
    partner = 0.0 + tl.load(partner_ptrs, mask=live[:, None], other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, S_QKV):
        own += tl.load(own_ptrs + split * M * QKV_W, mask=live[:, None], other=0.0,
                       cache_modifier=".cg")  # fmt: skip
        partner += tl.load(partner_ptrs + split * M * QKV_W, mask=live[:, None], other=0.0,
                           cache_modifier=".cg")  # fmt: skip
    x = (own * rstd).to(ELEMENT)
    a = x.to(tl.float32)
    b = (partner * rstd).to(ELEMENT).to(tl.float32)
    sign = tl.where(dims < HALF, -1.0, 1.0)[None, :]
    # rotate_half(x) = cat(-x2, x1): out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin
    out = (a * cos[None, :]).to(PRODUCT_DTYPE).to(tl.float32) + (sign * b * sin[None, :]).to(
        PRODUCT_DTYPE
    ).to(tl.float32)
    return tl.where(rotate[:, None], out.to(PRODUCT_DTYPE).to(ELEMENT), x)


@triton.jit
def _attention_q(qkv_part_ptr, k_cache, v_cache, kv_head, seq, part, ctx, attn_parts, rstd_rows,
                 position_row, slot_row, cos_ptr, sin_ptr, stride_cos, stride_sin, stride_block,
                 stride_token, stride_head, M, S_QKV: tl.constexpr, NUM_HEADS: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                 GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                 TILE_N: tl.constexpr, MIN_TILES: tl.constexpr, PRODUCT_DTYPE: tl.constexpr,
                 ELEMENT: tl.constexpr):  # fmt: skip
    """An attention task's query rows ``[GROUP_PAD, HEAD_DIM]`` (its KV head's query heads, rotated), from
    the qkv phase's partials; the task whose partition ends the context also stores the row's new K and V
    into the caches first (at its slot; -1: padding, none), where its own loop reads them."""
    HALF: tl.constexpr = HEAD_DIM // 2
    QKV_W: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    at_row = tl.arange(0, BLOCK_M)[None, :] == seq
    rstd = tl.sum(tl.where(tl.arange(0, BLOCK_M) == seq, rstd_rows, 0.0))
    position = tl.sum(tl.where(at_row, position_row, 0))
    dims = tl.arange(0, HEAD_DIM)
    cos = tl.load(cos_ptr + position * stride_cos + dims % HALF).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_sin + dims % HALF).to(tl.float32)
    group_rows = tl.arange(0, GROUP_PAD)
    q = _summed_heads(qkv_part_ptr, seq, kv_head * GROUP + group_rows, rstd, cos, sin,
                      group_rows >= 0, group_rows < GROUP, M, S_QKV, QKV_W, HEAD_DIM, PRODUCT_DTYPE,
                      ELEMENT)  # fmt: skip
    start, end, _ = partition_bounds(ctx, part, attn_parts, TILE_N, MIN_TILES)
    if (end == ctx) & (start < end):
        slot = tl.sum(tl.where(at_row, slot_row, 0))
        pair = tl.arange(0, 2)  # K's head, then V's
        kv = _summed_heads(qkv_part_ptr, seq, NUM_HEADS + kv_head + pair * NUM_KV_HEADS, rstd, cos,
                           sin, pair == 0, pair >= 0, M, S_QKV, QKV_W, HEAD_DIM, PRODUCT_DTYPE,
                           ELEMENT)  # fmt: skip
        at = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_token
        at += kv_head * stride_head + dims[None, :] + 0 * pair[:, None]  # (both rows: one slot)
        which = pair[:, None] + tl.where(slot >= 0, 0, 2)  # (padding: neither)
        tl.store(k_cache + at, kv.to(k_cache.dtype.element_ty), mask=which == 0)
        tl.store(v_cache + at, kv.to(v_cache.dtype.element_ty), mask=which == 1)
        tl.debug_barrier()  # every thread's stores are made before the loop reads the new position
    return q


@triton.jit
def _count_qkv_task(qkv_flags, head, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    GROUP: tl.constexpr):  # fmt: skip
    """A qkv task of head ``head`` is done: counted for the KV head whose attention tasks read it (its query
    heads, its K, its V)."""
    kv_head = tl.where(head < NUM_HEADS, head // GROUP, (head - NUM_HEADS) % NUM_KV_HEADS)
    _count_done(qkv_flags + kv_head)


@triton.jit
def _ask_l2(ptrs, EVICT_LAST: tl.constexpr):
    """Ask L2 for the 128-byte lines at ``ptrs`` (no registers filled): kept evict_last (``prefetch_l2``), or
    with no hint, for lines asked long before their use (evict_last lines, piling up over a launch, made
    deeper prefetches slower: 1.083 against 0.995 ms at 1024 elements a row, M=1)."""
    if EVICT_LAST:
        prefetch_l2(ptrs, True)
    else:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def prefetch_task(w_ptr, K, n_cols, pid, SPLITS: tl.constexpr, GATE_UP: tl.constexpr,
                   BLOCK_N: tl.constexpr, PREFETCH_K: tl.constexpr, LINE: tl.constexpr,
                   EVICT_LAST: tl.constexpr):  # fmt: skip
    """Ask L2 for the first ``PREFETCH_K`` elements of the weight rows of this program's first task of a
    matmul phase (task ``pid``: column block ``pid // SPLITS``, split ``pid % SPLITS``)."""
    if PREFETCH_K > 0:
        if pid < (n_cols // BLOCK_N) * SPLITS:
            cols = (pid // SPLITS) * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = (pid % SPLITS) * (K // SPLITS) + tl.arange(0, PREFETCH_K // LINE) * LINE
            ptrs = w_ptr + cols.to(tl.int64)[:, None] * K + tl.minimum(ks, K - 1)[None, :]
            _ask_l2(ptrs, EVICT_LAST)
            if GATE_UP:
                _ask_l2(ptrs + n_cols * K, EVICT_LAST)


@triton.jit
def prefetch_kv(k_cache, v_cache, block_table_ptr, ctx_ptr, task, M, attn_parts, stride_table,
                stride_block, stride_token, stride_head, NUM_KV_HEADS: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MIN_TILES: tl.constexpr,
                HEAD_DIM: tl.constexpr, KV_LINES: tl.constexpr, POSITIONS: tl.constexpr):  # fmt: skip
    """Ask L2 (no hint) for the K and V of the first ``POSITIONS`` keys that attention task ``task``
    (``decode_task``'s partition of (KV head, sequence)) reads: rows of the KV head, ``KV_LINES`` 128-byte
    lines each."""
    if task < NUM_KV_HEADS * M * attn_parts:
        kv_head, seq = task % NUM_KV_HEADS, (task // NUM_KV_HEADS) % M
        part = task // (NUM_KV_HEADS * M)
        start, end, _ = partition_bounds(
            tl.load(ctx_ptr + seq), part, attn_parts, TILE_N, MIN_TILES
        )
        end = tl.minimum(end, start + POSITIONS)
        table_row = block_table_ptr + seq.to(tl.int64) * stride_table
        for first in range(start, end, 64):
            pos = tl.minimum(first + tl.arange(0, 64), end - 1)
            block = tl.load(table_row + pos // BLOCK_SIZE).to(tl.int64)
            rows = block * stride_block + (pos % BLOCK_SIZE) * stride_token + kv_head * stride_head
            offs = rows[:, None] + tl.arange(0, KV_LINES)[None, :] * (HEAD_DIM // KV_LINES)
            _ask_l2(k_cache + offs, False)
            _ask_l2(v_cache + offs, False)


@triton.jit
def _wait_for_columns(flags_ptr, target, split, K, SPLITS: tl.constexpr, GROUP_K: tl.constexpr):
    """Wait until the counters of the column groups of the input that K split ``split`` reads (``GROUP_K``
    columns a group: a KV head's outputs for o, a quarter of gate/up's for down) reach ``target`` (acquire:
    their writers' outputs are seen)."""
    k_split = K // SPLITS
    for group in range(split * k_split // GROUP_K, ((split + 1) * k_split - 1) // GROUP_K + 1):
        _spin_until(flags_ptr + group, target)
    tl.debug_barrier()


@triton.jit
def _residual_phase(x_ptr, K, w_ptr, h_ptr, squares_ptr, gamma_ptr, weighted_ptr, part_ptr, counters,
                    M, pid, programs, flags_ptr, flag_target, SPLITS: tl.constexpr, H: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, GROUP_K: tl.constexpr, done_ptr):  # fmt: skip
    """A projection added to the stream (o, down): ``h += x @ w.T``, each column block's writer adding and
    weighing the block for the next norm (``_add_residual``), then counting it done (``done_ptr``, which the
    next phase waits on). GROUP_K > 0: a task first waits for the column groups of x it reads
    (``_wait_for_columns``)."""
    for task in range(pid, (H // BLOCK_N) * SPLITS, programs):
        block = task // SPLITS
        # the writer's operands besides the projection, loaded before the loop (hidden under it)
        stream, gamma = _stream_block(h_ptr, gamma_ptr, M, block, H, BLOCK_M, BLOCK_N)
        if GROUP_K > 0:
            _wait_for_columns(flags_ptr, flag_target, task % SPLITS, K, SPLITS, GROUP_K)
        total, _, writer = matmul_task(x_ptr, K, w_ptr, K, H, block, task % SPLITS, M, part_ptr,
                                       counters, SPLITS, False, BLOCK_M, BLOCK_N, BLOCK_K,
                                       DOT_PRECISION)  # fmt: skip
        if writer:
            _add_residual(h_ptr, squares_ptr, weighted_ptr, stream, gamma, total, M, block, H,
                          BLOCK_M, BLOCK_N)  # fmt: skip
            _count_done(done_ptr)


@triton.jit
def _layer_pointer(base_ptr, table_ptr, layer, which):
    """Tensor ``which`` of the layer: ``base_ptr`` plus its offset from the table, a multiple of 16 bytes
    (kernels/decoder_stack.py checks), which lets the loads be vectorized as for a pointer argument."""
    return base_ptr + tl.multiple_of(tl.load(table_ptr + layer * 8 + which), 8)


@triton.jit
def _persistent_decode_kernel(
    h_ptr,
    qkv_part_ptr,
    attn_ptr,
    act_ptr,
    part_ptr,
    counter_ptr,
    squares_ptr,
    weighted_ptr,
    base_ptr,
    table_ptr,
    positions_ptr,
    slot_ptr,
    block_table_ptr,
    ctx_ptr,
    cos_ptr,
    sin_ptr,
    trace_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    M,
    layers,
    eps,
    scale_log2,
    stride_block,
    stride_token,
    stride_head,
    stride_table,
    stride_cos,
    stride_sin,
    attn_parts,
    H: tl.constexpr,
    I: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_POW2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    ATTENTION_MIN_TILES: tl.constexpr,
    S_QKV: tl.constexpr,
    S_O: tl.constexpr,
    S_GU: tl.constexpr,
    S_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    O_WAITS: tl.constexpr,
    TRACE: tl.constexpr,
    BUBBLE_GU: tl.constexpr,
    KV_PREFETCH: tl.constexpr,
    KV_LINES: tl.constexpr,
    ATTENTION_SPLIT: tl.constexpr,
):
    """All ``layers`` for M rows (see the module docstring). Counters: [0] the barrier's arrivals, [1] exits
    (the last program out re-arms both), then one per column block of the o, gate/up and down phases, then
    one per (sequence, KV head) of attention (room for 16 rows), then two per KV head counting, over the
    launch, its attention tasks done (the o phase's wait) and its qkv tasks done (attention's wait); all
    re-armed by their last user."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    QD: tl.constexpr = NUM_HEADS * HEAD_DIM
    QKV_HEADS: tl.constexpr = NUM_HEADS + 2 * NUM_KV_HEADS
    QKV_W: tl.constexpr = QKV_HEADS * HEAD_DIM
    o_counters = counter_ptr + 2
    gu_counters = o_counters + H // BLOCK_N
    d_counters = gu_counters + I // BLOCK_N
    attn_counters = d_counters + H // BLOCK_N
    head_flags = (
        attn_counters + 16 * NUM_KV_HEADS
    )  # (after the attention counters of 16 rows at most)
    qkv_flags = head_flags + NUM_KV_HEADS
    o_done = qkv_flags + NUM_KV_HEADS
    d_done = o_done + 1
    gu_quarters = d_done + 1
    GU_QUARTER: tl.constexpr = I // BLOCK_N // S_D  # gate/up blocks a down split reads
    rows = tl.arange(0, BLOCK_M)
    _stamp(trace_ptr, pid, 0, layers, TRACE)
    position, slot = _row_slots(positions_ptr, slot_ptr, M, BLOCK_M)
    # the stream entering the first layer, weighed for its first norm
    _weigh_phase(h_ptr, squares_ptr, _layer_pointer(base_ptr, table_ptr, 0, 4), weighted_ptr, M, pid,
                 programs, H, BLOCK_M, BLOCK_N)  # fmt: skip
    prefetch_task(_layer_pointer(base_ptr, table_ptr, 0, 0), H, QKV_W, pid, S_QKV, False, HEAD_DIM,
                  PREFETCH_K, LINE, True)  # fmt: skip
    arrived = programs
    grid_barrier(counter_ptr, arrived)
    _stamp(trace_ptr, pid, 1, layers, TRACE)
    # the context length of this program's first attention task, the same in every layer (loaded once:
    # its round trip left each layer's attention chain)
    first_ctx = tl.load(ctx_ptr + (pid // NUM_KV_HEADS) % M)
    for layer in range(layers):
        at = 2 + layer * 9
        w_qkv = _layer_pointer(base_ptr, table_ptr, layer, 0)
        w_o = _layer_pointer(base_ptr, table_ptr, layer, 1)
        w_gu = _layer_pointer(base_ptr, table_ptr, layer, 2)
        w_d = _layer_pointer(base_ptr, table_ptr, layer, 3)
        norm_post = _layer_pointer(base_ptr, table_ptr, layer, 5)
        norm_next = _layer_pointer(base_ptr, table_ptr, tl.minimum(layer + 1, layers - 1), 4)
        k_cache = _layer_pointer(base_ptr, table_ptr, layer, 6)
        v_cache = _layer_pointer(base_ptr, table_ptr, layer, 7)
        # qkv of the weighed stream: split-K partials, each counted for its KV head (the attention tasks
        # add them up); the sums of squares behind 1/rms, loaded first, are kept for attention
        squares = _load_squares(squares_ptr, H // BLOCK_N, BLOCK_M)
        for task in range(pid, QKV_HEADS * S_QKV, programs):
            head = task // S_QKV
            sums, _ = partial_sums(weighted_ptr, H, w_qkv, H, QKV_W, head, task % S_QKV, M, S_QKV,
                                   False, BLOCK_M, HEAD_DIM, BLOCK_K, DOT_PRECISION)  # fmt: skip
            store_partial(qkv_part_ptr, sums, sums, head, task % S_QKV, M, QKV_W, False, BLOCK_M,
                          HEAD_DIM)  # fmt: skip
            _count_qkv_task(qkv_flags, head, NUM_HEADS, NUM_KV_HEADS, GROUP)
        _stamp(trace_ptr, pid, at, layers, TRACE)
        prefetch_task(w_o, QD, H, pid, S_O, False, BLOCK_N, PREFETCH_K, LINE, True)
        # the programs without a qkv task ask L2 for the start of every attention task's K and V
        if KV_PREFETCH > 0 and pid >= QKV_HEADS * S_QKV:
            for task in range(pid - QKV_HEADS * S_QKV, NUM_KV_HEADS * M * attn_parts,
                              programs - QKV_HEADS * S_QKV):  # fmt: skip
                prefetch_kv(k_cache, v_cache, block_table_ptr, ctx_ptr, task, M, attn_parts,
                            stride_table, stride_block, stride_token, stride_head, NUM_KV_HEADS,
                            BLOCK_SIZE, TILE_N, ATTENTION_MIN_TILES, HEAD_DIM, KV_LINES,
                            KV_PREFETCH)  # fmt: skip
        _stamp(trace_ptr, pid, at + 1, layers, TRACE)  # (no barrier: attention waits per KV head)
        # attention: (KV head, sequence, partition) tasks of the decode kernel's code, each once its KV
        # head's qkv tasks are done
        for task in range(pid, NUM_KV_HEADS * M * attn_parts, programs):
            kv_head, seq = task % NUM_KV_HEADS, (task // NUM_KV_HEADS) % M
            if task == pid:
                ctx = first_ctx
            else:  # (only where attention_parts gives more tasks than programs)
                ctx = tl.load(ctx_ptr + seq)
            _wait_for_count(qkv_flags + kv_head, (layer + 1) * (GROUP + 2) * S_QKV)
            q = _attention_q(qkv_part_ptr, k_cache, v_cache, kv_head, seq, task // (NUM_KV_HEADS * M),
                             ctx, attn_parts, _rstd(squares, eps, H), position, slot, cos_ptr, sin_ptr,
                             stride_cos, stride_sin, stride_block, stride_token, stride_head, M, S_QKV,
                             NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, GROUP, GROUP_PAD, BLOCK_SIZE, BLOCK_M,
                             TILE_N, ATTENTION_MIN_TILES, PRODUCT_DTYPE,
                             h_ptr.dtype.element_ty)  # fmt: skip
            decode_task(q, kv_head, seq, task // (NUM_KV_HEADS * M), attn_ptr, k_cache, v_cache,
                        block_table_ptr, ctx, 0, part_max_ptr, part_sum_ptr, part_acc_ptr,
                        attn_counters, scale_log2, 1.0, QD, HEAD_DIM, stride_block, stride_token,
                        stride_head, stride_table, NUM_KV_HEADS, attn_parts, GROUP, GROUP_PAD,
                        GROUP_POW2, HEAD_DIM, HEAD_DIM, BLOCK_SIZE, TILE_N, ATTENTION_SPLIT, 8,
                        DOT_PRECISION, False, False, ATTENTION_MIN_TILES)  # fmt: skip
            if O_WAITS:
                _count_done(head_flags + kv_head)
        # while attention leaves HBM idle: the first BUBBLE_GU elements of this program's gate/up task's
        # rows, asked of L2 with no hint
        prefetch_task(w_gu, H, I, pid, S_GU, True, BLOCK_N, BUBBLE_GU, LINE, False)
        _stamp(trace_ptr, pid, at + 2, layers, TRACE)
        if not O_WAITS:
            arrived += programs
            grid_barrier(counter_ptr, arrived)
        # o, added to the stream (a task starts once the KV heads it reads are written)
        _residual_phase(attn_ptr, QD, w_o, h_ptr, squares_ptr, norm_post, weighted_ptr, part_ptr,
                        o_counters, M, pid, programs, head_flags, (layer + 1) * M * attn_parts, S_O, H,
                        BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
                        HEAD_DIM * GROUP if O_WAITS else 0, o_done)  # fmt: skip
        _stamp(trace_ptr, pid, at + 3, layers, TRACE)
        prefetch_task(w_gu, H, I, pid, S_GU, True, BLOCK_N, PREFETCH_K, LINE, True)
        _wait_for_count(o_done, (layer + 1) * (H // BLOCK_N))
        _stamp(trace_ptr, pid, at + 4, layers, TRACE)
        # gate/up of the weighed stream, scaled by 1/rms, SiLU-and-mul
        squares = _load_squares(squares_ptr, H // BLOCK_N, BLOCK_M)
        for task in range(pid, (I // BLOCK_N) * S_GU, programs):
            block = task // S_GU
            gate, up, writer = matmul_task(weighted_ptr, H, w_gu, H, I, block, task % S_GU, M,
                                        part_ptr, gu_counters, S_GU, True, BLOCK_M,
                                        BLOCK_N, BLOCK_K, DOT_PRECISION)  # fmt: skip
            if writer:
                rstd = _rstd(squares, eps, H)
                cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
                store_out(
                    act_ptr, gate * rstd[None, :], up * rstd[None, :], rows, cols, M, I, I, True
                )
                _count_done(gu_quarters + block // GU_QUARTER)
        _stamp(trace_ptr, pid, at + 5, layers, TRACE)
        prefetch_task(w_d, I, H, pid, S_D, False, BLOCK_N, PREFETCH_K, LINE, True)
        _stamp(trace_ptr, pid, at + 6, layers, TRACE)
        # down, added to the stream
        _residual_phase(act_ptr, I, w_d, h_ptr, squares_ptr, norm_next, weighted_ptr, part_ptr,
                        d_counters, M, pid, programs, gu_quarters, (layer + 1) * GU_QUARTER, S_D, H,
                        BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, I // S_D, d_done)  # fmt: skip
        _stamp(trace_ptr, pid, at + 7, layers, TRACE)
        if layer + 1 < layers:
            w_next = _layer_pointer(base_ptr, table_ptr, layer + 1, 0)
            prefetch_task(w_next, H, QKV_W, pid, S_QKV, False, HEAD_DIM, PREFETCH_K, LINE, True)
        _wait_for_count(d_done, (layer + 1) * (H // BLOCK_N))
        _stamp(trace_ptr, pid, at + 8, layers, TRACE)
    if tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
        tl.store(counter_ptr, 0)
        tl.store(counter_ptr + 1, 0)
        for head in range(NUM_KV_HEADS):
            tl.store(head_flags + head, 0)
            tl.store(qkv_flags + head, 0)
        tl.store(o_done, 0)
        tl.store(d_done, 0)
        for split in range(S_D):
            tl.store(gu_quarters + split, 0)


def _tiling(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    config: PersistentConfig,
) -> dict[str, bool]:
    """Per matmul phase: whether its K splits into whole ``block_k`` tiles and its columns into whole blocks
    (the qkv phase's block is a head)."""
    phases = {
        "qkv_splits": ((heads + 2 * kv_heads) * head_dim, hidden, config.qkv_splits, head_dim),
        "o_splits": (hidden, heads * head_dim, config.o_splits, config.block_n),
        "gate_up_splits": (intermediate, hidden, config.gate_up_splits, config.block_n),
        "down_splits": (hidden, intermediate, config.down_splits, config.block_n),
    }
    whole = {
        name: splits >= 1 and k % (splits * config.block_k) == 0 and n % block_n == 0
        for name, (n, k, splits, block_n) in phases.items()
    }
    # a down split waits for the gate/up column blocks it reads: whole blocks
    whole["down_splits"] &= intermediate % (max(1, config.down_splits) * config.block_n) == 0
    return whole


def fits(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    config: PersistentConfig,
) -> bool:
    """Whether ``config`` tiles a layer of these sizes (a head dim of 16..256, a power of two)."""
    return (
        16 <= head_dim <= 256
        and head_dim & (head_dim - 1) == 0
        and all(_tiling(hidden, heads, kv_heads, head_dim, intermediate, config).values())
    )


def _bubble_depth(config: PersistentConfig, rows: int) -> int:
    """Elements of each gate/up row asked of L2 while attention runs, for ``rows`` rows."""
    return config.bubble_gate_up_k_one_row if rows == 1 else config.bubble_gate_up_k


def _attention_parts(
    programs: int, rows: int, num_kv_heads: int, max_tokens: int, tile: int
) -> int:
    """Partitions of each sequence's context: at most one (KV head, sequence, partition) task a program, none
    shorter than ``tile`` positions (``decode_task`` sizes them from each sequence's own context)."""
    return max(1, min(programs // (rows * num_kv_heads), triton.cdiv(max_tokens, tile)))


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
    config: PersistentConfig | None = None,
    trace: torch.Tensor | None = None,
) -> None:
    """Same contract as ``reference.persistent_decode``: ``h`` ``[M <= 16, hidden]``, in place. ``trace``
    (CUDA only): int64 ``[programs, 2 + 9 x layers]``, filled with when each program reached each point
    of each layer (``_stamp``; the profile of benchmarks/persistent_decode.py --trace)."""
    config = config or PersistentConfig()
    m, hidden = h.shape
    if not 1 <= m <= 16 or hidden != stack.hidden or h.dtype != stack.layers[0].qkv.dtype:
        raise ValueError(
            f"persistent_decode: h must be [1..16, {stack.hidden}], not {tuple(h.shape)}"
        )
    head_dim, kv_heads, heads = stack.head_dim, stack.num_kv_heads, stack.num_heads
    for name, whole in _tiling(
        hidden, heads, kv_heads, head_dim, stack.intermediate, config
    ).items():
        if not whole:
            raise ValueError(f"PersistentConfig.{name}: does not split the layer into whole tiles")
    device = h.device
    programs = config.programs or (num_sms(device) if device.type == "cuda" else 1)
    cache = stack.layers[0].k_cache
    block_size = cache.shape[1]
    parts = config.attention_parts or _attention_parts(
        programs,
        m,
        kv_heads,
        block_tables.shape[1] * block_size,
        config.tile_n * config.attention_min_tiles,
    )
    slots = (programs, 2 + STAMPS_PER_LAYER * len(stack.layers))
    if trace is not None and (
        trace.dtype != torch.int64 or tuple(trace.shape) != slots or trace.device.type != "cuda"
    ):
        raise ValueError(f"persistent_decode: trace must be a CUDA int64 tensor of shape {slots}")
    qkv_width = (heads + 2 * kv_heads) * head_dim
    f32 = dict(dtype=torch.float32, device=device)
    part = torch.empty(
        m * max(config.o_splits * hidden,
                config.gate_up_splits * 2 * stack.intermediate, config.down_splits * hidden),
        **f32,
    )  # fmt: skip
    attn_partials = torch.empty(m * heads * parts * (head_dim + 2), **f32)
    part_acc, part_max, part_sum = attn_partials.split(
        [m * heads * parts * head_dim, m * heads * parts, m * heads * parts]
    )
    blocks = (2 * hidden + stack.intermediate) // config.block_n
    counters = zeroed_counters(
        "persistent_decode", device, 2 + blocks + 18 * kv_heads + 2 + config.down_splits
    )
    squares = torch.empty(hidden // config.block_n, 16, **f32)
    weighted = torch.empty(m, hidden, dtype=h.dtype, device=device)
    qkv_part = torch.empty(config.qkv_splits * m * qkv_width, **f32)
    attn = torch.empty(m, heads * head_dim, dtype=h.dtype, device=device)
    act = torch.empty(m, stack.intermediate, dtype=h.dtype, device=device)
    extra = dict(launch_cooperative_grid=True) if device.type == "cuda" else {}
    gpu = device.type == "cuda"  # (L2 prefetches are inline PTX: none in the CPU interpreter)
    _persistent_decode_kernel[(programs,)](
        h, qkv_part, attn, act, part, counters, squares, weighted, stack.base, stack.table, positions,
        slot_mapping, block_tables, context_lens, cos_cache, sin_cache,
        h if trace is None else trace, part_max, part_sum, part_acc,
        m, len(stack.layers), stack.eps, scale * LOG2E, cache.stride(0), cache.stride(1),
        cache.stride(2), block_tables.stride(0), cos_cache.stride(0), sin_cache.stride(0), parts,
        H=hidden, I=stack.intermediate, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        GROUP_PAD=max(16, triton.next_power_of_2(heads // kv_heads)),
        GROUP_POW2=triton.next_power_of_2(heads // kv_heads), BLOCK_SIZE=block_size,
        TILE_N=config.tile_n, ATTENTION_MIN_TILES=config.attention_min_tiles,
        S_QKV=config.qkv_splits, S_O=config.o_splits, S_GU=config.gate_up_splits,
        S_D=config.down_splits, BLOCK_M=16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PREFETCH_K=config.prefetch_k if gpu else 0, LINE=128 // h.element_size(),
        PRODUCT_DTYPE=_TL_DTYPE[torch.promote_types(h.dtype, cos_cache.dtype)],
        DOT_PRECISION=dot_precision(h.dtype), O_WAITS=config.o_waits_on_heads,
        TRACE=trace is not None, BUBBLE_GU=_bubble_depth(config, m) if gpu else 0,
        KV_PREFETCH=config.kv_prefetch if gpu else 0, ATTENTION_SPLIT=parts > 1,
        KV_LINES=max(1, head_dim * cache.element_size() // 128),
        num_warps=config.num_warps, num_stages=config.num_stages, **extra,
    )  # fmt: skip
