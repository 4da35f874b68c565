"""Gated MLP: down(act(gate(x)) * up(x)) with act SiLU (SwiGLU: Llama, Qwen) or GeLU with tanh (GeGLU: Gemma),
gate and up fused in one matmul. Under tensor parallelism each rank holds a slice of the intermediate columns
(gate and up: column-parallel; down: row-parallel, one all-reduce)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import MLP_EXCHANGE, ColumnParallelLinear, RowParallelLinear
from kernels import ops as kernel_ops
from kernels.skinny_choice import SILU_AND_MUL, prefer_skinny

ACTIVATIONS = ("silu", "gelu_tanh")


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, activation: str = "silu"
    ) -> None:
        """``intermediate_size``: this rank's columns (all of them with one rank)."""
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"model: MLP activation {activation!r} is not one of {ACTIVATIONS}")
        self.activation = activation
        self.gate_up_proj = ColumnParallelLinear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, exchange=MLP_EXCHANGE
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(x))

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate(x)) * up(x)``: the down projection's input (a decode step's few rows in one kernel where
        it measured faster: kernels/skinny_choice.py)."""
        proj = self.gate_up_proj
        if (
            self.activation == "gelu_tanh"
        ):  # (torch's own: transformers' gelu_pytorch_tanh, bit for bit)
            gate, up = proj(x).chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        if x.is_cuda and proj.bias is None and prefer_skinny(SILU_AND_MUL, x, proj.weight):
            return kernel_ops.skinny_gemm_silu_and_mul(x, proj.weight)
        return kernel_ops.silu_and_mul(proj(x))
