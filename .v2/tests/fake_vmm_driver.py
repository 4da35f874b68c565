"""A stand-in for engine/kv_backend/cuda_vmm.py's ``CudaDriver`` on the CPU: no memory, only the rules of
the CUDA virtual-memory API, checked on every call (what the real driver would refuse, this raises)."""

from __future__ import annotations

import itertools

import torch


class FakeDriver:
    def __init__(self, granularity: int = 2 << 20) -> None:
        self.granularity = granularity
        self.reserved: dict[int, int] = {}  # address -> size
        self.handles: dict[int, int] = {}  # live handle -> size
        self.mappings: dict[int, tuple[int, int, int]] = {}  # address -> (size, handle, offset)
        self.map_calls = self.unmap_calls = 0
        self._next_address = 1 << 40
        self._ids = itertools.count(1)

    def _aligned(self, *values: int) -> None:
        assert all(v % self.granularity == 0 for v in values), (
            f"not aligned to the granularity: {values}"
        )

    def reserve(self, size: int) -> int:
        self._aligned(size)
        address = self._next_address
        self._next_address += size + self.granularity  # a gap: ranges never touch
        self.reserved[address] = size
        return address

    def free_address(self, address: int, size: int) -> None:
        assert self.reserved.get(address) == size, (
            "cuMemAddressFree of a range that was not reserved"
        )
        assert not any(address <= a < address + size for a in self.mappings), (
            "freeing a range still mapped"
        )
        del self.reserved[address]

    def create(self, size: int) -> int:
        self._aligned(size)
        handle = next(self._ids)
        self.handles[handle] = size
        return handle

    def release(self, handle: int) -> None:
        assert handle in self.handles, "cuMemRelease of an unknown handle"
        assert not any(h == handle for _, h, _ in self.mappings.values()), (
            "releasing a handle still mapped"
        )
        del self.handles[handle]

    def map(self, address: int, size: int, handle: int, offset: int) -> None:
        self._aligned(address, size, offset)
        assert any(a <= address and address + size <= a + s for a, s in self.reserved.items()), (
            "outside reservations"
        )
        assert offset == 0, (
            "cuMemMap at an offset into a handle: CUDA_ERROR_NOT_SUPPORTED (seen on an H200)"
        )
        assert handle in self.handles and size <= self.handles[handle], "bad handle or size"
        assert not any(
            a < address + size and address < a + s for a, (s, _, _) in self.mappings.items()
        ), "cuMemMap over a mapped range"
        self.mappings[address] = (size, handle, offset)
        self.map_calls += 1

    def unmap(self, address: int, size: int) -> None:
        assert address in self.mappings and self.mappings[address][0] == size, (
            "cuMemUnmap of a range not mapped whole"
        )
        del self.mappings[address]
        self.unmap_calls += 1

    def tensor(self, address: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")
