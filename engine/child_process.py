"""What every process the engine starts does first (the core, the tensor-parallel ranks, the grammar workers): it
dies with its parent, so no orphan holds device memory, and it names itself, so operators can tell them apart."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent's process ends (no orphan holds device memory)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def name_process(name: str) -> None:
    """Linux: the name ``ps``, ``top`` and /proc/PID/comm show (15 bytes), so operators can tell the processes apart."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
