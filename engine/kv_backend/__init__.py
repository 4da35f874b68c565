"""KV backends: who owns the KV memory and how attention addresses it (ARCHITECTURE.md, "KV backends").

- ``paged`` (engine/kv_backend/paged.py): a block pool; kernels read block tables (on the CPU with the default
  kernels ``LeanCpuPagedKV``, whose decode attention is kernels/cpu.py's).
- ``vattention`` (engine/kv_backend/vattention.py): contiguous virtual ranges per request slot, physical
  pages mapped on demand (CUDA only); page accounting in slot_pages.py, driver calls in cuda_vmm.py.

Both implement ``KVBackend`` (engine/kv_backend/base.py), the typed contract, attention's call included.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import lean_cpu
from engine.kv_backend.base import KVBackend
from engine.kv_backend.paged import LeanCpuPagedKV, PagedKV
from engine.kv_backend.vattention import VAttentionKV


def make_kv_backend(
    name: str,
    args: Any,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    max_model_len: int,
    num_slots: int,
    layer_windows: tuple[int, ...] = (),
) -> KVBackend:
    """``layer_windows``: each layer's sliding window, for a model with both kinds of layers (a window group)."""
    if name == "paged":
        paged = LeanCpuPagedKV if lean_cpu(torch.empty(0, device=device)) else PagedKV
        return paged(
            args.num_layers,
            args.num_kv_heads,
            args.head_dim,
            dtype,
            device,
            block_size,
            layer_windows,
        )
    from engine.kv_backend.cuda_vmm import CudaDriver  # noqa: PLC0415 - cuda-bindings only where it runs

    return VAttentionKV(
        CudaDriver(device),
        args.num_layers,
        args.num_kv_heads,
        args.head_dim,
        dtype,
        device,
        max_model_len,
        num_slots,
    )


def window_group(model: Any, config: Any) -> tuple[int, ...]:
    """The model's per-layer sliding windows where its window layers get a KV group of their own (a model with
    both kinds of layers, on one rank, the paged backend), else ()."""
    windows = tuple(getattr(model, "layer_windows", ()))
    if config.tensor_parallel_size > 1 or config.kv_backend != "paged" or not windows:
        return ()
    return windows if 0 in windows and any(windows) else ()


__all__ = [
    "KVBackend",
    "LeanCpuPagedKV",
    "PagedKV",
    "VAttentionKV",
    "make_kv_backend",
    "window_group",
]
