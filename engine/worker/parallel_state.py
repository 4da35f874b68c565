"""Tensor parallelism's process group: which rank this process is, how many there are, and the two collectives
the sharded layers need (engine/layers/linear.py).

Megatron's split of a transformer layer over N ranks: a column-parallel matmul gives each rank a slice of the
outputs (heads of q/k/v, columns of gate/up), the row-parallel matmul after it gives each rank a partial sum
of the full output, and one all-reduce adds them: two all-reduces per layer, none inside attention or the MLP.
The embedding and the output layer split the vocabulary: a lookup is an all-reduce of the rank that owns the
token's row (the others add zeros), and the logits are all-gathered where sampling happens.

One group per process, the default torch.distributed group: NCCL on CUDA, gloo on the CPU. Without one (a
single rank) every collective is the identity, so model code has no branch for it.

The decode step's all-reduces are small (a batch of 256 rows of 4096 bf16 is 2 MiB) and there are two per
layer, so their latency, not NVLink's bandwidth, is what they cost. On CUDA with ``all_reduce="auto"`` those of
1 .. 8 MiB go through PyTorch's symmetric memory (``PeerAllReduce``): each rank's row-parallel matmul writes its
part into a buffer every rank has mapped, and our kernel on each rank (kernels/all_reduce.py) reads and writes
the others' parts over NVLink directly (no ring, no proxy thread); after o_proj and down_proj the same kernel
also adds the residual and applies the next RMSNorm. NCCL takes the rest and every other collective.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

# NVLink multicast off in NCCL, PyTorch and NVSHMEM: a program using it can take a shared host's GPUs out of
# service (the device notes); set before the first NCCL call, and inherited by the processes we start
NCCL_SAFETY_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int
    size: int

    def shard(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal slice of ``total`` (which ``size`` divides)."""
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part


_SINGLE = TensorParallel(0, 1)
_current = _SINGLE

# PeerAllReduce takes the all-reduces from 1 MiB to 8 MiB (a decode step of 128 .. 1024 rows of 4096 bf16): there
# its two-shot sum beat NCCL on 2 x H100 and 2 x H200; below 1 MiB NCCL was as fast or faster (benchmarks/all_reduce.py,
# docs/BENCHMARKS.md), and above it prefill's large messages are bandwidth-bound, where NCCL is good
PEER_ALL_REDUCE_MIN_BYTES = 1 << 20
PEER_ALL_REDUCE_BYTES = 8 << 20
ALL_REDUCE_CHOICES = ("auto", "nccl")


PEER_METHODS = ("two_shot", "one_shot", "torch_two_shot", "torch_one_shot")


class PeerAllReduce:
    """The sum over ranks of a CUDA tensor of ``min_bytes`` .. ``max_bytes`` through a buffer of PyTorch's
    symmetric memory that every rank has mapped (NVLink or PCIe peer access; multicast stays off): each rank
    copies its part into the buffer, then one kernel per rank reads the peers' parts directly.

    ``method``: two_shot / one_shot, our Triton kernel (kernels/all_reduce.py: one launch, as many programs as
    the device has SMs, barriers in the buffer's signal pad); torch_two_shot / torch_one_shot, PyTorch's own
    symmetric-memory ops on a buffer of their own (for benchmarks/all_reduce.py's comparison). Each method's
    barriers order every use of its buffer in stream order, also in a CUDA graph (checked against NCCL in graphs
    with changing inputs by benchmarks/all_reduce.py)."""

    def __init__(
        self,
        device: torch.device,
        min_bytes: int = PEER_ALL_REDUCE_MIN_BYTES,
        max_bytes: int = PEER_ALL_REDUCE_BYTES,
        method: str = "two_shot",
    ) -> None:
        if method not in PEER_METHODS:
            raise ValueError(f"method: {method!r} is not one of {', '.join(PEER_METHODS)}")
        self.group_name = dist.group.WORLD.group_name
        self.device, self.method = device, method
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self.buffer, handle = self._allocate()
        self.rank, world = handle.rank, handle.world_size
        # the peers' copies of the buffer and the signal pad, as offsets from this rank's (bytes, int32 slots)
        self._byte_deltas = tuple(p - handle.buffer_ptrs[self.rank] for p in handle.buffer_ptrs)
        self.pad = handle.get_signal_pad(
            self.rank, [handle.signal_pad_size // 4], dtype=torch.int32
        )
        self.pad_deltas = tuple(
            (p - handle.signal_pad_ptrs[self.rank]) // 4 for p in handle.signal_pad_ptrs
        )
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.programs = min(sms, self.pad.numel() // (2 * world))
        self._torch_buffer: torch.Tensor | None = None
        self._torch_ops = torch.ops.symm_mem

    def _allocate(self) -> tuple[torch.Tensor, object]:
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=self.device)
        return buffer, symm_mem.rendezvous(buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda
            and x.is_contiguous()
            and self.min_bytes <= x.nbytes <= self.max_bytes
            and x.nbytes % 16 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum(x, self.method)

    def sum(self, x: torch.Tensor, method: str) -> torch.Tensor:
        """The sum over ranks of ``x`` by ``method`` (a new tensor)."""
        if method.startswith("torch_"):
            return self._torch_sum(x, method)
        return self.sum_staged(self.staging(x.shape, x.dtype).copy_(x), method)

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer's first bytes as a tensor of ``shape``: a producer writes its part there (``sum_staged``)."""
        numel = math.prod(shape)
        return self.buffer[: numel * dtype.itemsize].view(dtype).view(shape)

    def sum_staged(self, staged: torch.Tensor, method: str | None = None) -> torch.Tensor:
        """The sum over ranks of the part this rank wrote into ``staging(...)`` (our kernel's methods)."""
        from kernels.all_reduce import all_reduce_staged

        two_shot = (method or self.method) == "two_shot"
        return all_reduce_staged(
            staged,
            torch.empty_like(staged),
            self.pad,
            self.deltas(staged.dtype),
            self.pad_deltas,
            self.rank,
            self.programs,
            two_shot=two_shot,
        )

    def deltas(self, dtype: torch.dtype) -> tuple[int, ...]:
        """Each rank's buffer address minus this rank's, in elements of ``dtype``."""
        return tuple(d // dtype.itemsize for d in self._byte_deltas)

    def _torch_sum(self, x: torch.Tensor, method: str) -> torch.Tensor:
        if self._torch_buffer is None:
            self._torch_buffer = self._allocate()[0]
        staged = self._torch_buffer[: x.nbytes].view(x.dtype).view(x.shape).copy_(x)
        if method == "torch_one_shot":
            return self._torch_ops.one_shot_all_reduce_out(
                staged, "sum", self.group_name, torch.empty_like(x)
            )
        if hasattr(self._torch_ops, "two_shot_all_reduce_out"):  # (newer torch)
            return self._torch_ops.two_shot_all_reduce_out(
                staged, "sum", self.group_name, torch.empty_like(x)
            )
        return self._torch_ops.two_shot_all_reduce_(staged, "sum", self.group_name).clone()


_peer: PeerAllReduce | None = None
# PyTorch keeps a symmetric-memory group's state by the group's name for the life of the process, and a later
# group of the same name ("0") hung in its rendezvous on 2 x H100: one PeerAllReduce per process, and a later
# tensor-parallel engine in the same process (tests, benchmarks) adds through NCCL
_peer_used_before = False


def set_rank_threads(num_threads: int | None, size: int, device: torch.device) -> int:
    """One rank's torch threads: ``num_threads`` where set, else on the CPU the ``size`` ranks share the cores
    (each its share of this process's threads). Returns the count before, for a restore."""
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif size > 1 and device.type == "cpu":
        torch.set_num_threads(max(1, before // size))
    return before


def current() -> TensorParallel:
    return _current


def init_tensor_parallel(
    rank: int,
    size: int,
    device: torch.device,
    rendezvous: str,
    timeout_s: float = 1800.0,
    all_reduce: str = "auto",
) -> TensorParallel:
    """Join the group of ``size`` ranks meeting at ``rendezvous`` (a ``file://`` path no earlier group used);
    blocks until every rank has joined. One group per process at a time (``destroy_tensor_parallel`` ends it).
    ``all_reduce``: auto (``PeerAllReduce`` for small messages on CUDA where the ranks' GPUs reach each other's
    memory, the first group of this process only; NCCL for the rest) | nccl (NCCL for all)."""
    global _current, _peer, _peer_used_before
    if all_reduce not in ALL_REDUCE_CHOICES:
        raise ValueError(
            f"all_reduce: {all_reduce!r} is not one of {', '.join(ALL_REDUCE_CHOICES)}"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "tensor_parallel_size: this process already belongs to a tensor-parallel group "
            "(one tensor-parallel engine per process)"
        )
    os.environ.update(NCCL_SAFETY_ENV)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=rendezvous,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    # the first collective sets NCCL's communicator up: it must not happen inside a CUDA graph's capture
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != size:
        raise RuntimeError(
            f"tensor parallel: an all-reduce of ones over {size} ranks gave {probe.item()}"
        )
    _current = TensorParallel(rank, size)
    if (
        all_reduce == "auto"
        and device.type == "cuda"
        and _peers_reachable(size)
        and not _peer_used_before
    ):
        _peer_used_before = True
        _peer = PeerAllReduce(device)
        pattern = torch.arange(_peer.min_bytes // 4, device=device, dtype=torch.float32) % 251
        check = _peer(pattern + rank)
        if not torch.equal(check, size * pattern + size * (size - 1) // 2):
            raise RuntimeError(
                f"tensor parallel: the peer all-reduce over {size} ranks gave {check[:4].tolist()}"
            )
    return _current


def _peers_reachable(size: int) -> bool:
    """Every pair of the ranks' GPUs (cuda:0 .. size-1) can read each other's memory (NVLink or PCIe P2P)."""
    return all(
        torch.cuda.can_device_access_peer(a, b) for a in range(size) for b in range(size) if a != b
    )


def peer_all_reduce() -> PeerAllReduce | None:
    """This rank's symmetric-memory all-reduce while its group uses one."""
    return _peer


def peer_all_reduce_active() -> bool:
    return _peer is not None


def peer_all_reduce_spent() -> bool:
    """Whether this process has set a ``PeerAllReduce`` up before (a later group adds through NCCL)."""
    return _peer_used_before


def destroy_tensor_parallel() -> None:
    """Leave the group. NCCL's communicators are aborted, a local act: a graceful teardown waits for the other
    ranks' (seen hanging on 2 x H100 while a rank was still stopping), or forever for a rank that died."""
    global _current, _peer
    _peer = None  # (its buffer is freed with the group's memory pool)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _current = _SINGLE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the ranks (a row-parallel layer's partial outputs): in place through NCCL, or a new
    tensor through ``PeerAllReduce``; use the result."""
    if _current.size == 1:
        return x
    if _peer is not None and _peer.fits(x):
        return _peer(x)
    dist.all_reduce(x)
    return x


def _peer_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)``'s sum over ranks goes through our peer kernel."""
    nbytes = (x.numel() // x.shape[-1]) * weight.shape[0] * x.element_size()
    return (
        _peer is not None
        and not _peer.method.startswith("torch_")
        and x.is_cuda
        and x.dim() == 2
        and _peer.min_bytes <= nbytes <= _peer.max_bytes
        and nbytes % 16 == 0
    )


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``all_reduce(F.linear(x, weight))`` (a row-parallel layer without bias); where the sum goes through our
    peer kernel, the matmul writes its output straight into the peer buffer (no copy in)."""
    if not _peer_takes(x, weight):
        return all_reduce(F.linear(x, weight))
    staged = _peer.staging((x.shape[0], weight.shape[0]), x.dtype)
    torch.mm(x, weight.t(), out=staged)
    return _peer.sum_staged(staged)


def linear_all_reduce_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sum over ranks of ``F.linear(x, weight)``, added to ``residual`` (in place) and RMS-normed with
    ``norm_weight`` (kernels/rms_norm.py's contract), in the all-reduce's own kernel: ``(normed, residual)``.
    None where our peer kernel's two shot does not take this sum (the caller runs the layers one by one)."""
    if not (_peer_takes(x, weight) and _peer.method == "two_shot" and residual.is_contiguous()):
        return None
    from kernels.all_reduce import all_reduce_rms_norm_staged

    staged = _peer.staging((x.shape[0], weight.shape[0]), x.dtype)
    torch.mm(x, weight.t(), out=staged)
    return all_reduce_rms_norm_staged(
        staged,
        residual,
        norm_weight,
        eps,
        _peer.pad,
        _peer.deltas(x.dtype),
        _peer.pad_deltas,
        _peer.rank,
        _peer.programs,
    )


def all_gather_last_dim(
    x: torch.Tensor, width: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[rows, n]`` on each rank -> ``[rows, width]``: the first ``width`` (default ``size * n``) columns of the
    ranks' slices side by side in rank order, written once into ``out`` (or a new tensor)."""
    size, (rows, n) = _current.size, x.shape
    width = size * n if width is None else width
    if size == 1:
        return x[:, :width] if out is None else out.copy_(x[:, :width])
    gathered = torch.empty((size, rows, n), dtype=x.dtype, device=x.device)
    _gather(gathered.view(size * rows, n), x.contiguous())
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device) if out is None else out
    for rank in range(size):
        start = rank * n
        if start < width:
            end = min(start + n, width)
            out[:, start:end].copy_(gathered[rank, :, : end - start])
    return out


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place (the sampled ids, which only rank 0 computes)."""
    if _current.size > 1:
        dist.broadcast(x, src=0)
    return x


def _gather(out: torch.Tensor, x: torch.Tensor) -> None:
    # (its newer name; all_gather_into_tensor before)
    gather = getattr(dist, "all_gather_single", None)
    if gather is not None:
        gather(out, x)
    else:
        dist.all_gather_into_tensor(out, x)
