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
1 .. 8 MiB go through symmetric memory (engine/distributed/peer_memory.py: one kernel per rank reads the peers' parts
over NVLink directly, one barrier per sum, the residual add and the next RMSNorm in the same kernel), and the
logits are written straight into rank 0's; NCCL takes the rest and every other collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from engine.config import ALL_REDUCE_CHOICES
from engine.distributed.peer_memory import LogitsExchange, PeerAllReduce

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


_peer: PeerAllReduce | None = None
_logits: LogitsExchange | None = None
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
    memory, the first group of this process only, one barrier per sum; NCCL for the rest) | two_shot (the
    same with the earlier two-barrier schedule, for comparison) | nccl (NCCL for all)."""
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
        all_reduce != "nccl"
        and device.type == "cuda"
        and _peers_reachable(size)
        and not _peer_used_before
    ):
        _peer_used_before = True
        schedule = "two_shot" if all_reduce == "two_shot" else "one_barrier"
        _peer = PeerAllReduce(device, schedule=schedule)
        pattern = torch.arange(_peer.min_bytes // 4, device=device, dtype=torch.float32) % 251
        # (two barriers: the engine's exchanges are left to the engine)
        check = _peer.sum(pattern + rank, "two_shot")
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
    global _current, _peer, _logits
    _peer = _logits = None  # (their buffers are freed with the group's memory pool)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _current = _SINGLE


def all_reduce(x: torch.Tensor, exchange: int) -> torch.Tensor:
    """Sum of ``x`` over the ranks (a row-parallel layer's partial outputs) from call site ``exchange``
    (peer_memory.EXCHANGES): in place through NCCL, or a new tensor through ``PeerAllReduce``; use the
    result."""
    if _current.size == 1:
        return x
    if _peer is not None and _peer.fits(x):
        staged = _peer.exchange_staging(exchange, x.shape, x.dtype).copy_(x)
        return _peer.sum_exchange(staged, exchange)
    dist.all_reduce(x)
    return x


def _peer_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)``'s sum over ranks goes through our peer kernel."""
    return (
        _peer is not None
        and x.is_cuda
        and x.dim() == 2
        and _peer.fits_rows(x.shape[0], weight.shape[0], x.dtype)
    )


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, exchange: int) -> torch.Tensor:
    """``all_reduce(F.linear(x, weight), exchange)`` (a row-parallel layer without bias); where the sum goes
    through our peer kernel, the matmul writes its output straight into the exchange's buffer (no copy in)."""
    if not _peer_takes(x, weight):
        return all_reduce(F.linear(x, weight), exchange)
    staged = _peer.exchange_staging(exchange, (x.shape[0], weight.shape[0]), x.dtype)
    torch.mm(x, weight.t(), out=staged)
    return _peer.sum_exchange(staged, exchange)


def linear_all_reduce_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    exchange: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sum over ranks of ``F.linear(x, weight)``, added to ``residual`` (in place) and RMS-normed with
    ``norm_weight`` (kernels/rms_norm.py's contract), in the all-reduce's own kernel: ``(normed, residual)``.
    None where our peer kernel does not take this sum (the caller runs the layers one by one)."""
    if not (_peer_takes(x, weight) and residual.is_contiguous()):
        return None
    staged = _peer.exchange_staging(exchange, (x.shape[0], weight.shape[0]), x.dtype)
    torch.mm(x, weight.t(), out=staged)
    return _peer.sum_exchange_rms_norm(staged, exchange, residual, norm_weight, eps)


def reserve_logits(max_rows: int, width: int, dtype: torch.dtype) -> None:
    """Where the group sums through symmetric memory: rank 0's logits for up to ``max_rows`` rows of ``width``
    in it, which every rank's output layer then writes straight into (``compute_logits``). Collective: every
    rank calls it at the same point (rank 0's runner, and its ``ReserveLogits`` command to the others)."""
    global _logits
    if _peer is not None:
        _logits = LogitsExchange(_peer.device, max_rows, width, dtype)


def compute_logits(
    hidden: torch.Tensor, weight: torch.Tensor, width: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits of ``hidden`` under this rank's vocabulary slice ``weight`` (padded past ``width``), whole
    where sampling happens: written straight into rank 0's (the others' result is not theirs to read), or
    all-gathered on every rank into ``out`` (or a new tensor)."""
    if _logits is not None and _logits.fits(hidden):
        return _logits.gather(hidden, weight)
    return all_gather_last_dim(torch.matmul(hidden, weight.t()), width, out)


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
