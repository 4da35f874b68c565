"""KV backends: who owns the KV memory and how attention addresses it (ARCHITECTURE.md, "KV backends").

- ``paged`` (engine/kv_backend/paged.py): a block pool; kernels read block tables (on the CPU with the default
  kernels ``LeanCpuPagedKV``, whose decode attention is kernels/cpu.py's).
- ``vattention`` (engine/kv_backend/vattention.py): contiguous virtual ranges per request slot, physical
  pages mapped on demand (CUDA only); page accounting in slot_pages.py, driver calls in cuda_vmm.py.

Both implement ``KVBackend`` (engine/kv_backend/base.py), the typed contract, attention's call included.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kernels import lean_cpu
from engine.kv_backend.base import KVBackend
from engine.kv_backend.paged import LeanCpuPagedKV, PagedKV
from engine.kv_backend.vattention import VAttentionKV

logger = logging.getLogger(__name__)


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


def backend_block_size(kv: KVBackend, config: Any) -> int:
    """The block size the backend took (a contiguous backend's is one page of tokens), logged where it is not
    ``config.block_size``."""
    if kv.block_size != config.block_size:
        logger.info(
            "kv_backend %s: block size %d tokens (one %d MiB page per layer for K and V)",
            config.kv_backend,
            kv.block_size,
            kv.page_bytes >> 20,
        )
    return kv.block_size


def split_budget(kv: KVBackend, config: Any, bytes_per_block: int, budget: int) -> tuple[int, int]:
    """``budget`` bytes as (full blocks of ``bytes_per_block``, window blocks): the window group takes what its
    running sequences can hold (a window and two blocks each, and a step's prompt tokens) twice over, so that
    finished sessions' windows stay cached, but at most its layers' share; the full layers the rest."""
    if not kv.window:
        return budget // bytes_per_block, 0
    per_seq = -(-kv.window // kv.block_size) + 2
    wanted = 2 * (config.max_num_seqs * per_seq + config.max_num_batched_tokens // kv.block_size)
    share = kv.window_bytes_per_block / (kv.window_bytes_per_block + kv.bytes_per_block)
    window_blocks = max(2, min(wanted, int(budget * share) // kv.window_bytes_per_block))
    return (budget - window_blocks * kv.window_bytes_per_block) // bytes_per_block, window_blocks


__all__ = [
    "KVBackend",
    "LeanCpuPagedKV",
    "PagedKV",
    "VAttentionKV",
    "make_kv_backend",
    "window_group",
]
