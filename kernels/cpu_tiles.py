"""The tile layout of the native GGUF matmul (kernels/cpu_gguf_matmul.cpp): a weight's unpacked blocks
(kernels/quant_blocks.py) regrouped 16 outputs at a time, so that one vector load gives 16 outputs' codes (AVX-512;
two loads on AVX2). Only bytes move: codes and scales are the file's.

``tiles(blocks)`` -> uint8 ``[N / 16, K / tile inputs, tile bytes]``, N padded to 16 with zero rows. Per group of 32
inputs the codes are four 64-byte vectors: vector c holds, for each of the 16 outputs, 4 bytes whose low nibbles
are inputs 8c .. 8c + 3 and high nibbles inputs 8c + 4 .. 8c + 7 (q8_0: eight vectors of inputs 4c .. 4c + 3,
one byte each). Wider codes keep their low 4 bits there and add bit planes: q5's fifth bits (one vector; byte i of
an output: bit c = input 8c + i, bit 4 + c = input 8c + 4 + i) and q6_k's top two bits (two vectors; vector p,
byte i: bits 2t, 2t + 1 for t = 0..3 = inputs 8c + i, 8c + 4 + i, 8c' + i, 8c' + 4 + i, c = 2p, c' = 2p + 1).
Scales follow, 16 per array (one per output). Offsets, per format:

| format | tile inputs | layout (bytes) | tile bytes |
| --- | ---: | --- | ---: |
| q4_0 | 32 | codes 256, d 32 | 288 |
| q4_1 | 32 | codes 256, d 32, m 32 | 320 |
| q5_0 | 32 | codes 256, fifth bits 64, d 32 | 352 |
| q8_0 | 32 | codes 512, d 32 | 544 |
| q4_k | 256 | d 32, dmin 32, sc 8 x 16, mn 8 x 16, codes 8 x 256 | 2368 |
| q5_k | 256 | as q4_k, fifth bits 8 x 64 | 2880 |
| q6_k | 256 | d 32, sc 8 x 2 x 16 (int8), codes 8 x 256, top bits 8 x 128 | 3360 |
"""

from __future__ import annotations

import torch

from kernels.quant_blocks import FORMATS, QuantBlocks

OUTPUTS = 16  # outputs per tile
# ggml's type id of each format: the native op's format argument
FORMAT_IDS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
TILE_BYTES = {
    "q4_0": 288,
    "q4_1": 320,
    "q5_0": 352,
    "q8_0": 544,
    "q4_k": 2368,
    "q5_k": 2880,
    "q6_k": 3360,
}


def tiles(blocks: QuantBlocks) -> torch.Tensor:
    """The weight's tiles (see the module docstring); N padded with zero rows to a multiple of 16."""
    blocks = _padded(blocks)
    n, k = blocks.shape
    per_tile = FORMATS[blocks.format][1]
    # [block of outputs, tile, group in the tile, output, 32 codes]
    codes = (
        blocks.codes.reshape(n // OUTPUTS, OUTPUTS, k // per_tile, per_tile // 32, 32)
        .permute(0, 2, 3, 1, 4)
        .contiguous()
    )
    parts = _parts(blocks, codes)
    out = torch.cat([p.reshape(n // OUTPUTS, k // per_tile, -1) for p in parts], dim=-1)
    assert out.shape[-1] == TILE_BYTES[blocks.format], (blocks.format, out.shape)
    return out.contiguous()


def _parts(blocks: QuantBlocks, codes: torch.Tensor) -> list[torch.Tensor]:
    n, k = blocks.shape
    tile_count = k // FORMATS[blocks.format][1]
    fmt = blocks.format

    def per_output(t: torch.Tensor, per_tile: int) -> torch.Tensor:
        """``[N, tiles * per_tile]`` -> bytes ``[blocks, tiles, per_tile, 16 outputs]``."""
        shaped = t.reshape(n // OUTPUTS, OUTPUTS, tile_count, per_tile).permute(0, 2, 3, 1)
        return shaped.contiguous().view(torch.uint8)

    if fmt == "q8_0":
        return [codes.view(*codes.shape[:4], 8, 4).transpose(3, 4), per_output(blocks.d, 1)]
    low = _nibbles(codes)
    if fmt in ("q4_0", "q4_1", "q5_0"):
        parts = [low] + ([_fifth_bits(codes)] if fmt == "q5_0" else []) + [per_output(blocks.d, 1)]
        return parts + ([per_output(blocks.m, 1)] if fmt == "q4_1" else [])
    if fmt == "q6_k":
        return [per_output(blocks.d, 1), per_output(blocks.sc, 16), low, _top_bits(codes)]
    parts = [per_output(blocks.d, 1), per_output(blocks.m, 1)]
    parts += [per_output(blocks.sc, 8), per_output(blocks.mn, 8), low]
    return parts + ([_fifth_bits(codes)] if fmt == "q5_k" else [])


def _split(codes: torch.Tensor) -> torch.Tensor:
    """``[..., output, 32]`` -> ``[..., c, output, nibble, i]``: input 8c + 4 nibble + i."""
    return codes.view(*codes.shape[:-1], 4, 2, 4).movedim(-3, -4)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    q = _split(codes) & 0x0F
    return q[..., 0, :] | (q[..., 1, :] << 4)


def _fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """One byte per output and i: bit c + 4 nibble = the fifth bit of input 8c + 4 nibble + i."""
    bits = ((_split(codes) >> 4) & 1).to(torch.int32)
    shift = (torch.arange(4)[:, None, None, None] + 4 * torch.arange(2)[None, None, :, None]).to(
        torch.int32
    )
    return (bits << shift).sum(dim=(-4, -2)).to(torch.uint8)


def _top_bits(codes: torch.Tensor) -> torch.Tensor:
    """Two bytes per output and i (vector p = 0, 1): bits 2t, 2t + 1, t = 2 (c mod 2) + nibble, of chunk
    c = 2p + (c mod 2)."""
    top = ((_split(codes) >> 4) & 3).to(torch.int32)  # [..., c, output, nibble, i]
    top = top.view(*top.shape[:-4], 2, 2, *top.shape[-3:])  # [..., p, c mod 2, output, nibble, i]
    shift = 2 * (2 * torch.arange(2)[:, None, None, None] + torch.arange(2)[None, None, :, None])
    return (top << shift.to(torch.int32)).sum(dim=(-4, -2)).to(torch.uint8)


def _padded(blocks: QuantBlocks) -> QuantBlocks:
    n = blocks.shape[0]
    extra = -n % OUTPUTS
    if not extra:
        return blocks

    def pad(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])

    return QuantBlocks(
        blocks.format,
        pad(blocks.codes),
        pad(blocks.d),
        pad(blocks.m),
        pad(blocks.sc),
        pad(blocks.mn),
    )
