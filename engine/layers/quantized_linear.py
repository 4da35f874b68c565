"""Weight-only quantized linear layers for the CPU (``--cpu-weights``).

Decoding reads every weight once per step, so on a CPU its speed is the weight bytes over memory bandwidth.
The model stays float32 between layers; a quantized layer takes its input in bfloat16 (torch's weight-only CPU
kernels have their vectorized path for bfloat16 only: with float32 or float16 inputs they run 10-40x slower,
measured by ``benchmarks/cpu_quant_linear.py``) and returns float32:

- ``q4``: 4-bit codes in groups of 32 input columns with a scale and a minimum per group, ``w = d * q + m`` (the
  GGUF Q4_1 block). On x86 with AVX2 or AVX-512 computed by our native Q4_1 x Q8 kernel (``Q4Linear``: the
  file's float16 ``d`` and ``m`` exactly, float32 input quantized to 8 bits per 32; kernels/cpu_native.py picks
  the instruction-set level). Elsewhere by torch's weight-only int4 CPU matmul
  (``_weight_int4pack_mm_for_cpu``), whose dequantization is ``(q - 8) * scale + zero``: ``scale = d``,
  ``zero = m + 8 d``, both held in bfloat16 (the kernel's type). From a Q4_1 GGUF the codes are the file's own;
  ``d`` and ``m + 8 d`` (from the file's float16 ``d`` and ``m``) are rounded to bfloat16 (8 significant bits),
  which moves a weight by at most ~0.06 of its block's scale ``d`` (measured, tests/engine/test_cpu_weights.py) — well
  under one 4-bit step (``d``).
- ``int8``: per output channel, symmetric (``_weight_int8pack_mm``).
- ``bfloat16``: the weight in bfloat16 (oneDNN; AMX where the CPU has it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import CPU_WEIGHTS
from kernels.cpu_native import CpuKernels

Q4_GROUP = 32
# outputs per block of the Q4_1 x Q8 / Q8_0 x Q8 layouts (one AVX-512 or two AVX2 vectors)
Q4Q8_OUTPUTS = 16
# outputs per group of PackedInt8Head's weights (kernels/cpu_quant_matmul.cpp, kInt8Outputs)
PACKED_OUTPUTS = 16
# the int4 pack's k-tiling (2 or more lets the kernel read two 16-byte vectors at once)
_INNER_K_TILES = 2


# (the overloads: no resolution per call)
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_int8_mm = torch.ops.aten._weight_int8pack_mm.default


@dataclass
class Q4Blocks:
    """A weight ``[out, in]`` as 4-bit codes ``q`` (uint8, 0..15) with a float16 scale ``d`` and minimum ``m``
    per 32 consecutive inputs of a row: ``w[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]``."""

    q: torch.Tensor  # uint8 [N, K]
    d: torch.Tensor  # float16 [N, K / 32]
    m: torch.Tensor  # float16 [N, K / 32]

    def dequantize(self) -> torch.Tensor:
        """float32 weight as GGUF's own dequantization computes it (``d * q + m`` in float32)."""
        n, k = self.q.shape
        groups = self.q.view(n, k // Q4_GROUP, Q4_GROUP).float()
        return (self.d.float()[..., None] * groups + self.m.float()[..., None]).view(n, k)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Q4Blocks":
        """Round-to-nearest 4-bit codes for a float weight (a model that does not ship 4-bit blocks)."""
        n, k = weight.shape
        if k % Q4_GROUP:
            raise ValueError(f"cpu_weights: q4 needs input sizes divisible by {Q4_GROUP} (got {k})")
        groups = weight.detach().float().view(n, k // Q4_GROUP, Q4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        d = ((high - low) / 15).half()
        m = low.half()
        step = torch.where(d.float() > 0, d.float(), torch.ones_like(low))
        q = (
            ((groups - m.float()[..., None]) / step[..., None])
            .round()
            .clamp_(0, 15)
            .to(torch.uint8)
        )
        return cls(q.view(n, k), d, m)

    @staticmethod
    def cat(parts: list["Q4Blocks"]) -> "Q4Blocks":
        """Rows stacked (a fused projection: its shards' blocks one after the other)."""
        return Q4Blocks(
            torch.cat([p.q for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]),
        )


def q4q8_layout(blocks: Q4Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q4q8_linear``'s layout: codes [N / 16, K / 32, 4, 16, 4] uint8 (vector k of a group: for each of 16
    outputs, inputs 8k .. 8k + 3 in the low nibbles, 8k + 4 .. 8k + 7 in the high ones), ``d`` and ``m``
    [N / 16, K / 32, 16] float16."""
    n, k = blocks.q.shape
    groups = k // Q4_GROUP
    # [block, output, group, vector, nibble, byte]
    q = blocks.q.view(n // Q4Q8_OUTPUTS, Q4Q8_OUTPUTS, groups, 4, 2, 4)
    codes = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).contiguous()

    def per_group(t: torch.Tensor) -> torch.Tensor:
        return t.view(n // Q4Q8_OUTPUTS, Q4Q8_OUTPUTS, groups).permute(0, 2, 1).contiguous()

    return codes, per_group(blocks.d.half()), per_group(blocks.m.half())


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes ``[out, in]`` and one float32 scale per output row (its largest |w| / 127)."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (weight / scales[:, None]).round().clamp_(-127, 127).to(torch.int8).contiguous(), scales


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., in]`` -> float32 ``[..., out]``: the input in the kernel's type (``input_dtype``),
    ``matmul``, bias in float32."""
    rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
    out = self.matmul(rows.to(self.input_dtype)).float()
    if self.bias is not None:
        out += self.bias
    return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


class Q4Linear(nn.Module):
    """4-bit groups. With ``native`` kernels of an x86 level (AVX2, AVX-512, AVX-512 VNNI: kernels/cpu_native.py):
    the native Q4_1 x Q8 kernel (``q4q8_linear``): the blocks' float16 ``d`` and ``m`` exactly, float32
    activations quantized to 8 bits per 32 inputs (llama.cpp's Q8 scheme), exact integer dot products; a row's
    result depends neither on the other rows nor on the level. Otherwise torch's int4 kernel (bfloat16
    activations; ``d`` and ``m + 8 d`` rounded to bfloat16), whose result for a row depends on how many rows it
    is computed with."""

    def __init__(
        self, blocks: Q4Blocks, bias: torch.Tensor | None, native: CpuKernels | None = None
    ) -> None:
        super().__init__()
        n, k = blocks.q.shape
        if k % (_INNER_K_TILES * 16):
            raise ValueError(
                f"cpu_weights: q4 needs input sizes divisible by {_INNER_K_TILES * 16} (got {k})"
            )
        self.in_features, self.out_features = k, n
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        )
        self.q4q8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if native is not None and native.has_q4q8 and n % Q4Q8_OUTPUTS == 0:
            self.q4q8 = q4q8_layout(blocks)
            self._q4q8_linear = native.ops.q4q8_linear.default
            self.input_dtype = torch.float32
            return
        self.input_dtype = torch.bfloat16
        self.register_buffer(
            "packed",
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                blocks.q.to(torch.int32), _INNER_K_TILES
            ),
            persistent=False,
        )
        d, m = blocks.d.float(), blocks.m.float()
        # [K / 32, N, 2]: (scale, zero) per group and output
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([d.t(), (m + 8 * d).t()], dim=-1).to(torch.bfloat16).contiguous(),
            persistent=False,
        )

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[M, in]`` of ``input_dtype`` -> ``[M, out]`` (float32 / bfloat16), no bias (the lean CPU
        decoder's call)."""
        if self.q4q8 is not None:
            return self._q4q8_linear(rows, *self.q4q8)
        return _int4_mm(rows, self.packed, Q4_GROUP, self.scales_and_zeros)

    forward = _forward


class Int8Linear(nn.Module):
    input_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = int8_per_channel(weight)
        self.register_buffer("weight", codes, persistent=False)
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous(), persistent=False)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        )

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return _int8_mm(rows, self.weight, self.scales)

    forward = _forward


class PackedInt8Head(nn.Module):
    """The output layer of the 4- and 8-bit modes where the native CPU kernels are built: int8 weights per output
    channel (as ``Int8Linear``) packed 16 outputs at a time for the native ``int8_linear``, which reads the
    weights once for all rows and keeps the input in float32. torch's weight-only int8 kernel re-reads them per
    row: 1.9 ms for one row of SmolLM2's 49152 x 576 table against 1.1 ms here (docs/BENCHMARKS.md, issue 15)."""

    def __init__(self, weight: torch.Tensor, native: CpuKernels) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._int8_linear = native.ops.int8_linear.default
        if self.out_features % PACKED_OUTPUTS:
            raise ValueError(
                f"cpu_weights: the packed int8 head needs outputs divisible by {PACKED_OUTPUTS}"
            )
        codes, scales = int8_per_channel(weight)
        packed = codes.view(-1, PACKED_OUTPUTS, self.in_features).transpose(1, 2).contiguous()
        self.register_buffer("packed", packed, persistent=False)  # [out / 16, in, 16]
        self.register_buffer("scales", scales.contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._int8_linear(x.reshape(-1, self.in_features).float(), self.packed, self.scales)
        return out.view(*x.shape[:-1], self.out_features)


class Q8Head(nn.Module):
    """The output layer of ``q4`` where the native Q4_1 x Q8 kernels are built: int8 weights with a float16 scale
    per 32 inputs (a Q8_0 GGUF tensor's own blocks, as the default model's tied embedding is: its float32 values
    are d q exactly, so rounding each 32-block to its maximum / 127 finds d and q again), times activations
    quantized to 8 bits per 32 inputs (the native ``q8q8_linear``): llama.cpp's computation of this layer.
    Integer dot products do not slow down with the rows as torch's int8 kernel does (5.3 ms for 8 rows)."""

    def __init__(self, weight: torch.Tensor, native: CpuKernels) -> None:
        super().__init__()
        self._q8q8_linear = native.ops.q8q8_linear.default
        weight = weight.detach().float()
        n, k = self.out_features, self.in_features = weight.shape
        if n % Q4Q8_OUTPUTS or k % Q4_GROUP:
            raise ValueError(
                f"cpu_weights: the Q8 head needs outputs divisible by {Q4Q8_OUTPUTS} and inputs by "
                f"{Q4_GROUP}"
            )
        groups = weight.view(n, k // Q4_GROUP, Q4_GROUP)
        d = (groups.abs().amax(dim=-1) / 127).half()
        step = torch.where(d.float() > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
        codes = (groups / step[..., None]).round().clamp_(-127, 127).to(torch.int16)
        # [block, output, group, vector, byte]
        biased = (
            (codes + 128).to(torch.uint8).view(n // Q4Q8_OUTPUTS, Q4Q8_OUTPUTS, k // Q4_GROUP, 8, 4)
        )
        self.register_buffer("packed", biased.permute(0, 2, 3, 1, 4).contiguous(), persistent=False)
        self.register_buffer(
            "d",
            d.view(n // Q4Q8_OUTPUTS, Q4Q8_OUTPUTS, k // Q4_GROUP).permute(0, 2, 1).contiguous(),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._q8q8_linear(x.reshape(-1, self.in_features).float(), self.packed, self.d)
        return out.view(*x.shape[:-1], self.out_features)


class BFloat16Linear(nn.Module):
    input_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer(
            "weight", weight.detach().to(torch.bfloat16).contiguous(), persistent=False
        )
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        )

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.weight)

    forward = _forward


def quantized_linear(
    mode: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    blocks: Q4Blocks | None = None,
    native: CpuKernels | None = None,
) -> nn.Module:
    """The ``mode`` layer for a float ``weight`` ``[out, in]`` (q4: the given 4-bit ``blocks`` if any, on the
    ``native`` Q4_1 x Q8 kernel where it has one)."""
    if mode == "q4":
        return Q4Linear(blocks if blocks is not None else Q4Blocks.from_float(weight), bias, native)
    if mode == "int8":
        return Int8Linear(weight, bias)
    if mode == "bfloat16":
        return BFloat16Linear(weight, bias)
    raise ValueError(f"cpu_weights: no quantized layer for {mode!r}; one of {CPU_WEIGHTS[1:]}")
