"""Where the engine takes the skinny matmul (kernels/skinny_gemm.py) over cuBLAS: the shapes it measured faster
at, no others. No Triton import here, so a CPU-only install can ask.

``python -m benchmarks.skinny_gemm`` on an H100 (2026-11-27, bf16, each call's weight from HBM; results in
docs/results/skinny-gemm-h100-2026-11-27.json) timed every projection of llama-3.2-1b and llama-3-8b at M = 1, 2,
4, 8, 16 and 32 rows against cuBLAS. ``FASTER_THAN_CUBLAS`` holds each (op, rows rounded up to a power of two,
weight rows N, K) where ours won; it is used on that architecture only (compute capability 9.0: H100, H200)
and for 16-bit inputs only. ``FASTER_WITH_PDL`` adds llama-3.2-1b's qkv and o projections (0.1-0.5 us slower
alone) where the kernels launch with PDL, measured in the engine's decode step. Every other shape, device or dtype
keeps cuBLAS: llama-3-8b's o projection at 32 rows, any model not measured (qwen3-0.6b, the tensor-parallel
shards), float32.
"""

from __future__ import annotations

import torch

from kernels.device_features import capability, use_pdl

MAX_ROWS = 32
GEMM, SILU_AND_MUL = "gemm", "silu_and_mul"
HOPPER = (9, 0)
_BUCKETS = (1, 2, 4, 8, 16, 32)

FASTER_THAN_CUBLAS: frozenset[tuple[str, int, int, int]] = frozenset(
    [(GEMM, m, n, k) for n, k in ((2048, 8192), (4096, 14336), (6144, 4096)) for m in _BUCKETS]
    + [(GEMM, m, 4096, 4096) for m in _BUCKETS[:-1]]
    + [(GEMM, m, n, k) for n, k in ((16384, 2048), (28672, 4096)) for m in _BUCKETS]
    + [(GEMM, m, 128256, k) for k in (2048, 4096) for m in _BUCKETS]
    + [(SILU_AND_MUL, m, n, k) for n, k in ((16384, 2048), (28672, 4096)) for m in _BUCKETS]
)


# Shapes where ours lost to cuBLAS by a launch's fixed cost when timed alone (llama-3.2-1b's qkv and o), taken
# where the kernels launch with PDL (kernels/pdl.py): in the decode step's chain ours then starts streaming its
# weight while the kernel before it finishes, which a cuBLAS launch cannot. Measured in the engine's decode step on
# an H100 (docs/BENCHMARKS.md, "programmatic dependent launch"): 1.276 against 1.293 ms at 1 stream, 1.482 against
# 1.497 ms at 16.
FASTER_WITH_PDL: frozenset[tuple[str, int, int, int]] = frozenset(
    (GEMM, m, n, k) for n, k in ((3072, 2048), (2048, 2048)) for m in _BUCKETS
)


def row_bucket(m: int) -> int:
    """M rounded up to a power of two: the tables' key (1, 2, 4, 8, 16, 32)."""
    return 1 << max(m - 1, 0).bit_length()


def prefer_skinny(op: str, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` (``op``: plain, or gate/up with SiLU-and-mul) goes through the skinny kernel."""
    if not x.is_cuda or x.dim() != 2:
        return False
    m = x.shape[0]
    if not (0 < m <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    key = (op, row_bucket(m), *weight.shape)
    return (
        weight.dtype == x.dtype
        and capability(x.device) == HOPPER
        and (key in FASTER_THAN_CUBLAS or (key in FASTER_WITH_PDL and use_pdl(x.device)))
    )
