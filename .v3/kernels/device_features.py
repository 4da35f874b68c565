"""What a device offers our kernels, asked on the host without importing Triton (a CPU-only install can ask):
its compute capability, its number of SMs, whether it has TMA (the Tensor Memory Accelerator's bulk tile copies)
and whether kernels launch with programmatic dependent launch (kernels/pdl.py).

``PAGEDCHAT_PDL``: ``auto`` (default: PDL on compute capability 9.0 and later) or ``off`` (for A/B
measurements). The interpreter never uses it.
"""

from __future__ import annotations

import functools
import os

import torch

_SWITCH = os.environ.get("PAGEDCHAT_PDL", "auto")
if _SWITCH not in ("auto", "off"):
    raise ValueError(f"PAGEDCHAT_PDL: must be auto or off, not {_SWITCH!r}")

_CAPABILITY: dict[int, tuple[int, int]] = {}


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of CUDA ``device`` (cached per device index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the interpreter, on the CPU, gets a Hopper-like 132)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: CUDA compute capability 9.0+, not switched off."""
    if _SWITCH == "off" or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return capability(device)[0] >= 9


def has_tma(device: torch.device) -> bool:
    """Whether ``device`` copies tiles with TMA (Triton's tensor descriptors): CUDA compute capability 9.0+."""
    return device.type == "cuda" and capability(device)[0] >= 9
