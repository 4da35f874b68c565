"""A mixture-of-experts MLP (Qwen3-MoE's): a router picks each token's top-k of E experts (softmax over the router's
logits, renormalised over the k when the model says so), and the token's output is the routing-weighted sum of its
experts' gated MLPs, ``down_e(silu(gate_e(x)) * up_e(x))``. Only the chosen experts' weights are read: on the GPU
by the fused Triton kernel (kernels/fused_moe.py), on the CPU by its reference in float32, or with quantized
weights (``--cpu-weights``) by each chosen expert's own GGUF layer.

Parameters under transformers' names: ``gate.weight`` ``[E, H]`` (the router), ``experts.gate_up_proj``
``[E, 2I, H]`` (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops as kernel_ops
from kernels.reference import route


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        # per expert (gate_up, down): quantized CPU layers (``quantize``), else None (the float parameters)
        self.cpu_experts: list[tuple[nn.Module, nn.Module]] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's expert weights (float32) and ids (int32), ``[T, top_k]``."""
        return route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.cpu_experts is not None:
            return self._quantized(x.float(), weights, ids)
        return kernel_ops.fused_moe(
            x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids
        )

    def _quantized(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The chosen experts one at a time, in ascending order (the reference's order of the sum)."""
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            gate_up, down = self.cpu_experts[expert]
            act = gate_up(x[tokens])
            hidden = F.silu(act[:, : self.intermediate_size]) * act[:, self.intermediate_size :]
            out.index_add_(0, tokens, down(hidden) * weights[tokens, slots, None])
        return out

    def quantize(self, layers: list[tuple[nn.Module, nn.Module]]) -> None:
        """Compute with these per-expert (gate_up, down) layers from now on; the float parameters go."""
        self.cpu_experts = layers
        self.experts = None
