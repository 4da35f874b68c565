"""Gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), with gate and up fused in one matmul."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear
from kernels import ops as kernel_ops


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernel_ops.silu_and_mul(self.gate_up_proj(x)))
