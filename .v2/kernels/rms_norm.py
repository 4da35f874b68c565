"""RMSNorm fused with the residual add that precedes it (Triton), for ``[T, hidden]`` rows and for the
per-head ``[T, heads, head_dim]`` q/k norm of Qwen3.

Contract (that of ``reference.rms_norm``): with ``residual``, ``s = x + residual`` is written into
``residual`` in place and ``(weight * norm(s), s)`` is returned, ``s`` being ``residual`` itself; without,
``weight * norm(x)``. The normed output is a fresh contiguous tensor. In place into ``residual`` because the
sum is the new residual stream anyway (no allocation); not in place into ``x`` because without a residual
``x`` is often still needed (the first layer keeps the embeddings as its residual). Bytes are the same either
way: read x (+ residual), write the output (+ the sum).

Strided inputs are read where they lie (only the last dim must be contiguous): Qwen3's q/k are views of the
fused qkv output, and copying them contiguous first would read and write every element once more.

Rounding follows torch's op order: the sum is rounded to the input dtype, the norm is computed in float32
and rounded to the input dtype, then multiplied by the weight and rounded to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device_features import use_pdl
from kernels.pdl import release_next, wait_for_previous
from kernels.specialization import per_step

_ELEMENTS_PER_PROGRAM = 2048  # rows per program: enough work per program for short (head_dim) rows


@triton.jit(**per_step("num_rows"))
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    heads,
    stride_xt,
    stride_xh,
    stride_rt,
    stride_rh,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p normalizes flat rows ``p * ROWS ..`` (row ``r`` is token ``r // heads``, head ``r % heads``)."""
    wait_for_previous(PDL)
    release_next(PDL)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (dims < HIDDEN)[None, :]
    token, head = rows // heads, rows % heads
    x_offs = (token * stride_xt + head * stride_xh)[:, None] + dims[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_offs = (token * stride_rt + head * stride_rh)[:, None] + dims[None, :]
        residual = tl.load(residual_ptr + r_offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + r_offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / HIDDEN + eps)
    normed = (h * rstd[:, None]).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + dims, mask=dims < HIDDEN, other=0.0).to(tl.float32)
    out = (weight[None, :] * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * HIDDEN + dims[None, :], out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.rms_norm``: normalizes over the last dim of a 2-D or 3-D ``x``."""
    if x.dim() not in (2, 3):
        raise ValueError(
            f"rms_norm: x must be [T, hidden] or [T, heads, head_dim], not {tuple(x.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(
            "rms_norm: residual must have x's shape and a contiguous last dim (written in place)"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    hidden, heads = x.shape[-1], x.shape[1] if x.dim() == 3 else 1
    num_rows = x.shape[0] * heads
    if num_rows:
        block_d = triton.next_power_of_2(hidden)
        rows = max(1, _ELEMENTS_PER_PROGRAM // block_d)
        r = residual if residual is not None else x  # any pointer: not read without HAS_RESIDUAL
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x,
            r,
            weight,
            out,
            num_rows,
            heads,
            x.stride(0),
            _head_stride(x),
            r.stride(0),
            _head_stride(r),
            eps,
            HIDDEN=hidden,
            BLOCK_D=block_d,
            ROWS=rows,
            HAS_RESIDUAL=residual is not None,
            PDL=(pdl := use_pdl(x.device)),
            num_warps=min(16, max(1, rows * block_d // 512)),
            launch_pdl=pdl,
        )
    return out if residual is None else (out, residual)


def _head_stride(t: torch.Tensor) -> int:
    return t.stride(1) if t.dim() == 3 else 0
