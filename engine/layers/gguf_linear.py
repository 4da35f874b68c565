"""Layers over GGUF blocks on the CPU, in the file's own formats (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K): a linear
layer whose weight is one or more parts side by side (a fused projection's q, k and v may each have their own
format, as Q4_K_M files give them), computed by the native tile kernel (kernels/cpu_gguf_matmul.cpp) with float32
activations quantized to 8 bits per 32 inputs inside it; and an embedding that reads the rows it looks up out of
the memory-mapped file, so the table is never held twice (its tied output layer has the tiles).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from engine.weights.gguf_blocks import GGUFBlocks, rows_from_bytes
from engine.weights.gguf_file import GGUFTensor
from kernels.cpu_native import CpuKernels
from kernels.cpu_tiles import FORMAT_IDS, OUTPUTS, tiles
from kernels.quant_blocks import QuantBlocks


class GGUFLinear(nn.Module):
    """``[M, K]`` float32 -> ``[M, sum of the parts' N]`` float32 (a bias added in float32 if given)."""

    input_dtype = torch.float32

    def __init__(
        self,
        parts: list[QuantBlocks | GGUFBlocks],
        bias: torch.Tensor | None,
        native: CpuKernels,
        release: Callable[[], None] | None = None,
    ) -> None:
        """``parts``: a file's blocks as they are (repacked natively) or unpacked codes and scales. ``release``:
        called after each chunk of a large part's rows is repacked (a GGUF map drops the pages it read)."""
        super().__init__()
        widths = {p.shape[1] for p in parts}
        if len(widths) != 1 or widths.pop() % 32:
            raise ValueError(
                f"weights: the parts of a GGUF layer need one input size, a multiple of 32 "
                f"(got {[p.shape for p in parts]})"
            )
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.formats = [FORMAT_IDS[p.format] for p in parts]
        self.part_formats = [p.format for p in parts]
        self.tiles = [_tiles(p, native, release) for p in parts]
        self._gguf_linear = native.ops.gguf_linear.default
        # the outputs' columns where a part's rows were padded to whole tiles (None: all columns are outputs)
        self.columns: torch.Tensor | None = None
        if any(p.shape[0] % OUTPUTS for p in parts):
            keep, start = [], 0
            for p in parts:
                keep.append(torch.arange(start, start + p.shape[0]))
                start += -(-p.shape[0] // OUTPUTS) * OUTPUTS
            self.columns = torch.cat(keep)
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tiles)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[M, in]`` float32 -> ``[M, out]`` float32, no bias."""
        out = self._gguf_linear(rows, self.tiles, self.formats)
        return out if self.columns is None else out.index_select(1, self.columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self.matmul(rows.float())
        if self.bias is not None:
            out += self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


# a file's part of more rows than this is repacked in chunks of them (a multiple of the tiles' 16 rows), with
# ``release`` after each: a 262k-token output layer's 170 MiB of mapped blocks are never resident at once
REPACK_CHUNK_ROWS = 16384


def _tiles(
    part: QuantBlocks | GGUFBlocks, native: CpuKernels, release: Callable[[], None] | None = None
) -> torch.Tensor:
    if not isinstance(part, GGUFBlocks):
        return tiles(part)
    rows, cols = part.shape
    if release is None or rows <= REPACK_CHUNK_ROWS:
        return native.ops.gguf_tiles(part.data.contiguous(), FORMAT_IDS[part.format], rows, cols)
    out: torch.Tensor | None = None
    for start in range(0, rows, REPACK_CHUNK_ROWS):
        end = min(start + REPACK_CHUNK_ROWS, rows)
        chunk = native.ops.gguf_tiles(
            part.data[start:end].contiguous(), FORMAT_IDS[part.format], end - start, cols
        )
        if out is None:
            # (tiles are [row groups of 16, tiles per row, tile bytes]: chunks of whole groups stack)
            out = torch.empty(((rows + 15) // 16, *chunk.shape[1:]), dtype=chunk.dtype)
        out[start // 16 : start // 16 + chunk.shape[0]] = chunk
        release()
    return out


class GGUFEmbedding(nn.Module):
    """An embedding table left in the memory-mapped GGUF file: a lookup reads only its rows' blocks and
    de-quantizes them (float32 rows ``[T, hidden]``)."""

    def __init__(self, table: GGUFTensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.shape
        self.type = table.type
        self.rows = table.data.reshape(
            self.num_embeddings, -1
        )  # [vocab, bytes per row], in the map

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).cpu().numpy()
        raw = torch.from_numpy(np.ascontiguousarray(self.rows[ids]))
        rows = rows_from_bytes(self.type, raw, len(ids), self.embedding_dim)
        return rows.float().view(*input_ids.shape, self.embedding_dim)
