"""A GGUF tensor's raw blocks -> its codes and scales (kernels/quant_blocks.py's QuantBlocks), or a float tensor for
F32 / F16 / BF16. Vectorized torch on whichever device the bytes are: the CPU for the native kernels' tiles, the
GPU for a de-quantization to bfloat16 in place of a host-side one.

ggml's block layouts (ggml-common.h), bytes per block of 32 (or 256) weights:
- Q4_0 (18): d f16 | 16 bytes: weight j's 4-bit code in byte j's low nibble, j + 16's in its high nibble.
- Q4_1 (20): d f16 | m f16 | 16 bytes as Q4_0.
- Q5_0 (22): d f16 | 4 bytes: bit j = weight j's fifth bit | 16 bytes as Q4_0.
- Q8_0 (34): d f16 | 32 int8.
- Q4_K (144): d f16 | dmin f16 | 12 bytes of eight 6-bit scales and minimums | 128 bytes: for each 64 weights, 32
  bytes whose low nibbles are the first 32 and high nibbles the next 32.
- Q5_K (176): as Q4_K, with 32 bytes of fifth bits (bit s of byte l: weight 32 s + l) before the 128.
- Q6_K (210): 128 bytes of low nibbles | 64 bytes of top two bits | 16 int8 scales (per 16 weights) | d f16; for
  each 128 weights (half n) and l < 32: weight 32k + l (k = 0..3) takes nibble (k // 2 ? high : low) of byte
  64n + l + 32 (k mod 2) and bits 2k, 2k + 1 of byte 32n + l of the top bits.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from engine.weights.gguf_file import GGUFTensor
from kernels.quant_blocks import QuantBlocks

FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
BLOCK_FORMATS = {
    T.Q4_0: "q4_0",
    T.Q4_1: "q4_1",
    T.Q5_0: "q5_0",
    T.Q8_0: "q8_0",
    T.Q4_K: "q4_k",
    T.Q5_K: "q5_k",
    T.Q6_K: "q6_k",
}
SUPPORTED = sorted(t.name for t in [*FLOAT_TYPES, *BLOCK_FORMATS])


@dataclass(slots=True)
class GGUFBlocks:
    """A weight ``[N, K]`` as its file holds it: ``data`` uint8 ``[N, bytes per row]`` of ``format``'s blocks
    (whole rows: a row's blocks are its own). The CPU repacks these bytes into tiles natively; ``unpack`` gives
    the codes and scales (kernels/quant_blocks.py) for everything else."""

    format: str
    data: torch.Tensor
    shape: tuple[int, int]

    def unpack(self) -> QuantBlocks:
        return unpack(self.format, self.data, *self.shape)

    def dequantize(self) -> torch.Tensor:
        return self.unpack().dequantize()

    def rows(self, start: int, end: int) -> "GGUFBlocks":
        return GGUFBlocks(self.format, self.data[start:end], (end - start, self.shape[1]))

    def reorder_rows(self, order: torch.Tensor) -> "GGUFBlocks":
        return GGUFBlocks(self.format, self.data.index_select(0, order), self.shape)


def raw_bytes(tensor: GGUFTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor's bytes as a uint8 torch tensor on ``device``: on the CPU a view of the map, not a copy (read
    only: the map is, and nothing writes a weight's bytes in place; a copy would cost the load its time and its
    peak memory the file's size again), elsewhere copied to the device."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        view = torch.from_numpy(tensor.data)
    return view if torch.device(device).type == "cpu" else view.to(device)


def read(tensor: GGUFTensor, device: torch.device | str = "cpu") -> torch.Tensor | GGUFBlocks:
    """The float tensor (its file type: float32, float16 or bfloat16) or the blocks of ``tensor``; ValueError
    naming the tensor for a block type no kernel reads."""
    data = raw_bytes(tensor, device)
    if tensor.type in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[tensor.type]).view(tensor.shape)
    if tensor.type not in BLOCK_FORMATS or len(tensor.shape) not in (2, 3):
        raise ValueError(
            f"weights: tensor {tensor.name!r} is {tensor.type.name} "
            f"{list(tensor.shape)}; pagedchat reads {', '.join(SUPPORTED)} (2-D or 3-D for block types)"
        )
    # (a stack of matrices, as MoE experts: their rows one after another)
    cols = tensor.shape[-1]
    rows = tensor.num_elements // cols
    return GGUFBlocks(BLOCK_FORMATS[tensor.type], data.view(rows, -1), (rows, cols))


def rows_from_bytes(kind: T, data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` in its float type (F32 / F16 / BF16) or de-quantized to float32, from its raw bytes."""
    if kind in FLOAT_TYPES:
        return data.view(FLOAT_TYPES[kind]).view(rows, cols)
    return unpack(BLOCK_FORMATS[kind], data, rows, cols).dequantize()


def unpack(fmt: str, data: torch.Tensor, rows: int, cols: int) -> QuantBlocks:
    """``data``: the raw bytes of a ``[rows, cols]`` tensor of block format ``fmt``."""
    return _UNPACK[fmt](data.view(rows, -1), rows, cols)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Two bytes of each block (a strided slice: the blocks' sizes are even) read as float16, in place: a view,
    not a copy of every block's scale."""
    return raw.view(torch.float16)[..., 0]


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: low nibbles first, then high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(raw: torch.Tensor) -> torch.Tensor:
    """Bytes [..., B] -> bits [..., B * 8], bit b of byte i at 8 i + b."""
    shifts = torch.arange(8, device=raw.device, dtype=torch.uint8)
    return ((raw[..., None] >> shifts) & 1).flatten(-2)


def _q4_0(data: torch.Tensor, rows: int, cols: int) -> QuantBlocks:
    b = data.view(rows, cols // 32, 18)
    return QuantBlocks("q4_0", _low_high(b[..., 2:]).view(rows, cols), _f16(b[..., :2]))


def _q4_1(data: torch.Tensor, rows: int, cols: int) -> QuantBlocks:
    b = data.view(rows, cols // 32, 20)
    codes = _low_high(b[..., 4:]).view(rows, cols)
    return QuantBlocks("q4_1", codes, _f16(b[..., :2]), _f16(b[..., 2:4]))


def _q5_0(data: torch.Tensor, rows: int, cols: int) -> QuantBlocks:
    b = data.view(rows, cols // 32, 22)
    codes = _low_high(b[..., 6:]) | (_bits(b[..., 2:6]) << 4)
    return QuantBlocks("q5_0", codes.view(rows, cols), _f16(b[..., :2]))


def _q8_0(data: torch.Tensor, rows: int, cols: int) -> QuantBlocks:
    b = data.view(rows, cols // 32, 34)
    return QuantBlocks("q8_0", (b[..., 2:] ^ 0x80).reshape(rows, cols), _f16(b[..., :2]))


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit minimums (ggml's get_scale_min_k4)."""
    first, second, third = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((first & 63, (third & 0x0F) | ((first >> 6) << 4)), dim=-1)
    mn = torch.cat((second & 63, (third >> 4) | ((second >> 6) << 4)), dim=-1)
    return sc, mn


def _k_codes(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 256 4-bit codes: per 64 weights, 32 low nibbles then 32 high nibbles."""
    q = qs.unflatten(-1, (4, 32))
    return torch.stack((q & 0x0F, q >> 4), dim=-2).flatten(-3)


def _q4_k(data: torch.Tensor, rows: int, cols: int) -> QuantBlocks:
    b = data.view(rows, cols // 256, 144)
    sc, mn = _k_scales(b[..., 4:16])
    codes = _k_codes(b[..., 16:]).reshape(rows, cols)
    return QuantBlocks(
        "q4_k",
        codes,
        _f16(b[..., :2]),
        _f16(b[..., 2:4]),
        sc.reshape(rows, -1),
        mn.reshape(rows, -1),
    )


def _q5_k(data: torch.Tensor, rows: int, cols: int) -> QuantBlocks:
    b = data.view(rows, cols // 256, 176)
    sc, mn = _k_scales(b[..., 4:16])
    # fifth bit of weight 32 s + l: bit s of byte l
    fifth = _bits(b[..., 16:48]).unflatten(-1, (32, 8)).transpose(-1, -2).flatten(-2)
    codes = (_k_codes(b[..., 48:]) | (fifth << 4)).reshape(rows, cols)
    return QuantBlocks(
        "q5_k",
        codes,
        _f16(b[..., :2]),
        _f16(b[..., 2:4]),
        sc.reshape(rows, -1),
        mn.reshape(rows, -1),
    )


def _q6_k(data: torch.Tensor, rows: int, cols: int) -> QuantBlocks:
    b = data.view(rows, cols // 256, 210)
    low = b[..., :128].unflatten(-1, (2, 64))  # [.., half, 64]
    low = torch.cat((low & 0x0F, low >> 4), dim=-1)  # weights 32k + l for k = 0..3
    high = b[..., 128:192].unflatten(-1, (2, 1, 32))  # [.., half, 1, 32]
    shifts = torch.arange(0, 8, 2, device=data.device, dtype=torch.uint8)[:, None]
    top = ((high >> shifts) & 3).flatten(-2)  # [.., half, 128]
    codes = (low | (top << 4)).reshape(rows, cols)
    sc = b[..., 192:208].contiguous().view(torch.int8).reshape(rows, -1)
    return QuantBlocks("q6_k", codes, _f16(b[..., 208:210]), sc=sc)


_UNPACK = {
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q8_0": _q8_0,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
}
