"""The paged KV backend (PagedAttention): one K and one V tensor ``[layers, blocks, block_size, kv_heads,
head_dim]``; attention reads each sequence's blocks through its block table."""
from __future__ import annotations

import numpy as np
import torch


class PagedKV:
    contiguous = False
    lookahead_tokens = 0  # (blocks need no preparation)
    scratch_slot = 0  # (padding rows of a CUDA graph read block 0: always allocated memory)

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

    def map_rows(self, rows: np.ndarray, tables: np.ndarray, widths: np.ndarray, ends: np.ndarray,
                 wait_in_flight: object) -> None:
        """(Block tables are read by the kernels: nothing to map.)"""

    def release_row(self, row: int) -> None:
        pass

    def reclaim(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}
