"""Tensor parallelism's process group: which rank this process is, how many there are, and the two collectives
the sharded layers need (engine/layers/linear.py).

Megatron's split of a transformer layer over N ranks: a column-parallel matmul gives each rank a slice of the
outputs (heads of q/k/v, columns of gate/up), the row-parallel matmul after it gives each rank a partial sum
of the full output, and one all-reduce adds them: two all-reduces per layer, none inside attention or the MLP.
The embedding and the output layer split the vocabulary: a lookup is an all-reduce of the rank that owns the
token's row (the others add zeros), and the logits are all-gathered where sampling happens.

One group per process, the default torch.distributed group: NCCL on CUDA, gloo on the CPU. Without one (a
single rank) every collective is the identity, so model code has no branch for it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# NVLink multicast off in NCCL, PyTorch and NVSHMEM: a program using it can take a shared host's GPUs out of
# service (the device notes); set before the first NCCL call, and inherited by the processes we start
NCCL_SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


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


def current() -> TensorParallel:
    return _current


def init_tensor_parallel(rank: int, size: int, device: torch.device, rendezvous: str,
                         timeout_s: float = 1800.0) -> TensorParallel:
    """Join the group of ``size`` ranks meeting at ``rendezvous`` (a ``file://`` path no earlier group used);
    blocks until every rank has joined. One group per process at a time (``destroy_tensor_parallel`` ends it)."""
    global _current
    if dist.is_initialized():
        raise RuntimeError("tensor_parallel_size: this process already belongs to a tensor-parallel group "
                           "(one tensor-parallel engine per process)")
    os.environ.update(NCCL_SAFETY_ENV)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    # the first collective sets NCCL's communicator up: it must not happen inside a CUDA graph's capture
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != size:
        raise RuntimeError(f"tensor parallel: an all-reduce of ones over {size} ranks gave {probe.item()}")
    _current = TensorParallel(rank, size)
    return _current


def destroy_tensor_parallel() -> None:
    """Leave the group. NCCL's communicators are aborted, a local act: a graceful teardown waits for the other
    ranks' (seen hanging on 2 x H100 while a rank was still stopping), or forever for a rank that died."""
    global _current
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _current = _SINGLE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the ranks, in place (a row-parallel layer's partial outputs)."""
    if _current.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``[rows, n]`` on each rank -> ``[rows, size * n]``: the ranks' slices side by side, rank order."""
    size = _current.size
    if size == 1:
        return x
    gathered = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
    _gather(gathered.view(size * x.shape[0], *x.shape[1:]), x.contiguous())
    return gathered.permute(1, 0, 2).reshape(x.shape[0], size * x.shape[1])


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place (the sampled ids, which only rank 0 computes)."""
    if _current.size > 1:
        dist.broadcast(x, src=0)
    return x


def _gather(out: torch.Tensor, x: torch.Tensor) -> None:
    gather = getattr(dist, "all_gather_single", None)  # (its newer name; all_gather_into_tensor before)
    if gather is not None:
        gather(out, x)
    else:
        dist.all_gather_into_tensor(out, x)
