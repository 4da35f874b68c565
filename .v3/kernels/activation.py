"""SwiGLU activation (Triton): ``silu(gate) * up`` for the two halves of the fused gate/up matmul output.

Contract (that of ``reference.silu_and_mul``): ``gate_up`` ``[T, 2I]`` in, a fresh ``[T, I]`` out. Rounding
follows torch's two ops: silu in float32 rounded to the input dtype, then the product rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr
):
    """Program (token, column block): ``out[t, c] = silu(gate_up[t, c]) * gate_up[t, I + c]``."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    row = gate_up_ptr + token * stride_in
    gate = tl.load(row + cols, mask=mask).to(tl.float32)
    up = tl.load(row + INTERMEDIATE + cols, mask=mask).to(tl.float32)
    element = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(element).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, (silu * up).to(element), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.silu_and_mul``."""
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_and_mul: last dim must be 2 * intermediate, not {width}")
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = torch.empty(num_tokens, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(width // 2, _BLOCK))
        _silu_and_mul_kernel[grid](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            INTERMEDIATE=width // 2,
            BLOCK=_BLOCK,
            num_warps=4,
        )
    return out
