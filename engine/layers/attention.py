"""Attention over the KV cache: store this pass's K/V into their slots, then attend over each sequence's
block table (paged backend) or its contiguous request slot (vattention backend). The KV backend owns that call
(``KVBackend.attend``, engine/kv_backend/): decode-shaped rows and prefill chunks go to their own kernels.

An FP8 cache (``--kv-cache-dtype fp8``, float8 e4m3) is written as ``clamp(x / scale, -448, 448)`` in e4m3 and
read as ``stored * scale``, with this layer's ``k_scale`` and ``v_scale``: 1.0, vLLM's default without calibrated
scales, so K and V values beyond +-448 are clipped and the rest keep 3 mantissa bits (relative error <= 2^-4).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kv_backend.base import KVBackend, Rotation
from engine.forward_context import AttentionMetadata, get_attention_metadata


class PagedAttention(nn.Module):
    """One layer's attention over its KV cache. The KV backend bound at start (``bind``) owns the call: how K and
    V are stored and which kernels read them (paged block tables, vattention's request slots, the CPU's lean
    kernels)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0
    ) -> None:
        """``window`` > 0: a sliding-window layer (Gemma 3's local layers): a token attends to the last
        ``window`` positions, its own included."""
        super().__init__()
        self.window = window
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        # this layer's KV, bound at start: [num_blocks, block_size, kv_heads, head_dim] (paged) or
        # [num_slots, max_len, kv_heads, head_dim] (vattention)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kv: KVBackend | None = None
        # an FP8 cache's per-layer scales (stored = x / scale, read = stored * scale); other caches ignore them
        self.k_scale = 1.0
        self.v_scale = 1.0

    def bind(self, kv: KVBackend, layer: int) -> None:
        """Attend through ``kv`` over its caches of layer ``layer`` (again after each allocation)."""
        self.kv = kv
        self.k_cache, self.v_cache = kv.layer_caches(layer)

    @property
    def kv_fp8(self) -> bool:
        """Whether this layer's cache is FP8 (float8_e4m3fn)."""
        return self.k_cache.dtype == torch.float8_e4m3fn

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: Rotation | None = None
    ) -> torch.Tensor:
        """``q`` ``[T, heads, head_dim]``, ``k``/``v`` ``[T, kv_heads, head_dim]`` -> ``[T, heads * head_dim]``.
        ``rotation``: q and k still to be rotated, which the KV store does in its own launch."""
        return self.attend(q, k, v, get_attention_metadata(), rotation)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """``forward`` with the pass's metadata given (the CPU decoder's layer loop has it at hand)."""
        return self.kv.attend(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            meta,
            self.scale,
            self.k_scale,
            self.v_scale,
            rotation,
            self.window,
        )
