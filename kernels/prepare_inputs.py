"""A step's inputs made ready on the device in one launch (Triton): the pending token ids fed from the ids the
step before sampled, and, for a CUDA-graph step, the block-table rows copied into the graph's static table.

Contract (that of ``reference.prepare_inputs``): ``ids[t]`` becomes ``last_sampled[feed[t]]`` where
``feed[t] >= 0`` (in place; other ids stay). With ``static_tables``, ``table_at`` holds (offset, rows, width)
on the device, and ``static_tables[:rows, :width] = packed[offset : offset + rows * width]`` (rows of
``width``). The sizes are read on the device, so a CUDA graph can hold the launch while the table's shape
changes from step to step; ``rows`` is at most ``static_tables.shape[0]``.

Why one kernel: done with torch, the feed is five launches (a compare, a clamp, an index cast, the gather, a
select), and the table copy was a device-to-device memcpy between the input upload and the graph, which left
the device idle ~7-8 us (the copy engine's turn). A 1-stream decode step of llama-3.2-1b takes ~0.86 ms on an
H200 (docs/BENCHMARKS.md, fourteenth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.specialization import per_step

BLOCK_T = 128  # token ids a program feeds
BLOCK_W = 256  # table entries a program copies per loop step


# the ids and feed are slices of the packed inputs at offsets that change with the batch
@triton.jit(**per_step("ids_ptr", "feed_ptr", "num_tokens"))
def _prepare_inputs_kernel(
    ids_ptr,
    feed_ptr,
    last_ptr,
    packed_ptr,
    table_at_ptr,
    static_ptr,
    num_tokens,
    stride_static,
    STATIC: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Program p feeds tokens ``p * BLOCK_T ..`` and copies table row p (where the table has one)."""
    p = tl.program_id(0)
    tokens = p * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tokens < num_tokens
    feed = tl.load(feed_ptr + tokens, mask=live, other=-1)
    fed = live & (feed >= 0)
    tl.store(ids_ptr + tokens, tl.load(last_ptr + tl.maximum(feed, 0), mask=fed), mask=fed)
    if STATIC:
        offset = tl.load(table_at_ptr)
        rows = tl.load(table_at_ptr + 1)
        width = tl.load(table_at_ptr + 2)
        if p < rows:
            source = packed_ptr + offset + p.to(tl.int64) * width
            target = static_ptr + p.to(tl.int64) * stride_static
            for first in range(0, width, BLOCK_W):
                cols = first + tl.arange(0, BLOCK_W)
                tl.store(
                    target + cols, tl.load(source + cols, mask=cols < width), mask=cols < width
                )


def prepare_inputs(
    ids: torch.Tensor,
    feed: torch.Tensor,
    last_sampled: torch.Tensor,
    packed: torch.Tensor | None,
    table_at: torch.Tensor | None,
    static_tables: torch.Tensor | None,
) -> None:
    """Same contract as ``reference.prepare_inputs``."""
    if (
        ids.dim() != 1
        or feed.shape != ids.shape
        or not (ids.is_contiguous() and feed.is_contiguous())
    ):
        raise ValueError(
            f"prepare_inputs: ids and feed must be contiguous [T] vectors, not {tuple(ids.shape)} and "
            f"{tuple(feed.shape)}"
        )
    if not (ids.dtype == feed.dtype == last_sampled.dtype == torch.int32):
        raise ValueError("prepare_inputs: ids, feed and last_sampled must be int32")
    given = (packed is not None, table_at is not None, static_tables is not None)
    if any(given) and not all(given):
        raise ValueError("prepare_inputs: packed, table_at and static_tables go together")
    if static_tables is not None and (
        packed.dtype != torch.int32
        or static_tables.dtype != torch.int32
        or static_tables.stride(1) != 1
        or table_at.dtype != torch.int32
        or table_at.numel() != 3
    ):
        raise ValueError(
            "prepare_inputs: packed, static_tables (rows contiguous) and table_at (3 values: offset, rows, "
            "width) must be int32"
        )
    static = static_tables is not None
    programs = max(triton.cdiv(ids.numel(), BLOCK_T), static_tables.shape[0] if static else 0)
    if programs == 0:
        return
    _prepare_inputs_kernel[(programs,)](
        ids,
        feed,
        last_sampled,
        packed if static else ids,
        table_at if static else ids,
        static_tables if static else ids,
        ids.numel(),
        static_tables.stride(0) if static else 0,
        STATIC=static,
        BLOCK_T=BLOCK_T,
        BLOCK_W=BLOCK_W,
        num_warps=4,
    )
