"""A model's decoder layers as the persistent decode kernel reads them (kernels/persistent_decode.py): each
layer's tensors, and a device table of their addresses. Torch only, so the reference and a CPU-only install
need no Triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LayerTensors:
    """One decoder layer as the kernel reads it (nn.Linear layouts; gate rows before up rows)."""

    qkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, hidden]
    o: torch.Tensor  # [hidden, heads * head_dim]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    norm_in: torch.Tensor  # [hidden]: input_layernorm
    norm_post: torch.Tensor  # [hidden]: post_attention_layernorm
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor


class DecoderStack:
    """A model's decoder layers for the persistent kernel: their tensors, and the device table of where each
    lies (built once; rebuild after the caches are reallocated)."""

    def __init__(
        self,
        layers: list[LayerTensors],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> None:
        first = layers[0]
        self.layers, self.eps = layers, eps
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden, self.intermediate = first.o.shape[0], first.down.shape[1]
        shapes = {
            "qkv": (first.qkv.shape, ((num_heads + 2 * num_kv_heads) * head_dim, self.hidden)),
            "o": (first.o.shape, (self.hidden, num_heads * head_dim)),
            "gate_up": (first.gate_up.shape, (2 * self.intermediate, self.hidden)),
        }
        for name, (got, want) in shapes.items():
            if tuple(got) != want:
                raise ValueError(f"DecoderStack: {name} weight {tuple(got)}, expected {want}")
        for layer in layers:
            tensors = [getattr(layer, name) for name in LayerTensors.__slots__]
            if any(t.dtype != first.qkv.dtype or not t.is_contiguous() for t in tensors):
                raise ValueError(
                    "DecoderStack: every tensor contiguous, of one dtype (no FP8 cache)"
                )
            if layer.k_cache.stride() != first.k_cache.stride():
                raise ValueError("DecoderStack: every layer's cache must share one layout")
        # the kernel addresses every tensor from the first weight: offsets in elements, multiples of 16 bytes
        self.base = first.qkv
        size = first.qkv.element_size()
        offsets = []
        for layer in layers:
            row = [
                getattr(layer, name).data_ptr() - self.base.data_ptr()
                for name in LayerTensors.__slots__
            ]
            if any(offset % 16 for offset in row):
                raise ValueError("DecoderStack: every tensor must start on a 16-byte boundary")
            offsets.append([offset // size for offset in row])
        self.table = torch.tensor(offsets, dtype=torch.int64, device=first.qkv.device)
