"""Greedy sampling's argmax over the vocabulary (Triton), split over many programs per row.

Contract (that of ``reference.greedy_argmax``): ``logits`` ``[rows, vocab]`` -> int64 ``[rows]``, the lowest index
among a row's largest values. NaN counts as larger than every number: a row's first NaN wins, as in torch's
argmax (a row holding both +inf and NaN: torch picks the first NaN, this kernel the first of either).

Why a kernel of our own, and why split: a decode step's argmax is latency, not bandwidth (one 128K row is 256 KiB,
just written by the output layer and still in L2). torch's reduction took ~37 us per step on an H100, and a
program that loops over its row takes one load latency per chunk (~30 chunks). Here program (row, part) loads its
``BLOCK`` columns at once and writes the part's (max, first index); the last part of a row to finish (an atomic
counter per row) loads every part's pair at once and writes the row's answer, so a row costs two load latencies.
Parts are merged in a fixed way (the largest value, then the lowest index), so the result never depends on
timing. The counters re-arm themselves (one launch at a time per device: the engine's single stream). Launched
with PDL on Hopper (kernels/pdl.py) like the rest of the decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.counters import zeroed_counters
from kernels.device_features import use_pdl
from kernels.pdl import release_next, wait_for_previous

BLOCK = 2048  # columns per program
_NO_INDEX = 2**31 - 1


@triton.jit
def _largest_first(value, index):
    """The largest of ``value`` and the lowest ``index`` holding it."""
    top = tl.max(value, axis=0)
    return top, tl.min(tl.where(value == top, index, 2**31 - 1), axis=0)


@triton.jit
def _argmax_kernel(
    logits_ptr,
    out_ptr,
    part_value_ptr,
    part_index_ptr,
    counter_ptr,
    vocab,
    stride_row,
    num_parts,
    BLOCK: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    release_next(PDL)
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(
        logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")
    ).to(tl.float32)
    value = tl.where(value != value, float("inf"), value)  # NaN beats every number
    # (columns past the vocabulary hold -inf at indices above every real one: they never win)
    top, first = _largest_first(value, cols)
    tl.store(part_value_ptr + row * num_parts + part, top)
    tl.store(part_index_ptr + row * num_parts + part, first)
    tl.debug_barrier()  # every thread's part is written before the release below
    if tl.atomic_add(counter_ptr + row, 1, sem="acq_rel") == num_parts - 1:
        tl.store(counter_ptr + row, 0)  # the last part merges, re-arms
        parts = tl.arange(0, PARTS_PAD)
        values = tl.load(
            part_value_ptr + row * num_parts + parts,
            mask=parts < num_parts,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        indices = tl.load(
            part_index_ptr + row * num_parts + parts,
            mask=parts < num_parts,
            other=2**31 - 1,
            cache_modifier=".cg",
        )
        _, best = _largest_first(values, indices)
        tl.store(out_ptr + row, best.to(tl.int64))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.greedy_argmax``."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"greedy_argmax: logits [rows, vocab > 0] expected, not {tuple(logits.shape)}"
        )
    if logits.shape[1] >= _NO_INDEX:
        raise ValueError(f"greedy_argmax: a vocabulary of {logits.shape[1]} is past int32 indices")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    parts = triton.cdiv(vocab, BLOCK)
    part_values = torch.empty(rows * parts, dtype=torch.float32, device=logits.device)
    part_indices = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    pdl = use_pdl(logits.device)
    _argmax_kernel[(rows, parts)](
        logits,
        out,
        part_values,
        part_indices,
        zeroed_counters("argmax", logits.device, rows),
        vocab,
        logits.stride(0),
        parts,
        BLOCK=BLOCK,
        PARTS_PAD=max(16, triton.next_power_of_2(parts)),
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
