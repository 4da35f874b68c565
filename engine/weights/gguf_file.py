"""A GGUF file, memory-mapped and read in place: its metadata and its tensors' raw blocks.

The layout (GGUF v2/v3, little-endian): ``GGUF``, version (u32), tensor count (u64), metadata count (u64); the
metadata as (key, type, value); per tensor its name, dimensions (innermost first), block type and offset; then the
tensor data, each tensor at ``data_start + offset``, ``data_start`` aligned to ``general.alignment`` (32).

The gguf package's own reader builds a Python object per array element (262,144 of them three times over for a
Gemma vocabulary: ~10-20 s on a small VM); this one keeps numeric arrays as numpy views of the map and decodes
only strings, so a 250 MB file opens in well under a second. A truncated or corrupt file is a ValueError naming
``model``, the file and what was wrong, never a bare reshape error.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# metadata value types -> (struct format, numpy dtype); 8 = string, 9 = array
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
# (a tensor of more than this many dimensions, or a string longer than this, is a corrupt header)
_MAX_DIMS, _MAX_STRING = 8, 1 << 30
_LENGTH = struct.Struct("<Q")  # a string's byte count


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: ``shape`` outermost first (rows, columns) as torch writes it, its block type and raw bytes."""

    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType
    data: np.ndarray  # uint8 view of the file's bytes, read-only

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """``GGUFFile(path)``: ``metadata`` (key -> value: int, float, bool, str, list of str, or a numpy array) and
    ``tensors`` (name -> GGUFTensor over the memory map). ``close()`` drops the map once nothing reads it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise self._corrupt(f"only {size} bytes")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError, ValueError) as exc:
            if isinstance(exc, ValueError) and str(exc).startswith("model:"):
                raise
            raise self._corrupt(f"unreadable header ({type(exc).__name__}: {exc})") from None

    def _corrupt(self, what: str) -> ValueError:
        return ValueError(f"model: {self.path} is not a valid GGUF file ({what})")

    def _parse(self) -> None:
        if self._map[:4] != _MAGIC:
            raise self._corrupt("it does not start with 'GGUF'")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._map, 4)
        if version not in (2, 3):
            raise self._corrupt(f"GGUF version {version}; versions 2 and 3 are read")
        self._offset = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._u32())
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = {info[0]: self._tensor(data_start, *info) for info in infos}

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _u32(self) -> int:
        return self._read("<I")

    def _string(self) -> str:
        length = self._read("<Q")
        if length > _MAX_STRING or self._offset + length > len(self._map):
            raise self._corrupt(f"a string of {length} bytes at offset {self._offset}")
        text = self._map[self._offset : self._offset + length].decode("utf-8")
        self._offset += length
        return text

    def _strings(self, count: int) -> list[str]:
        """``count`` strings one after another (a vocabulary: 262k of them, so one tight loop: a method call per
        string took 0.2 s of a Gemma load)."""
        data, offset, size = self._map, self._offset, len(self._map)
        if count > (size - offset) // 8:
            raise self._corrupt(f"an array of {count} strings past the end of the file")
        unpack, strings = _LENGTH.unpack_from, []
        for _ in range(count):
            (length,) = unpack(data, offset)
            end = offset + 8 + length
            if length > _MAX_STRING or end > size:
                raise self._corrupt(f"a string of {length} bytes at offset {offset + 8}")
            strings.append(data[offset + 8 : end].decode("utf-8"))
            offset = end
        self._offset = offset
        return strings

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            return self._array()
        if kind not in _SCALARS:
            raise self._corrupt(f"metadata value type {kind} at offset {self._offset}")
        return self._read(_SCALARS[kind][0])

    def _array(self) -> Any:
        kind, count = self._read("<I"), self._read("<Q")
        if kind == _STRING:
            return self._strings(count)
        if kind not in _SCALARS:
            raise self._corrupt(f"array element type {kind} at offset {self._offset}")
        dtype = np.dtype(_SCALARS[kind][1])
        end = self._offset + count * dtype.itemsize
        if end > len(self._map):
            raise self._corrupt(f"an array of {count} elements past the end of the file")
        values = self._bytes[self._offset : end].view(dtype)
        self._offset = end
        return values

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = self._u32()
        if dims > _MAX_DIMS:
            raise self._corrupt(f"tensor {name!r} has {dims} dimensions")
        shape = tuple(self._read("<Q") for _ in range(dims))
        return name, shape[::-1], self._u32(), self._read("<Q")

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], kind: int, offset: int
    ) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise self._corrupt(f"tensor {name!r} has unknown block type {kind}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        elements = int(np.prod(shape)) if shape else 1
        if shape and shape[-1] % block:
            raise self._corrupt(
                f"tensor {name!r}: {shape[-1]} columns are not whole {qtype.name} blocks"
            )
        size = elements // block * block_bytes
        start = data_start + offset
        if start + size > len(self._map):
            raise ValueError(
                f"model: {self.path} is truncated: tensor {name!r} needs bytes up to {start + size}, "
                f"the file has {len(self._map)}"
            )
        return GGUFTensor(name, shape, qtype, self._bytes[start : start + size])

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise self._corrupt("no general.architecture")
        return arch

    def release_pages(self) -> None:
        """Drop the map's pages from this process (they stay in the page cache): after the weights were repacked,
        the file's bytes no longer count as this process's memory; a later read faults in just what it reads."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Drop the map (tensors read from it afterwards would fail: call once the weights are repacked)."""
        self.tensors = {}
        self._bytes = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except (
            BufferError
        ):  # a view still exported (a caller kept a tensor): the map lives on with it
            pass
