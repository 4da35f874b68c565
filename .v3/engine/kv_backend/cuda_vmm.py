"""The CUDA driver's virtual-memory calls that the vAttention backend needs, and nothing else.

Physical memory is allocated as handles (``cuMemCreate``) whose size is a multiple of the driver's minimum
granularity (2 MiB on Hopper); virtual ranges are reserved without memory behind them
(``cuMemAddressReserve``); a page of a handle (at a byte offset) is mapped at a virtual address
(``cuMemMap``) and made readable and writable by the device (``cuMemSetAccess``), and unmapped again
(``cuMemUnmap``). One handle may be mapped at several addresses at once: that is how a KV page is seen both
in a request slot's contiguous range and in the block-addressed home range. Uses NVIDIA's ``cuda-bindings``
package (``cuda.bindings.driver``), imported on first use so that CPU installs never need it.

``FakeDriver`` (engine/kv_backend/fake_driver.py) has the same methods and checks the same rules on the CPU.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class DriverError(RuntimeError):
    pass


class CudaDriver:
    """Thin wrappers over the driver: each raises ``DriverError`` naming the call and the CUDA error."""

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver  # noqa: PLC0415 - CUDA installs only

        self._d = driver
        self.device_index = (
            device.index if device.index is not None else torch.cuda.current_device()
        )
        torch.cuda.init()
        self._check(driver.cuInit(0), "cuInit")
        self._cu_device = self._check(driver.cuDeviceGet(self.device_index), "cuDeviceGet")
        self._context = self._check(
            driver.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain"
        )
        self._thread_bound = threading.local()
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        self._prop = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._bind()
        flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(
            self._check(driver.cuMemGetAllocationGranularity(prop, flag), "granularity")
        )

    def _check(self, result: tuple, call: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._d.CUresult.CUDA_SUCCESS:
            raise DriverError(f"{call}: {err.name if hasattr(err, 'name') else err}")
        return values[0] if len(values) == 1 else values or None

    def _bind(self) -> None:
        """Driver calls need the device's primary context current in the calling thread (the engine thread
        is not the one that created the engine)."""
        if not getattr(self._thread_bound, "done", False):
            self._check(self._d.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
            self._thread_bound.done = True

    def reserve(self, size: int) -> int:
        self._bind()
        return int(
            self._check(
                self._d.cuMemAddressReserve(size, self.granularity, 0, 0), "cuMemAddressReserve"
            )
        )

    def free_address(self, address: int, size: int) -> None:
        self._check(self._d.cuMemAddressFree(address, size), "cuMemAddressFree")

    def create(self, size: int) -> Any:
        self._bind()
        return self._check(self._d.cuMemCreate(size, self._prop, 0), "cuMemCreate")

    def release(self, handle: Any) -> None:
        self._check(self._d.cuMemRelease(handle), "cuMemRelease")

    def map(self, address: int, size: int, handle: Any, offset: int) -> None:
        """Map ``size`` bytes of ``handle`` from ``offset`` at ``address`` and grant the device access."""
        self._bind()
        self._check(self._d.cuMemMap(address, size, offset, handle, 0), "cuMemMap")
        self._check(self._d.cuMemSetAccess(address, size, self._access, 1), "cuMemSetAccess")

    def unmap(self, address: int, size: int) -> None:
        self._bind()
        self._check(self._d.cuMemUnmap(address, size), "cuMemUnmap")

    def tensor(self, address: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return tensor_at(address, shape, dtype, torch.device("cuda", self.device_index))


class _DeviceArray:
    """Exposes a device address range to ``torch.as_tensor`` without a copy (the CUDA array interface)."""

    _TYPESTR = {1: "|u1", 2: "<i2", 4: "<f4", 8: "<f8"}

    def __init__(self, address: int, shape: tuple[int, ...], itemsize: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": self._TYPESTR[itemsize],
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def tensor_at(
    address: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A torch tensor over memory the engine manages itself (torch neither owns nor frees it)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.as_tensor(_DeviceArray(address, shape, itemsize), device=device)
    return raw.view(dtype)
