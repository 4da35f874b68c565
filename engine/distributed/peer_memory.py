"""Tensor parallelism through memory every rank has mapped (PyTorch's symmetric memory over NVLink or PCIe peer
access; multicast stays off): the decode step's all-reduces, and the logits written straight into rank 0's.

**All-reduce** (``PeerAllReduce``): a row-parallel matmul writes its part into this rank's buffer, and one Triton
kernel per rank (kernels/all_reduce.py) reads the peers' parts directly: no ring, no proxy thread. The engine's
schedule is the one shot with a single barrier: every rank sums every row itself (after o_proj and down_proj also
adding the residual and RMS-norming), and nothing waits at the end. That is safe because the engine's sums go
through three buffers in turn, by call site: exchange 0 the embedding's lookup, 1 attention's output, 2 the
MLP's. A forward pass is 0, (1, 2) per layer, so no two consecutive sums share an exchange and, before a rank
writes an exchange again, it has passed another exchange's barrier, which its peers reach only once done reading
the first. ``two_shot`` (the earlier schedule, kept for comparison) sums half the rows on each rank and sends
them over, which needs a second barrier per call.

**Logits** (``LogitsExchange``): only rank 0 samples, so each rank's output-layer matmul writes its vocabulary
slice's columns straight into rank 0's ``[rows, vocab]`` logits in symmetric memory (cuBLAS with a leading
dimension: no gather, no copy), and a one-way signal tells rank 0 when the others' columns are in. A rank writes
step k + 1's logits only after rank 0's sampled ids of step k reached it (``broadcast_from_driver``), so rank 0
has read step k's by then.
"""

from __future__ import annotations

import math
from itertools import cycle

import torch
import torch.distributed as dist

# PeerAllReduce takes the all-reduces from 1 MiB to 8 MiB (a decode step of 128 .. 1024 rows of 4096 bf16): there
# its two-shot sum beat NCCL on 2 x H100 and 2 x H200; below 1 MiB NCCL was as fast or faster (benchmarks/all_reduce.py,
# docs/BENCHMARKS.md), and above it prefill's large messages are bandwidth-bound, where NCCL is good
PEER_ALL_REDUCE_MIN_BYTES = 1 << 20
PEER_ALL_REDUCE_BYTES = 8 << 20
# the engine's schedules (EngineConfig.all_reduce, besides nccl): one_barrier is auto's
SCHEDULES = ("one_barrier", "two_shot")
# benchmarks/all_reduce.py's comparison: ours (kernels/all_reduce.py) and PyTorch's own symmetric-memory ops
PEER_METHODS = ("one_barrier", "two_shot", "one_shot", "torch_two_shot", "torch_one_shot")
EXCHANGES = 3  # the engine's sums by call site: 0 embedding, 1 attention output, 2 MLP output
# signal-pad channels: 0 and 1 the two-barrier calls, 2 + e exchange e's single barrier
_CHANNELS = 2 + EXCHANGES


def _symmetric(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, object]:
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(numel, dtype=dtype, device=device)
    return buffer, symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)


def _pad_of(handle) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's int32 signal pad and each rank's pad address minus this one's (int32 elements)."""
    rank = handle.rank
    pad = handle.get_signal_pad(rank, [handle.signal_pad_size // 4], dtype=torch.int32)
    return pad, tuple((p - handle.signal_pad_ptrs[rank]) // 4 for p in handle.signal_pad_ptrs)


class PeerAllReduce:
    """The sum over ranks of a CUDA tensor of ``min_bytes`` .. ``max_bytes``. The buffer holds one region for
    ``sum``/``staging`` (benchmarks, the start-up check) and one per exchange (``exchange_staging``), each
    ``max_bytes``, at the same offset on every rank.

    ``schedule``: the engine's (see the module docstring). ``sum(x, method)`` takes any of ``PEER_METHODS``:
    our kernel's schedules, the one-barrier one going round the exchanges (so what it owes holds for any number
    of consecutive calls), and PyTorch's own ops on a buffer of their own. Every method's barriers order each
    use of its buffer in stream order, also in a CUDA graph (checked against NCCL in graphs with changing inputs
    by benchmarks/all_reduce.py)."""

    def __init__(
        self,
        device: torch.device,
        min_bytes: int = PEER_ALL_REDUCE_MIN_BYTES,
        max_bytes: int = PEER_ALL_REDUCE_BYTES,
        schedule: str = "one_barrier",
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
        self.device, self.schedule = device, schedule
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self.buffer, handle = _symmetric((1 + EXCHANGES) * max_bytes, torch.uint8, device)
        self.rank, world = handle.rank, handle.world_size
        # the peers' copies of the buffer, as offsets from this rank's (bytes)
        self._byte_deltas = tuple(p - handle.buffer_ptrs[self.rank] for p in handle.buffer_ptrs)
        self.pad, self.pad_deltas = _pad_of(handle)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.programs = min(sms, self.pad.numel() // (_CHANNELS * world))
        self._torch_buffer: torch.Tensor | None = None
        self._rotation = cycle(range(EXCHANGES))

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda
            and x.is_contiguous()
            and self.min_bytes <= x.nbytes <= self.max_bytes
            and x.nbytes % 16 == 0
        )

    def fits_rows(self, rows: int, width: int, dtype: torch.dtype) -> bool:
        """Whether a ``[rows, width]`` sum of ``dtype`` goes through this buffer."""
        nbytes = rows * width * dtype.itemsize
        return self.min_bytes <= nbytes <= self.max_bytes and nbytes % 16 == 0

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The first region as a tensor of ``shape``: a producer writes its part there (``sum_staged``)."""
        return self._region(0, shape, dtype)

    def exchange_staging(
        self, exchange: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Exchange ``exchange``'s region as a tensor of ``shape`` (``sum_exchange``)."""
        return self._region(1 + exchange, shape, dtype)

    def _region(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        start = index * self.max_bytes
        numel = math.prod(shape)
        return self.buffer[start : start + numel * dtype.itemsize].view(dtype).view(shape)

    def sum(self, x: torch.Tensor, method: str | None = None) -> torch.Tensor:
        """The sum over ranks of ``x`` by ``method`` (default: the schedule), as a new tensor."""
        method = method or self.schedule
        if method.startswith("torch_"):
            return self._torch_sum(x, method)
        if method == "one_barrier":
            exchange = next(self._rotation)
            staged = self.exchange_staging(exchange, x.shape, x.dtype).copy_(x)
            return self.sum_exchange(staged, exchange, "one_barrier")
        return self.sum_staged(self.staging(x.shape, x.dtype).copy_(x), method)

    def sum_staged(self, staged: torch.Tensor, method: str = "two_shot") -> torch.Tensor:
        """The sum over ranks of the part this rank wrote into ``staging(...)``: two barriers (two_shot, one_shot)."""
        return self._sum(staged, two_shot=method == "two_shot", channel=0)

    def sum_exchange(
        self, staged: torch.Tensor, exchange: int, schedule: str | None = None
    ) -> torch.Tensor:
        """The sum over ranks of the part this rank wrote into ``exchange_staging(exchange, ...)``."""
        if (schedule or self.schedule) == "one_barrier":
            return self._sum(staged, two_shot=False, channel=2 + exchange, one_barrier=True)
        return self._sum(staged, two_shot=True, channel=0)

    def _sum(
        self, staged: torch.Tensor, two_shot: bool, channel: int, one_barrier: bool = False
    ) -> torch.Tensor:
        from kernels.all_reduce import all_reduce_staged

        return all_reduce_staged(
            staged,
            torch.empty_like(staged),
            self.pad,
            self.deltas(staged.dtype),
            self.pad_deltas,
            self.rank,
            self.programs,
            two_shot=two_shot,
            channel=channel,
            one_barrier=one_barrier,
        )

    def sum_exchange_rms_norm(
        self,
        staged: torch.Tensor,
        exchange: int,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum as ``sum_exchange``, added to ``residual`` (in place) and RMS-normed with ``norm_weight``
        in the same kernel: ``(normed, residual)`` (kernels/rms_norm.py's contract)."""
        from kernels.all_reduce import all_reduce_rms_norm_staged

        one_barrier = self.schedule == "one_barrier"
        return all_reduce_rms_norm_staged(
            staged,
            residual,
            norm_weight,
            eps,
            self.pad,
            self.deltas(staged.dtype),
            self.pad_deltas,
            self.rank,
            self.programs,
            channel=2 + exchange if one_barrier else 0,
            one_barrier=one_barrier,
        )

    def deltas(self, dtype: torch.dtype) -> tuple[int, ...]:
        """Each rank's buffer address minus this rank's, in elements of ``dtype``."""
        return tuple(d // dtype.itemsize for d in self._byte_deltas)

    def _torch_sum(self, x: torch.Tensor, method: str) -> torch.Tensor:
        ops, group = torch.ops.symm_mem, dist.group.WORLD.group_name
        if self._torch_buffer is None:
            self._torch_buffer = _symmetric(self.max_bytes, torch.uint8, self.device)[0]
        staged = self._torch_buffer[: x.nbytes].view(x.dtype).view(x.shape).copy_(x)
        if method == "torch_one_shot":
            return ops.one_shot_all_reduce_out(staged, "sum", group, torch.empty_like(x))
        if hasattr(ops, "two_shot_all_reduce_out"):  # (newer torch)
            return ops.two_shot_all_reduce_out(staged, "sum", group, torch.empty_like(x))
        return ops.two_shot_all_reduce_(staged, "sum", group).clone()


class LogitsExchange:
    """Rank 0's logits, ``[max_rows, width]`` of ``dtype`` in symmetric memory, which every rank's output layer
    writes its columns of (see the module docstring)."""

    def __init__(self, device: torch.device, max_rows: int, width: int, dtype: torch.dtype) -> None:
        self.max_rows, self.width, self.dtype = max_rows, width, dtype
        self.buffer, handle = _symmetric(max_rows * width, dtype, device)
        self.rank = handle.rank
        # rank 0's logits, mapped into this rank (its own buffer on rank 0)
        self.logits = handle.get_buffer(0, (max_rows, width), dtype)
        self.pad, self.pad_deltas = _pad_of(handle)

    def fits(self, hidden: torch.Tensor) -> bool:
        return hidden.dim() == 2 and hidden.shape[0] <= self.max_rows and hidden.dtype == self.dtype

    def gather(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``hidden @ weight.T`` (this rank's vocabulary slice, padding rows past ``width`` dropped) into its
        columns of rank 0's logits; rank 0's whole ``[rows, width]`` once every rank's are in. On the other
        ranks the result is rank 0's memory too, not to be read there."""
        from kernels.all_reduce import signal_driver

        rows, shard = hidden.shape[0], weight.shape[0]
        start = self.rank * shard
        end = min(start + shard, self.width)
        logits = self.logits[:rows]
        if end > start:
            torch.mm(hidden, weight[: end - start].t(), out=logits[:, start:end])
        signal_driver(self.pad, self.pad_deltas, self.rank)
        return logits
