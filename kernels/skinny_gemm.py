"""Small-batch ("skinny") matmul for decode (Triton): ``out = x @ weight.T`` for at most 32 rows of ``x``.

Contract (that of ``reference.skinny_gemm``): ``x`` ``[M, K]``, ``weight`` ``[N, K]`` (nn.Linear's layout), same
dtype; fp32 accumulation, ``out`` ``[M, N]`` in x's dtype. ``skinny_gemm_silu_and_mul`` is the MLP's gate/up
projection fused with its activation: weight ``[2I, K]`` with the gate rows first, ``out = silu(x @ Wg.T) *
(x @ Wu.T)`` ``[M, I]`` (``reference.silu_and_mul``'s layout of the unfused output).

Design, and why:
- At M <= 32 the time is the weight's bytes over memory bandwidth. Each program owns ``block_n`` output columns
  (weight rows) and streams its ``[block_n, K]`` slice of the weight once, ``block_k`` at a time, against all M
  rows of x (a few KiB, L2-resident).
- A tile's product is ``tl.dot(w, x.T)`` with M padded to 16 rows: the weight rows are the dot's M side, so on
  Hopper it is a wgmma (m64n16k16) fed by a cp.async pipeline of ``num_stages`` tiles. Measured on an H100, this
  beat an fp32 multiply-add into a ``[block_n, M, block_k]`` accumulator at every shape, M = 1 included.
- Split-K: with few column blocks (qkv of llama-3.2-1b: 48 blocks of 64 for 132 SMs) ``split_k`` programs share a
  column block, each over its own range of K, and write fp32 partials ``[split_k, M, width]``. The last of them to
  finish (an atomic counter per column block) adds the partials in split order and writes the output: the sum's
  order never depends on timing or load (deterministic, like a two-pass reduction, which measured 1-2 us slower
  for its second launch). The counters reset themselves (one launch at a time per device: the engine's single
  stream).
- Fused SiLU-and-mul: a program takes the gate and the up rows of the same columns and rounds as the unfused pair
  does (gate and up to the output dtype, silu rounded, then the product; kernels/activation.py), so fusing
  changes no bit of an output computed with the same accumulation order.
- Programmatic dependent launch (kernels/pdl.py) on Hopper: a program fetches the first ``prefetch_k`` elements of
  its weight rows into L2 before it waits for the previous kernel (the weights are the one input no kernel of the
  step writes). Measured in the engine's 1-stream decode step on an H100 (docs/BENCHMARKS.md, seventh session):
  one 128-byte line a row (64) is best: 1.191 ms a step, against 1.204 with none, 1.265 with 512 elements, 1.41
  with 1024 and 1.76 with 2048. A longer prefetch, issued while the kernel ahead still streams its own weights,
  costs that kernel more than it saves this one.
- Launch parameters per (op, M rounded up to a power of two, N, K) come from ``TABLE``, else from
  ``heuristic_config``; ``python -m benchmarks.skinny_gemm`` measures both against a sweep and prints entries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.counters import zeroed_counters
from kernels.device_features import num_sms, use_pdl
from kernels.pdl import prefetch_l2, release_next, wait_for_previous
from kernels.skinny_choice import GEMM, MAX_ROWS, SILU_AND_MUL, row_bucket
from kernels.specialization import per_step


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    """Launch parameters of one call (see the module docstring)."""

    block_n: int = 64  # output columns (weight rows) per program
    block_k: int = 128  # K elements per loop step
    split_k: int = 1  # programs per column block, each over 1/split_k of K
    num_warps: int = 4
    num_stages: int = 4
    prefetch_k: int = 64  # weight-row elements fetched into L2 before waiting (PDL); 0: none

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "prefetch_k"):
            value = getattr(self, name)
            if (value < 16 and not (name == "prefetch_k" and value == 0)) or value & (value - 1):
                raise ValueError(f"SkinnyConfig.{name}: must be a power of two >= 16, not {value}")
        if self.split_k < 1:
            raise ValueError(f"SkinnyConfig.split_k: must be >= 1, not {self.split_k}")


# (op, M rounded up to a power of two, N = weight rows, K) -> config, for shapes where the heuristic is measurably
# off. Empty: on an H100 (2026-11-27, benchmarks/skinny_gemm.py, every layer of llama-3.2-1b and llama-3-8b at M =
# 1..32) the heuristic's config was within 3% of the sweep's best at every shape, 1.1% over a whole decode step.
TABLE: dict[tuple[str, int, int, int], SkinnyConfig] = {}


def heuristic_config(m: int, n: int, k: int, op: str, sms: int) -> SkinnyConfig:
    """64 x 128 tiles, 4 warps, 4 stages; K split ``sms // column blocks`` ways (at most one program per SM: a
    second wave, or rounding the split up, measured slower), each split still streaming at least 4 tiles of K."""
    config = SkinnyConfig()
    blocks = triton.cdiv(n // 2 if op == SILU_AND_MUL else n, config.block_n)
    return replace(config, split_k=max(1, min(sms // blocks, triton.cdiv(k, config.block_k) // 4)))


def choose_config(m: int, n: int, k: int, op: str, device: torch.device) -> SkinnyConfig:
    """The measured config for this shape, else the heuristic's (``n``: weight rows)."""
    return TABLE.get((op, row_bucket(m), n, k)) or heuristic_config(m, n, k, op, num_sms(device))


@triton.jit
def _column_block_product(
    x_ptr,
    w_ptr,
    rows,
    cols,
    k_start,
    k_stop,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``sum_k w[cols, k] * x[rows, k]`` over ``k_start <= k < k_stop``: ``[BLOCK_N, BLOCK_M]`` fp32 (out.T)."""
    ks = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    # row-only masks keep the loads 16 bytes wide
    x_rows, w_rows = (rows < M)[:, None], (cols < N)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=x_rows, other=0.0)
            w = tl.load(w_ptrs, mask=w_rows, other=0.0)
        else:
            in_k = (k0 + tl.arange(0, BLOCK_K) < K)[None, :]
            x = tl.load(x_ptrs, mask=x_rows & in_k, other=0.0)
            w = tl.load(w_ptrs, mask=w_rows & in_k, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def store_out(out_ptr, gate, up, rows, cols, M, N, stride_om, SILU_MUL: tl.constexpr):
    """Round and store an ``[BLOCK_N, BLOCK_M]`` block (out.T); with SILU_MUL ``silu(gate) * up``, rounded as
    kernels/activation.py rounds the unfused output."""
    element = out_ptr.dtype.element_ty
    if SILU_MUL:
        g = gate.to(element).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(element).to(tl.float32)
        value = (silu * up.to(element).to(tl.float32)).to(element)
    else:
        value = gate.to(element)
    tl.store(
        out_ptr + rows[None, :] * stride_om + cols[:, None],
        value,
        mask=(cols < N)[:, None] & (rows < M)[None, :],
    )


@triton.jit
def sum_partials(
    part_ptr,
    rows,
    cols,
    M,
    N,
    num_splits,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Partials ``[num_splits, M, width]`` (width ``2N`` with SILU_MUL: gate, then up) added in split order.
    Loads bypass L1 (``.cg``): other programs wrote them."""
    width = N * 2 if SILU_MUL else N
    offs = rows[None, :] * width + cols[:, None]
    mask = (cols < N)[:, None] & (rows < M)[None, :]
    gate = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for split in range(num_splits):
        base = part_ptr + split * M * width + offs
        gate += tl.load(base, mask=mask, other=0.0, cache_modifier=".cg")
        if SILU_MUL:
            up += tl.load(base + N, mask=mask, other=0.0, cache_modifier=".cg")
    return gate, up


@triton.jit
def _prefetch_weights(
    w_ptr,
    cols,
    k_start,
    k_stop,
    N,
    stride_wn,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,
):
    """The first ``PREFETCH_K`` elements of this program's weight rows (gate and up rows with SILU_MUL) into
    L2, one prefetch per ``LINE`` elements (128 bytes); addresses clamped into the weight (no masks here)."""
    ks = tl.minimum(k_start + tl.arange(0, PREFETCH_K // LINE) * LINE, k_stop - 1)
    ptrs = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    prefetch_l2(ptrs, PDL)
    if SILU_MUL:
        prefetch_l2(ptrs + N * stride_wn, PDL)


# the batch's row count changes every step: one variant for all M of a BLOCK_M
@triton.jit(**per_step("M"))
def _skinny_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,
):
    """Program (column block, split): output columns ``cols`` (with SILU_MUL: gate rows ``cols``, up rows
    ``N + cols`` of the weight) over ``K`` range ``[split * k_per_split, (split + 1) * k_per_split)``. With
    PDL its first weight tiles are fetched before the previous kernel (which wrote x) has finished."""
    block, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    if PDL and PREFETCH_K > 0:
        _prefetch_weights(
            w_ptr, cols, k_start, k_stop, N, stride_wn, PREFETCH_K, LINE, SILU_MUL, PDL
        )
    wait_for_previous(PDL)
    release_next(PDL)
    gate = _column_block_product(
        x_ptr,
        w_ptr,
        rows,
        cols,
        k_start,
        k_stop,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        EVEN_K,
        DOT_PRECISION,
    )
    up = gate
    if SILU_MUL:
        up = _column_block_product(
            x_ptr,
            w_ptr + N * stride_wn,
            rows,
            cols,
            k_start,
            k_stop,
            M,
            N,
            K,
            stride_xm,
            stride_wn,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            DOT_PRECISION,
        )
    if SPLIT:
        width = N * 2 if SILU_MUL else N
        part = part_ptr + split * M * width + rows[None, :] * width + cols[:, None]
        mask = (cols < N)[:, None] & (rows < M)[None, :]
        tl.store(part, gate, mask=mask)
        if SILU_MUL:
            tl.store(part + N, up, mask=mask)
        tl.debug_barrier()  # every thread's partials are written before the release below
        counter = counter_ptr + block
        # the last split merges, re-arms
        if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
            tl.store(counter, 0)
            total_gate, total_up = sum_partials(
                part_ptr, rows, cols, M, N, num_splits, SILU_MUL, BLOCK_M, BLOCK_N
            )
            store_out(out_ptr, total_gate, total_up, rows, cols, M, N, stride_om, SILU_MUL)
    else:
        store_out(out_ptr, gate, up, rows, cols, M, N, stride_om, SILU_MUL)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.skinny_gemm``: ``x @ weight.T`` into ``out`` (or a fresh tensor)."""
    return _launch(x, weight, out, config, GEMM)


def skinny_gemm_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.skinny_gemm_silu_and_mul``: ``silu_and_mul(x @ weight.T)``, fused."""
    return _launch(x, weight, out, config, SILU_AND_MUL)


def _check(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, op: str) -> int:
    """Validate the arguments; returns the output width."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{op}: x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{op}: at most {MAX_ROWS} rows of x, not {x.shape[0]}")
    if x.dtype != weight.dtype:
        raise ValueError(f"{op}: x and weight must share a dtype, not {x.dtype} and {weight.dtype}")
    if op == SILU_AND_MUL and weight.shape[0] % 2:
        raise ValueError(f"{op}: weight rows must be 2 * intermediate, not {weight.shape[0]}")
    width = weight.shape[0] // 2 if op == SILU_AND_MUL else weight.shape[0]
    if out is not None and (
        out.shape != (x.shape[0], width) or out.dtype != x.dtype or out.stride(-1) != 1
    ):
        raise ValueError(
            f"{op}: out must be [{x.shape[0]}, {width}] {x.dtype} with unit column stride"
        )
    return width


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None,
    config: SkinnyConfig | None,
    op: str,
) -> torch.Tensor:
    n = _check(x, weight, out, op)
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return out
    config = config or choose_config(m, weight.shape[0], k, op, x.device)
    chunks = triton.cdiv(k, config.block_k)
    per_split = triton.cdiv(chunks, min(config.split_k, chunks))
    splits = triton.cdiv(chunks, per_split)  # no split left without K
    blocks = triton.cdiv(n, config.block_n)
    part = (
        torch.empty(splits, m, weight.shape[0], dtype=torch.float32, device=x.device)
        if splits > 1
        else out
    )
    counters = zeroed_counters("skinny", x.device, blocks) if splits > 1 else out
    pdl, line = use_pdl(x.device), 128 // weight.element_size()
    _skinny_kernel[(blocks, splits)](
        x,
        weight,
        out,
        part,
        counters,
        m,
        n,
        k,
        per_split * config.block_k,
        splits,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=max(16, row_bucket(m)),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        SPLIT=splits > 1,
        SILU_MUL=op == SILU_AND_MUL,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PDL=pdl,
        PREFETCH_K=config.prefetch_k
        and max(line, min(config.prefetch_k, triton.next_power_of_2(per_split * config.block_k))),
        LINE=line,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    return out
