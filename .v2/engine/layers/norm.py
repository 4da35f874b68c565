"""RMSNorm, optionally fused with the residual add that precedes it (kernels.ops.rms_norm)."""

from __future__ import annotations

import torch
from torch import nn

import torch.nn.functional as F

from kernels import lean_cpu, ops as kernel_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)`` over the last dim; with ``residual``: ``(norm(x + residual), x + residual)``, the sum
        written into ``residual`` in place (it is the new residual stream). The norm is computed in float32
        whatever the model dtype, as the reference implementation does."""
        # one op (the reference's arithmetic, bit for bit)
        if x.dtype == torch.float32 and lean_cpu(x):
            if residual is None:
                return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            torch.add(x, residual, out=residual)
            return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual
        if residual is None:
            return kernel_ops.rms_norm(x, self.weight, self.eps)
        return kernel_ops.rms_norm(x, self.weight, self.eps, residual)
