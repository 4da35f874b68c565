"""Weight-only quantized linear layers for the CPU (``--cpu-weights``), and the one place that picks a layer for a
mode (``cpu_linear``): model code never branches on formats.

Decoding reads every weight once per step, so on a CPU its speed is the weight bytes over memory bandwidth. The
model stays float32 between layers:

- ``file``: a GGUF model's layers in their file's own block formats (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K),
  on the native tile kernel at every instruction-set level (engine/layers/gguf_linear.py).
- ``q4``: float weights rounded to GGUF's Q4_1 blocks (4-bit codes per 32 inputs with a float16 scale and
  minimum, ``w = d * q + m``), then as ``file``. Without native kernels (no C++ compiler): torch's weight-only int4
  CPU matmul (``_weight_int4pack_mm_for_cpu``, bfloat16 activations), whose dequantization is
  ``(q - 8) * scale + zero``: ``scale = d``, ``zero = m + 8 d``, both rounded to bfloat16 (8 significant bits),
  which moves a weight by at most ~0.06 of its block's ``d`` (tests/engine/test_cpu_weights.py).
- ``int8``: per output channel, symmetric (``_weight_int8pack_mm``).
- ``bfloat16``: the weight in bfloat16 (oneDNN; AMX where the CPU has it; in float32 from slices of it where oneDNN
  has no bfloat16 kernel for the CPU, as on AVX2). Also where ``file`` has no native kernels to run on.

The output layer of ``file`` and ``q4`` is the file's tensor where it has one (a tied embedding's Q8_0 blocks in
the default model), else the float weight rounded to Q8_0 blocks (int8 with a float16 scale per 32 inputs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import CPU_WEIGHTS
from engine.layers.gguf_linear import GGUFLinear
from engine.weights.gguf_blocks import GGUFBlocks
from kernels.cpu_native import CpuKernels
from kernels.quant_blocks import QuantBlocks

GROUP = 32
# outputs per group of PackedInt8Head's weights (kernels/cpu_quant_matmul.cpp, kInt8Outputs)
PACKED_OUTPUTS = 16
# the int4 pack's k-tiling (2 or more lets the kernel read two 16-byte vectors at once)
_INNER_K_TILES = 2


# (the overloads: no resolution per call)
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_int8_mm = torch.ops.aten._weight_int8pack_mm.default


def q4_1_from_float(weight: torch.Tensor) -> QuantBlocks:
    """Round-to-nearest Q4_1 blocks of a float weight ``[N, K]``: per 32 inputs ``d = (max - min) / 15`` and
    ``m = min`` in float16, codes ``round((w - m) / d)`` in 0..15."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"cpu_weights: q4 needs input sizes divisible by {GROUP} (got {k})")
    groups = weight.detach().float().view(n, k // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    d = ((high - low) / 15).half()
    m = low.half()
    step = torch.where(d.float() > 0, d.float(), torch.ones_like(low))
    q = ((groups - m.float()[..., None]) / step[..., None]).round().clamp_(0, 15).to(torch.uint8)
    return QuantBlocks("q4_1", q.view(n, k), d, m)


def q8_0_from_float(weight: torch.Tensor) -> QuantBlocks:
    """Q8_0 blocks of a float weight ``[N, K]``: per 32 inputs ``d = max|w| / 127`` in float16 and codes
    ``round(w / d)`` in -127..127 (stored + 128). For a weight that came from Q8_0 blocks (a GGUF's tied
    embedding de-quantized) this finds the blocks again."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"cpu_weights: Q8_0 needs input sizes divisible by {GROUP} (got {k})")
    groups = weight.detach().float().view(n, k // GROUP, GROUP)
    d = (groups.abs().amax(dim=-1) / 127).half()
    step = torch.where(d.float() > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    codes = (groups / step[..., None]).round().clamp_(-127, 127).to(torch.int16) + 128
    return QuantBlocks("q8_0", codes.to(torch.uint8).view(n, k), d)


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


def _float_bias(bias: torch.Tensor | None) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)


class Q4Linear(nn.Module):
    """Q4_1 blocks on torch's int4 kernel (bfloat16 activations; ``d`` and ``m + 8 d`` rounded to bfloat16): the
    ``q4`` layer where no native kernels were built. A row's result depends on how many rows it is computed with."""

    input_dtype = torch.bfloat16

    def __init__(self, blocks: QuantBlocks, bias: torch.Tensor | None) -> None:
        super().__init__()
        n, k = blocks.shape
        if blocks.format != "q4_1" or k % (_INNER_K_TILES * 16):
            raise ValueError(
                f"cpu_weights: torch's int4 layer takes Q4_1 blocks of inputs divisible by "
                f"{_INNER_K_TILES * 16} (got {blocks.format}, {k})"
            )
        self.in_features, self.out_features = k, n
        self.bias = _float_bias(bias)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            blocks.codes.to(torch.int32), _INNER_K_TILES
        )
        self.register_buffer("packed", packed, persistent=False)
        d, m = blocks.d.float(), blocks.m.float()
        # [K / 32, N, 2]: (scale, zero) per group and output
        self.register_buffer(
            "scales_and_zeros",
            torch.stack([d.t(), (m + 8 * d).t()], dim=-1).to(torch.bfloat16).contiguous(),
            persistent=False,
        )

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return _int4_mm(rows, self.packed, GROUP, self.scales_and_zeros)

    forward = _forward


class Int8Linear(nn.Module):
    input_dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = int8_per_channel(weight)
        self.register_buffer("weight", codes, persistent=False)
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous(), persistent=False)
        self.bias = _float_bias(bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return _int8_mm(rows, self.weight, self.scales)

    forward = _forward


class PackedInt8Head(nn.Module):
    """The output layer of ``int8`` where the native CPU kernels are built: int8 weights per output channel (as
    ``Int8Linear``) packed 16 outputs at a time for the native ``int8_linear``, which reads the weights once for
    all rows and keeps the input in float32. torch's weight-only int8 kernel re-reads them per row: 1.9 ms for one
    row of SmolLM2's 49152 x 576 table against 1.1 ms here (docs/benchmarks/cpu.md, issue 15)."""

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


class Float32Linear(nn.Module):
    """A float weight kept as it is (``file`` mode: a GGUF file's F32 / F16 / BF16 tensors stay float), in float32."""

    input_dtype = torch.float32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().float().contiguous(), persistent=False)
        self.bias = _float_bias(bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.weight)

    forward = _forward


class BFloat16Linear(nn.Module):
    """The weight in bfloat16. Where oneDNN has no bfloat16 kernel for the CPU (AVX2: torch's bfloat16 product is
    then a plain loop, 6-7x float32's time at 16-128 rows), several rows are multiplied in float32 from the
    bfloat16 weight, a slice of outputs at a time (``float32_product``); one row (a decode step's GEMV) keeps the
    bfloat16 product, as fast as float32's there. Either way: exact bfloat16 products summed in float32, rounded to
    bfloat16."""

    input_dtype = torch.bfloat16

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool | None = None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer(
            "weight", weight.detach().to(torch.bfloat16).contiguous(), persistent=False
        )
        self.bias = _float_bias(bias)
        self.onednn = _onednn_has_bfloat16() if onednn is None else onednn

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.onednn or rows.shape[0] == 1:
            return F.linear(rows, self.weight)
        return float32_product(rows, self.weight)

    forward = _forward


def _onednn_has_bfloat16() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (torch's own test; a torch without it: assumed so, torch's
    product as before)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


# float32 bytes of one slice of a weight upcast by float32_product: a slice stays in the cache while it is used
_SLICE_BYTES = 1 << 20


def float32_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows @ weight.T`` of bfloat16 ``rows [M, K]`` and ``weight [N, K]`` in float32 (a slice of the weight's
    outputs upcast at a time), rounded to bfloat16 ``[M, N]``."""
    n, k = weight.shape
    step = max(1, _SLICE_BYTES // (4 * k))
    x = rows.float()
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16, device=rows.device)
    for start in range(0, n, step):
        out[:, start : start + step] = F.linear(x, weight[start : start + step].float())
    return out


def cpu_linear(
    mode: str,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    parts: list[QuantBlocks | GGUFBlocks] | None = None,
    native: CpuKernels | None = None,
) -> nn.Module:
    """The ``mode`` layer of a linear weight ``[out, in]``: its file's blocks ``parts`` (a fused projection's
    shards side by side) where given, else the float ``weight``; on the native kernels where they were built."""
    if mode not in CPU_WEIGHTS or mode == "float32":
        raise ValueError(
            f"cpu_weights: no quantized layer for {mode!r}; one of {CPU_WEIGHTS[:1] + CPU_WEIGHTS[2:]}"
        )
    if mode == "file" and parts is None:  # (a float tensor of the file: computed as it is)
        return Float32Linear(weight, bias)
    if mode in ("file", "q4"):
        if parts is None or mode == "q4":
            source = weight if parts is None else torch.cat([p.dequantize() for p in parts])
            parts = [q4_1_from_float(source)]
        if native is not None:
            return GGUFLinear(parts, bias, native)
        if all(p.format == "q4_1" for p in parts) and len(parts) == 1:
            part = parts[0]
            return Q4Linear(part.unpack() if isinstance(part, GGUFBlocks) else part, bias)
        weight = torch.cat([p.dequantize() for p in parts])
        mode = "bfloat16"
    elif parts is not None:
        weight = torch.cat([p.dequantize() for p in parts])
    if mode == "int8":
        return Int8Linear(weight, bias)
    return BFloat16Linear(weight, bias)


def cpu_logits_head(
    mode: str,
    weight: torch.Tensor | None,
    blocks: QuantBlocks | GGUFBlocks | None,
    native: CpuKernels | None,
    release: Callable[[], None] | None = None,
) -> nn.Module:
    """The output layer of ``mode``: bfloat16 for bfloat16; for ``file`` and ``q4`` the file's blocks (else the
    float weight rounded to Q8_0) on the native kernel; for ``int8`` (and where nothing native was built) int8 per
    output channel, packed for the native kernel where there is one."""
    if mode == "bfloat16":
        return BFloat16Linear(weight if weight is not None else blocks.dequantize(), None)
    if mode in ("file", "q4") and native is not None:
        if blocks is None or mode == "q4":
            blocks = q8_0_from_float(weight if weight is not None else blocks.dequantize())
        return GGUFLinear([blocks], None, native, release)
    weight = weight if weight is not None else blocks.dequantize()
    if native is not None and weight.shape[0] % PACKED_OUTPUTS == 0:
        return PackedInt8Head(weight, native)
    return Int8Linear(weight, None)
