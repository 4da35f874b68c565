"""The paged KV backend (PagedAttention): one K and one V tensor ``[layers, blocks, block_size, kv_heads,
head_dim]``; attention reads each sequence's blocks through its block table."""
from __future__ import annotations

import torch

from engine.kv_backend.base import KVBackend


class PagedKV(KVBackend):
    """Blocks need no preparation and kernels read block tables: the contract's defaults (no mapping, no
    background work) hold; padding rows of a CUDA graph read block 0. ``dtype`` is the cache's element type
    (EngineConfig.kv_cache_torch_dtype: the model's, or float8_e4m3fn, whose block is half a bfloat16 one)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int) -> None:
        self.shape = (num_layers, block_size, num_kv_heads, head_dim)
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
        self.k_caches = self.v_caches = torch.empty(0)

    def allocate(self, num_blocks: int) -> None:
        """Zeroed, so that masked-out stale slots never carry NaN into a softmax."""
        layers, *rest = self.shape
        self.k_caches = torch.zeros((layers, num_blocks, *rest), dtype=self.dtype, device=self.device)
        self.v_caches = torch.zeros_like(self.k_caches)

    def free(self) -> None:
        self.k_caches = self.v_caches = torch.empty(0)

    def layer_caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_caches[layer], self.v_caches[layer]
