"""The paged KV backend (PagedAttention): one K and one V tensor ``[layers, blocks, block_size, kv_heads,
head_dim]``; attention reads each sequence's blocks through its block table. A model with both sliding-window and
full-attention layers (Gemma 3) has two such pairs: the full layers' over the block manager's pool, the window
layers' over their own, smaller pool (engine/core/window_blocks.py), which the step inputs address by the
window tables packed beside the block tables (``table_shape``)."""

from __future__ import annotations

import math
import mmap
import os
from typing import Callable

import numpy as np
import torch

from engine.kv_backend.base import KVBackend, Rotation, kv_group
from engine.forward_context import AttentionMetadata
from kernels import cpu as cpu_kernels
from kernels import ops as kernel_ops


class PagedKV(KVBackend):
    """Blocks need no preparation and kernels read block tables: the contract's defaults (no mapping, no
    background work) hold; padding rows of a CUDA graph read block 0. ``dtype`` is the cache's element type
    (EngineConfig.kv_cache_torch_dtype: the model's, or float8_e4m3fn, whose block is half a bfloat16 one)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        layer_windows: tuple[int, ...] = (),
    ) -> None:
        """``layer_windows``: each layer's sliding window (0: full attention); with both kinds of layers, the
        window layers get a group of their own."""
        windows = list(layer_windows) or [0] * num_layers
        grouped = 0 in windows and any(windows)
        self.window = max(windows) if grouped else 0
        # layer -> (its group: 0 full, 1 window, its index in the group's caches)
        self.groups: list[tuple[int, int]] = []
        counts = [0, 0]
        for w in windows:
            group = int(grouped and w > 0)
            self.groups.append((group, counts[group]))
            counts[group] += 1
        self.shape = (block_size, num_kv_heads, head_dim)
        self.counts = counts
        self.dtype, self.device, self.block_size = dtype, device, block_size
        per_layer = 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
        self.bytes_per_block = per_layer * counts[0]
        self.window_bytes_per_block = per_layer * counts[1]
        self.free()

    def allocate(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        """Zeroed, so that masked-out stale slots never carry NaN into a softmax."""
        self.k_caches, self.v_caches = self._pair(self.counts[0], num_blocks)
        self.window_k_caches, self.window_v_caches = self._pair(self.counts[1], num_window_blocks)

    def _pair(self, layers: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not layers:
            return torch.empty(0), torch.empty(0)
        shape = (layers, blocks, *self.shape)
        if self.device.type == "cpu":
            return host_zeros(shape, self.dtype), host_zeros(shape, self.dtype)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return k, torch.zeros_like(k)

    def free(self) -> None:
        self.k_caches = self.v_caches = torch.empty(0)
        self.window_k_caches = self.window_v_caches = torch.empty(0)

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        group, index = self.groups[layer]
        if group:
            return self.window_k_caches[index], self.window_v_caches[index]
        return self.k_caches[index], self.v_caches[index]

    def table_shape(self, num_seqs: int, padded_seqs: int, width: int) -> tuple[int, int]:
        """With a window group each row is the block table, then the window table, ``width`` columns each."""
        return num_seqs, width * (2 if self.window else 1)

    def pack_tables(self, out: np.ndarray, table: np.ndarray, rows: np.ndarray) -> None:
        if not self.window:
            out[:] = table[rows, : out.shape[1]]
            return
        width, half = out.shape[1] // 2, table.shape[1] // 2
        out[:, :width] = table[rows, :width]
        out[:, width:] = table[rows, half : half + width]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rotation: Rotation | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        """Through the kernel dispatch (kernels.ops: Triton on CUDA, the torch references on the CPU), over
        each sequence's block table (a sliding-window layer's: its group's, its window)."""
        self.store(q, k, v, k_cache, v_cache, meta, k_scale, v_scale, rotation, window)
        _, tables = kv_group(meta, window)
        out = torch.empty_like(q)
        nd, scales = meta.num_decodes, (scale, k_scale, v_scale)
        if nd:
            decode = (tables[:nd], meta.context_lens[:nd], *scales, window, meta.decode_order)
            kernel_ops.paged_attention(out[:nd], q[:nd], k_cache, v_cache, *decode)
        if nd < q.shape[0]:
            kernel_ops.prefill_attention(
                out[nd:],
                q[nd:],
                k_cache,
                v_cache,
                tables[nd:],
                meta.prefill_cu_seqlens_q,
                meta.context_lens[nd:],
                *scales,
                k[nd:],
                v[nd:],
                window,
            )
        return out.view(q.shape[0], -1)


class LeanCpuPagedKV(PagedKV):
    """The paged backend on the CPU with the default kernels (``kernels.lean_cpu``): decode attention through
    kernels/cpu.py, whose per-pass slot, block and mask values the first layer computes for all (``meta.memo``).
    Those lean functions read float caches only: an FP8 cache takes ``PagedKV.attend`` (the torch references,
    which quantize and dequantize)."""

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rotation: Rotation | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        if k_cache.dtype == torch.float8_e4m3fn:
            return super().attend(
                q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, rotation, window
            )
        # the lean layers rotate before they call (kernels/cpu.py's rotary); any other caller, here
        if rotation is not None:
            if (norm := rotation.qk_norm) is not None:
                q.copy_(kernel_ops.rms_norm(q, norm.q_weight, norm.eps))
                k.copy_(kernel_ops.rms_norm(k, norm.k_weight, norm.eps))
            kernel_ops.rotary_embedding(
                rotation.positions, q, k, rotation.cos_cache, rotation.sin_cache
            )
        slot_mapping, tables = kv_group(meta, window)
        # (per-pass values shared by the layers of one kind: its window, and whether it has its own group)
        kind = (window, tables is not meta.block_tables)
        store = _memo(meta, ("store", kind), lambda: cpu_kernels.store_plan(slot_mapping))
        cpu_kernels.store_kv(k, v, k_cache, v_cache, store)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            plan = _memo(
                meta,
                ("decode", kind),
                lambda: cpu_kernels.decode_plan(
                    tables[:nd], meta.context_lens[:nd], k_cache.shape[1], window
                ),
            )
            cpu_kernels.paged_decode_attention(out[:nd], q[:nd], k_cache, v_cache, plan, scale)
        if nd < q.shape[0]:
            args = (meta.prefill_cu_seqlens_q, meta.context_lens[nd:], scale, 1.0, 1.0)
            kernel_ops.prefill_attention(
                out[nd:], q[nd:], k_cache, v_cache, tables[nd:], *args, None, None, window
            )
        return out.view(q.shape[0], -1)


def _memo(meta: AttentionMetadata, key: object, compute: Callable[[], object]) -> object:
    """``meta.memo[key]``, computed by the first layer of the pass that asks."""
    if (value := meta.memo.get(key)) is None:
        value = meta.memo[key] = compute()
    return value


KV_POOL_MAPPING = "pagedchat-kv"


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor whose pages the kernel maps on first touch: a pool of GiBs costs no time at start
    and no resident memory until its blocks are written (``torch.zeros`` writes every page at once: ~0.2 s and the
    whole pool resident per GiB on a 2-vCPU machine). The mapping is a memfd named ``KV_POOL_MAPPING``, so the
    pool's resident pages can be told apart in /proc/PID/smaps (``/memfd:pagedchat-kv``)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not hasattr(os, "memfd_create"):
        # (nothing to map, or no memfds: Linux has them)
        return torch.zeros(shape, dtype=dtype)
    fd = os.memfd_create(KV_POOL_MAPPING, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        pages = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    # (the tensor's storage holds the mapping: unmapped, and its pages freed, when the last view of it goes)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
