"""Greedy sampling's argmax over the vocabulary (Triton): one program per row.

Contract (that of ``reference.greedy_argmax``): ``logits`` ``[rows, vocab]`` -> int64 ``[rows]``, the lowest index
among a row's largest values. NaN counts as larger than every number: a row's first NaN wins, as in torch's
argmax (a row holding both +inf and NaN: torch picks the first NaN, this kernel the first of either).

Why a kernel of our own: torch's argmax over one 128K-wide row is a reduction of few blocks, which an H100 ran in
~37 us per decode step; here a program of 8 warps streams its row (256 KiB of bf16, just written by the output
layer, so from L2) in chunks of ``CHUNK``, keeping a running (max, index) per lane, and reduces at the end.
Launched with PDL on Hopper (kernels/pdl.py) like the rest of the decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device_features import use_pdl
from kernels.pdl import release_next, wait_for_previous

CHUNK = 4096


@triton.jit
def _argmax_kernel(logits_ptr, out_ptr, vocab, stride_row, CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    release_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, CHUNK)
    best = tl.full([CHUNK], float("-inf"), tl.float32)
    best_at = tl.full([CHUNK], 2**31 - 1, tl.int32)
    for start in range(0, vocab, CHUNK):
        cols = start + lanes
        value = tl.load(
            logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")
        ).to(tl.float32)
        value = tl.where(value != value, float("inf"), value)  # NaN beats every number
        # a lane keeps its earlier (lower) index on a tie: strictly greater replaces
        better = (value > best) | ((value == best) & (best_at == 2**31 - 1) & (cols < vocab))
        best = tl.where(better, value, best)
        best_at = tl.where(better, cols, best_at)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_at, 2**31 - 1), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.greedy_argmax``."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"greedy_argmax: logits [rows, vocab > 0] expected, not {tuple(logits.shape)}"
        )
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        pdl = use_pdl(logits.device)
        _argmax_kernel[(logits.shape[0],)](
            logits,
            out,
            logits.shape[1],
            logits.stride(0),
            CHUNK=CHUNK,
            PDL=pdl,
            num_warps=8,
            launch_pdl=pdl,
        )
    return out
