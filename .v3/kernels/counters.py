"""Zeroed int32 counters for kernels that merge split work inside the same launch (split-K decode attention, the
skinny matmul's split-K, the argmax's parts): the last program of a group to finish (an ``atomic_add`` counter)
does the merge and sets the counter back to zero, so every launch finds them zero and none needs a memset.

Each kernel has its own buffers per device, grown on demand. Outgrown buffers are kept alive: captured CUDA graphs
may still point at them. One launch at a time per device is assumed (the engine's single stream; with
programmatic dependent launch a kernel touches its counters only after the one before it has completed).
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def zeroed_counters(owner: str, device: torch.device, size: int) -> torch.Tensor:
    """At least ``size`` zeroed counters on ``device`` for kernel ``owner`` (at least 4096, so that a growing
    batch rarely outgrows them)."""
    buffers = _BUFFERS.setdefault((owner, device), [])
    if not buffers or buffers[-1].numel() < size:
        buffers.append(torch.zeros(max(size, 4096), dtype=torch.int32, device=device))
    return buffers[-1]
