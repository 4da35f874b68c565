"""The sum over tensor-parallel ranks of a tensor each rank has staged into a buffer that every rank has mapped
(PyTorch's symmetric memory: NVLink or PCIe peer access), as one Triton kernel per rank.

Addresses: a peer's copy of the buffer (or of the signal pad) is this rank's address plus a fixed offset, given in
elements (``buffer_deltas[r]``, ``pad_deltas[r]``; 0 for this rank), so the loads keep the alignment Triton sees
on this rank's pointer and vectorise.

Barriers: program ``p`` of every rank meets program ``p`` of the others in a slot of the signal pad,
``slot = (channel * programs + p) * world + sender``: the sender sets its slot in each peer's pad to 1 (release,
system scope) and the receiver turns it back from 1 to 0 (acquire), so every slot is 0 again after each barrier,
also across CUDA-graph replays. Program ``p`` only ever reads what program ``p`` of a peer wrote, so pairwise
barriers suffice. A sender never finds its slot still 1: a peer consumes the call's channel-0 signal before it
sends channel 1, which the sender waits for before its call ends, and its channel-1 signal before it ends its
call, which the sender waits for (the next call's channel 0) before it sends channel 1 again. So the send is one
exchange, not a loop waiting for the slot to free.

Two schedules (``TWO_SHOT``):
- one shot: barrier (every rank has staged) -> each rank sums every rank's copy of its chunks into ``out`` ->
  barrier (no rank overwrites its buffer while a peer still reads it).
- two shot: barrier -> rank r sums shard r of every rank's copy, writes it to ``out`` and into each peer's
  buffer (over its own input there, which only rank r reads) -> barrier -> each rank copies the other shards,
  which its peers wrote into its buffer, to ``out``. The next call's first barrier waits for every peer to
  have finished this one, so two barriers suffice here too.

One barrier (``one_barrier=True``, one shot only): barrier -> each rank sums every rank's copy into ``out``, and
no barrier after. A rank may then leave while a peer still reads its buffer, so the caller must not write that
buffer again before a later call's barrier has shown that every peer got past this call: the engine rotates
three buffers ("exchanges": the embedding's, attention's and the MLP's sum), so consecutive sums never share
one, and before a rank writes an exchange again it has passed another exchange's barrier, which its peers reach
only after finishing this one. Each exchange has its own channel of the signal pad (``channel``), so no
signal of one call can be mistaken for another's.

``SYNC=False`` drops the barriers and ``PHASE`` runs one half of the two shot: the CPU tests emulate the ranks one
after another in Triton's interpreter that way (one process, no peers to wait for).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _barrier(pad_ptr, pad_deltas, channel, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program p of this rank meets program p of every other rank (see the module docstring)."""
    slot = (channel * tl.num_programs(0) + tl.program_id(0)) * WORLD
    tl.debug_barrier()  # (every thread's writes precede the release)
    for r in tl.static_range(WORLD):
        if r != RANK:
            tl.atomic_xchg(pad_ptr + pad_deltas[r] + slot + RANK, 1, sem="release", scope="sys")
    for r in tl.static_range(WORLD):
        if r != RANK:
            while tl.atomic_cas(pad_ptr + slot + r, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()


@triton.jit
def _sum_over_ranks(buf_ptr, buffer_deltas, offs, mask, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Every rank's copy of ``offs`` added in float32, rounded once to the buffer's dtype."""
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WORLD):
        acc += tl.load(buf_ptr + buffer_deltas[r] + offs, mask=mask, cache_modifier=".cg").to(
            tl.float32
        )
    return acc.to(buf_ptr.dtype.element_ty)


@triton.jit
def _all_reduce_kernel(
    buf_ptr,
    out_ptr,
    pad_ptr,
    buffer_deltas,
    pad_deltas,
    numel,
    shard,
    chunk,
    channel,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    TWO_SHOT: tl.constexpr,
    ONE_BARRIER: tl.constexpr,
    SYNC: tl.constexpr,
    PHASE: tl.constexpr,
):
    pid = tl.program_id(0)
    if SYNC:
        _barrier(pad_ptr, pad_deltas, channel, RANK, WORLD)
    if TWO_SHOT:
        if PHASE != 2:  # sum shard RANK's chunk of every rank's copy; send it to the peers
            first = RANK * shard + pid * chunk
            end = tl.minimum(tl.minimum(first + chunk, RANK * shard + shard), numel)
            for start in range(first, end, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < end
                total = _sum_over_ranks(buf_ptr, buffer_deltas, offs, mask, WORLD, BLOCK)
                tl.store(out_ptr + offs, total, mask=mask)
                for r in tl.static_range(WORLD):
                    if r != RANK:
                        tl.store(buf_ptr + buffer_deltas[r] + offs, total, mask=mask)
        if SYNC:
            _barrier(pad_ptr, pad_deltas, channel + 1, RANK, WORLD)
        if PHASE != 1:  # the peers' shards, which they wrote into this rank's buffer
            for s in tl.static_range(WORLD):
                if s != RANK:
                    first = s * shard + pid * chunk
                    end = tl.minimum(tl.minimum(first + chunk, s * shard + shard), numel)
                    for start in range(first, end, BLOCK):
                        offs = start + tl.arange(0, BLOCK)
                        mask = offs < end
                        tl.store(
                            out_ptr + offs,
                            tl.load(buf_ptr + offs, mask=mask, cache_modifier=".cg"),
                            mask=mask,
                        )
    else:
        first = pid * chunk
        end = tl.minimum(first + chunk, numel)
        for start in range(first, end, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < end
            tl.store(
                out_ptr + offs,
                _sum_over_ranks(buf_ptr, buffer_deltas, offs, mask, WORLD, BLOCK),
                mask=mask,
            )
        if SYNC and not ONE_BARRIER:
            _barrier(pad_ptr, pad_deltas, channel + 1, RANK, WORLD)


def all_reduce_staged(
    staged: torch.Tensor,
    out: torch.Tensor,
    pad: torch.Tensor,
    buffer_deltas: tuple[int, ...],
    pad_deltas: tuple[int, ...],
    rank: int,
    programs: int,
    two_shot: bool = True,
    block: int = 2048,
    sync: bool = True,
    phase: int = 0,
    channel: int = 0,
    one_barrier: bool = False,
) -> torch.Tensor:
    """``out`` = the sum over ranks of ``staged`` (this rank's part, inside its symmetric buffer, at the same
    offset on every rank). ``pad``: this rank's int32 signal pad, 0 everywhere, with room for
    ``(channel + 2) * programs * world`` slots: the barriers use channels ``channel`` and ``channel + 1``, and
    ``one_barrier`` (a one shot only) ``channel`` alone, with what the module docstring says the caller owes.
    ``buffer_deltas[r]`` (elements of ``staged``'s dtype) and ``pad_deltas[r]`` (int32 elements): rank r's
    address minus this rank's. Every rank must call it with the same sizes and ``programs``; the programs of
    all ranks run at once (``programs`` no more than fit on the device together)."""
    world = len(buffer_deltas)
    assert staged.is_contiguous() and out.is_contiguous() and staged.numel() == out.numel()
    assert not (one_barrier and two_shot), "the two shot needs its second barrier"
    channels = channel + (1 if one_barrier else 2)
    assert pad.dtype == torch.int32 and pad.numel() >= channels * programs * world, (
        "signal pad too small"
    )
    numel = staged.numel()
    shard = triton.cdiv(numel, world) if two_shot else numel
    shard = triton.cdiv(shard, 16) * 16  # (shards start 32-byte aligned: vector loads)
    chunk = triton.cdiv(triton.cdiv(shard, programs), block) * block
    _all_reduce_kernel[(programs,)](
        staged,
        out,
        pad,
        tuple(buffer_deltas),
        tuple(pad_deltas),
        numel,
        shard,
        chunk,
        channel,
        RANK=rank,
        WORLD=world,
        BLOCK=block,
        TWO_SHOT=two_shot,
        ONE_BARRIER=one_barrier,
        SYNC=sync,
        PHASE=phase,
        num_warps=8,
    )
    return out


@triton.jit
def _add_rms_norm_row(
    total, row, residual_ptr, weight_ptr, out_ptr, cols, mask, eps, HIDDEN: tl.constexpr
):
    """kernels/rms_norm.py's arithmetic for one row: the sum rounded to the input dtype, the norm in float32."""
    residual = tl.load(residual_ptr + row * HIDDEN + cols, mask=mask, other=0.0)
    x = (total.to(tl.float32) + residual.to(tl.float32)).to(total.dtype)
    tl.store(residual_ptr + row * HIDDEN + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * HIDDEN + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _all_reduce_rms_norm_kernel(
    buf_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    pad_ptr,
    buffer_deltas,
    pad_deltas,
    num_rows,
    shard_rows,
    eps,
    channel,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ONE_BARRIER: tl.constexpr,
    SYNC: tl.constexpr,
    PHASE: tl.constexpr,
):
    """The two shot by whole rows (rank r sums rows ``r * shard_rows ..``), each summed row then added to the
    residual and normed in registers, as the next layer's RMSNorm would: no separate norm kernel. With
    ``ONE_BARRIER`` the one shot instead: every rank sums, adds and norms every row itself."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < HIDDEN
    if SYNC:
        _barrier(pad_ptr, pad_deltas, channel, RANK, WORLD)
    if ONE_BARRIER:
        for row in range(pid, num_rows, programs):
            offs = row * HIDDEN + cols
            total = _sum_over_ranks(buf_ptr, buffer_deltas, offs, mask, WORLD, BLOCK_H)
            _add_rms_norm_row(
                total, row, residual_ptr, weight_ptr, out_ptr, cols, mask, eps, HIDDEN
            )
    else:
        if PHASE != 2:
            end = tl.minimum(RANK * shard_rows + shard_rows, num_rows)
            for row in range(RANK * shard_rows + pid, end, programs):
                offs = row * HIDDEN + cols  # (a buffer of at most 8 MiB: int32 offsets)
                total = _sum_over_ranks(buf_ptr, buffer_deltas, offs, mask, WORLD, BLOCK_H)
                for r in tl.static_range(WORLD):
                    if r != RANK:
                        tl.store(buf_ptr + buffer_deltas[r] + offs, total, mask=mask)
                _add_rms_norm_row(
                    total, row, residual_ptr, weight_ptr, out_ptr, cols, mask, eps, HIDDEN
                )
        if SYNC:
            _barrier(pad_ptr, pad_deltas, channel + 1, RANK, WORLD)
        if PHASE != 1:
            for s in tl.static_range(WORLD):
                if s != RANK:
                    end = tl.minimum(s * shard_rows + shard_rows, num_rows)
                    for row in range(s * shard_rows + pid, end, programs):
                        total = tl.load(
                            buf_ptr + row * HIDDEN + cols, mask=mask, cache_modifier=".cg"
                        )
                        _add_rms_norm_row(
                            total, row, residual_ptr, weight_ptr, out_ptr, cols, mask, eps, HIDDEN
                        )


def all_reduce_rms_norm_staged(
    staged: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pad: torch.Tensor,
    buffer_deltas: tuple[int, ...],
    pad_deltas: tuple[int, ...],
    rank: int,
    programs: int,
    sync: bool = True,
    phase: int = 0,
    out: torch.Tensor | None = None,
    channel: int = 0,
    one_barrier: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/rms_norm.py's contract applied to the sum over ranks of ``staged`` ``[rows, hidden]`` (staged as
    for ``all_reduce_staged``): the sum plus ``residual`` is written into ``residual`` in place, and
    ``(weight * norm(sum + residual), residual)`` is returned. The two shot's barriers and addresses, or with
    ``one_barrier`` the one shot's (``all_reduce_staged``'s ``channel`` and ``one_barrier``)."""
    world = len(buffer_deltas)
    rows, hidden = staged.shape
    assert staged.is_contiguous() and residual.is_contiguous() and residual.shape == staged.shape
    channels = channel + (1 if one_barrier else 2)
    assert pad.dtype == torch.int32 and pad.numel() >= channels * programs * world, (
        "signal pad too small"
    )
    if out is None:
        out = torch.empty(
            staged.shape,
            dtype=torch.promote_types(weight.dtype, staged.dtype),
            device=staged.device,
        )
    block_h = triton.next_power_of_2(hidden)
    _all_reduce_rms_norm_kernel[(programs,)](
        staged,
        residual,
        weight,
        out,
        pad,
        tuple(buffer_deltas),
        tuple(pad_deltas),
        rows,
        triton.cdiv(rows, world),
        eps,
        channel,
        RANK=rank,
        WORLD=world,
        HIDDEN=hidden,
        BLOCK_H=block_h,
        ONE_BARRIER=one_barrier,
        SYNC=sync,
        PHASE=phase,
        num_warps=min(16, max(4, block_h // 512)),
    )
    return out, residual


@triton.jit
def _signal_driver_kernel(pad_ptr, pad_deltas, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Rank r > 0 sets its slot in rank 0's pad (release: its writes before are seen first); rank 0 waits for
    every such slot and turns it back to 0 (acquire)."""
    if RANK == 0:
        for r in tl.static_range(1, WORLD):
            while tl.atomic_cas(pad_ptr + r, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    else:
        tl.atomic_xchg(pad_ptr + pad_deltas[0] + RANK, 1, sem="release", scope="sys")


def signal_driver(pad: torch.Tensor, pad_deltas: tuple[int, ...], rank: int) -> None:
    """One-way: rank 0 goes on once every other rank has got here (what each wrote before, into rank 0's
    memory included, then visible to rank 0); the others do not wait. ``pad``: this rank's int32 signal pad,
    0 in its first ``world`` slots; ``pad_deltas`` as for ``all_reduce_staged``. The caller must not signal
    again before rank 0 has taken the last signal (the engine: rank 0's sampled ids, broadcast after it)."""
    world = len(pad_deltas)
    assert pad.dtype == torch.int32 and pad.numel() >= world
    _signal_driver_kernel[(1,)](pad, tuple(pad_deltas), RANK=rank, WORLD=world, num_warps=1)
