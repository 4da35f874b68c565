"""The device's read-only stream: every element of a buffer read once by a Triton kernel that sums each program's
chunk. What a kernel that only reads (weights, a KV cache) is judged against: the device's METHOD.md asks for
measured ceilings, not the datasheet's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of one program's CHUNK elements (fp32), so that every byte of ``src`` is read once and kept."""
    start = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, CHUNK, BLOCK):
        idx = start + offset + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


class ReadStream:
    """A launch that reads all of ``src`` once per call, ``chunk`` elements a program (``block`` a loop step); the
    programs' fp32 sums land in ``sums``."""

    def __init__(self, src: torch.Tensor, chunk: int, block: int = 4096) -> None:
        self.src, self.chunk, self.block = src, min(chunk, src.numel()), block
        self.grid = (triton.cdiv(src.numel(), self.chunk),)
        self.sums = torch.empty(self.grid[0], device=src.device, dtype=torch.float32)

    def __call__(self) -> None:
        _read_kernel[self.grid](
            self.src, self.sums, self.src.numel(), self.chunk, self.block, num_warps=8
        )
