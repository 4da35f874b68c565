"""A weight in one of GGUF's block formats, unpacked: one code per weight and its blocks' scales, as the file holds
them (nothing rounded again). The CPU kernels repack it into tiles (kernels/cpu_tiles.py); ``dequantize`` gives the
float32 weight by ggml's own formulas (the GPU loads that, in bfloat16, and the float32 CPU mode uses it).

Formats (ggml's names), per row of K inputs; codes are unsigned, ``o`` the format's offset:

| format | codes | per 32 inputs | per 256 inputs | weight |
| --- | --- | --- | --- | --- |
| q4_0 | 0..15 | d | | d (q - 8) |
| q4_1 | 0..15 | d, m | | d q + m |
| q5_0 | 0..31 | d | | d (q - 16) |
| q8_0 | 0..255 | d | | d (q - 128)  (the int8 value + 128) |
| q4_k | 0..15 | sc, mn (6-bit) | d, dmin | (d sc) q - (dmin mn) |
| q5_k | 0..31 | sc, mn (6-bit) | d, dmin | (d sc) q - (dmin mn) |
| q6_k | 0..63 | sc (int8, per 16 inputs) | d | (d sc) (q - 32) |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# format -> (code bits, inputs per block (its d), the codes' offset)
FORMATS: dict[str, tuple[int, int, int]] = {
    "q4_0": (4, 32, 8),
    "q4_1": (4, 32, 0),
    "q5_0": (5, 32, 16),
    "q8_0": (8, 32, 128),
    "q4_k": (4, 256, 0),
    "q5_k": (5, 256, 0),
    "q6_k": (6, 256, 32),
}


@dataclass(slots=True)
class QuantBlocks:
    """``[N, K]`` weight: ``codes`` uint8 ``[N, K]``; ``d`` float16 ``[N, K / block]``; ``m`` float16: q4_1's
    minimum ``[N, K / 32]`` or the K formats' ``dmin`` ``[N, K / 256]``; ``sc`` the K formats' sub-block scales
    (uint8 ``[N, K / 32]``, or int8 ``[N, K / 16]`` for q6_k); ``mn`` q4_k / q5_k's sub-block minimums (uint8
    ``[N, K / 32]``)."""

    format: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(
                f"weights: unknown block format {self.format!r}; one of {list(FORMATS)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def block(self) -> int:
        return FORMATS[self.format][1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``, as ggml's dequantization computes it (one rounding per product, sum)."""
        n, k = self.codes.shape
        _, block, offset = FORMATS[self.format]
        # (in place from the codes' float32 copy: the same roundings as the expression, one tensor a step fewer)
        q = self.codes.view(n, k // 32, 32).float()
        if offset:
            q.sub_(offset)
        if self.format in ("q4_0", "q5_0", "q8_0"):
            return q.mul_(self.d.float()[..., None]).view(n, k)
        if self.format == "q4_1":
            return q.mul_(self.d.float()[..., None]).add_(self.m.float()[..., None]).view(n, k)
        per_block = 256 // (16 if self.format == "q6_k" else 32)
        scale = self.d.float().repeat_interleave(per_block, dim=1) * self.sc.float()
        if self.format == "q6_k":
            return (scale[..., None] * q.view(n, k // 16, 16).float()).view(n, k)
        low = self.m.float().repeat_interleave(per_block, dim=1) * self.mn.float()
        return (scale[..., None] * q.float() - low[..., None]).view(n, k)

    def rows(self, start: int, end: int) -> "QuantBlocks":
        """Rows ``start .. end - 1`` (a tensor-parallel shard, a fused projection's part)."""

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:end]

        return QuantBlocks(
            self.format, part(self.codes), part(self.d), part(self.m), part(self.sc), part(self.mn)
        )

    def reorder_rows(self, order: torch.Tensor) -> "QuantBlocks":
        """The rows in ``order`` (whole rows move, so every block stays intact)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, order.to(t.device))

        return QuantBlocks(
            self.format, pick(self.codes), pick(self.d), pick(self.m), pick(self.sc), pick(self.mn)
        )
