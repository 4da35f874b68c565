"""GGUF's block formats on the CPU: the unpacking of a file's raw blocks (engine/weights/gguf_blocks.py) against the
gguf package's own de-quantization, the tile layout (kernels/cpu_tiles.py), and the native tile matmul
(kernels/cpu_gguf_matmul.cpp) against a float64 reference of llama.cpp's scheme (activations quantized to 8 bits
per 32 inputs), at every instruction-set level: bit-equal across levels, and a row's result independent of the
other rows. Weights are random codes and scales (every bit pattern a file may hold), never zeros."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from engine.config import EngineConfig
from engine.weights.gguf_blocks import BLOCK_FORMATS, unpack
from kernels import cpu_native
from kernels.cpu_tiles import FORMAT_IDS, TILE_BYTES, tiles
from kernels.quant_blocks import FORMATS, QuantBlocks
from tests.gguf_writer import random_file_bytes

if os.environ.get("PAGEDCHAT_CPU_NATIVE") == "0":
    pytest.skip(
        "PAGEDCHAT_CPU_NATIVE=0: the native CPU kernels are switched off", allow_module_level=True
    )

BUILD_ROOT = Path(EngineConfig().cache_dir) / "native"
LEVELS = ("generic", *cpu_native.ISA_LEVELS)
TYPES = {fmt: qtype for qtype, fmt in BLOCK_FORMATS.items()}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_unpacked_blocks_dequantize_as_the_gguf_package_does(fmt: str):
    raw = random_file_bytes(fmt, 32, 512, seed=len(fmt))
    blocks = unpack(fmt, torch.from_numpy(raw), 32, 512)
    expected = torch.from_numpy(dequantize(raw, TYPES[fmt])).reshape(32, 512)
    assert torch.equal(blocks.dequantize(), expected)
    bits = FORMATS[fmt][0]
    assert int(blocks.codes.max()) < 1 << bits and blocks.codes.dtype == torch.uint8


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "q8_0"])
def test_the_gguf_package_quantizer_round_trips(fmt: str):
    """Blocks the gguf package quantizes from float weights unpack to what it de-quantizes them to."""
    weight = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    raw = quantize(weight, TYPES[fmt])
    blocks = unpack(fmt, torch.from_numpy(raw), 16, 256)
    assert torch.equal(
        blocks.dequantize(), torch.from_numpy(dequantize(raw, TYPES[fmt])).reshape(16, 256)
    )


def kernels_at(level: str) -> cpu_native.CpuKernels:
    if level != "generic" and level not in cpu_native.supported_levels():
        pytest.skip(f"this CPU cannot run {level} code")
    native = cpu_native.load(BUILD_ROOT, level)
    assert native is not None, f"the {level} kernels did not build"
    return native


def scheme_reference(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """llama.cpp's product in float64: x quantized per 32 inputs to a in [-127, 127] with scale s = max|x| / 127,
    times the de-quantized weight."""
    rows, k = x.shape
    groups = x.view(rows, k // 32, 32).double()
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(scale > 0, groups / scale, torch.zeros_like(groups)).round()
    return (codes * scale).view(rows, k) @ blocks.dequantize().double().t()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tile_matmul_follows_the_scheme_at_every_level_bit_equal(fmt: str):
    levels = [kernels_at(level) for level in ("generic", *cpu_native.supported_levels())]
    rows_out, k = 48, 512
    blocks = unpack(fmt, torch.from_numpy(random_file_bytes(fmt, rows_out, k, 7)), rows_out, k)
    packed = tiles(blocks)
    assert packed.shape == (rows_out // 16, k // FORMATS[fmt][1], TILE_BYTES[fmt])
    torch.manual_seed(len(fmt))
    # (a decode step's few rows; a prompt's many, which take a column's groups unpacked once: from 16 rows at
    # AVX2, 64 at AVX-512)
    for rows in (1, 3, 8, 9, 17, 70):
        x = torch.randn(rows, k) * torch.logspace(-1, 1, k)  # inputs of different scales per group
        outs = [n.ops.gguf_linear(x, [packed], [FORMAT_IDS[fmt]]) for n in levels]
        expected = scheme_reference(x, blocks)
        torch.testing.assert_close(
            outs[0].double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
        )
        assert all(torch.equal(outs[0], out) for out in outs[1:]), "levels must agree bit for bit"
        alone = torch.cat(
            [
                levels[0].ops.gguf_linear(x[i : i + 1], [packed], [FORMAT_IDS[fmt]])
                for i in range(rows)
            ]
        )
        assert torch.equal(outs[0], alone), "a row's result must not depend on the other rows"


@pytest.mark.parametrize("rows", [2, 5, 11, 70])
def test_parts_of_different_formats_side_by_side(rows: int):
    """A fused projection whose shards have their own formats (Q4_K_M's q, k in Q5_0 and v in Q8_0): each part's
    outputs in its columns, as the parts computed alone (a decode step's few rows, and a prompt's many, whose
    columns are unpacked once for all rows, each thread's share of columns spanning parts)."""
    native = kernels_at("generic" if not cpu_native.supported_levels() else "avx2")
    parts = [
        unpack(f, torch.from_numpy(random_file_bytes(f, n, 256, i)), n, 256)
        for i, (f, n) in enumerate([("q5_0", 32), ("q8_0", 16), ("q6_k", 48)])
    ]
    x = torch.randn(rows, 256)
    together = native.ops.gguf_linear(
        x, [tiles(p) for p in parts], [FORMAT_IDS[p.format] for p in parts]
    )
    alone = torch.cat(
        [native.ops.gguf_linear(x, [tiles(p)], [FORMAT_IDS[p.format]]) for p in parts], dim=1
    )
    assert together.shape == (rows, 96) and torch.equal(together, alone)


def test_bad_tiles_are_refused_with_a_message():
    native = kernels_at("generic")
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="gguf_linear"):
        native.ops.gguf_linear(x, [torch.zeros(1, 2, 100, dtype=torch.uint8)], [FORMAT_IDS["q4_0"]])
    with pytest.raises(RuntimeError, match="gguf_linear"):
        native.ops.gguf_linear(x, [torch.zeros(1, 2, 288, dtype=torch.uint8)], [99])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_native_repack_of_a_files_bytes_equals_the_torch_tiles(fmt: str):
    """kernels/cpu_gguf_repack.cpp (what loading takes) against kernels/cpu_tiles.py (the reference layout), on
    rows that are not a whole number of tiles (padded with zero rows)."""
    native = kernels_at("generic")
    raw = torch.from_numpy(random_file_bytes(fmt, 40, 512, seed=3))
    expected = tiles(unpack(fmt, raw, 40, 512))
    assert torch.equal(native.ops.gguf_tiles(raw, FORMAT_IDS[fmt], 40, 512), expected)


@pytest.mark.parametrize("fmt", ["q8_0", "q6_k"])
def test_a_large_part_repacked_in_chunks_gives_the_same_tiles(monkeypatch, fmt: str):
    """A part of more rows than REPACK_CHUNK_ROWS (the output layer of a large vocabulary) is repacked chunk by
    chunk, the map's pages released after each: the tiles equal one repack of the whole, padding rows included."""
    from engine.layers import gguf_linear
    from engine.weights.gguf_blocks import GGUFBlocks

    native = kernels_at("generic")
    rows, k = 100, 256  # (not a multiple of the chunk, nor of the tiles' 16 rows)
    part = GGUFBlocks(fmt, torch.from_numpy(random_file_bytes(fmt, rows, k, 11)), (rows, k))
    whole = gguf_linear._tiles(part, native)
    released = []
    monkeypatch.setattr(gguf_linear, "REPACK_CHUNK_ROWS", 32)
    chunked = gguf_linear._tiles(part, native, lambda: released.append(1))
    assert len(released) == 4 and torch.equal(chunked, whole)
