"""What every process the engine starts does first (the core, the tensor-parallel ranks, the grammar workers): it
dies with its parent, so no orphan holds device memory, and it names itself, so operators can tell them apart; and
what a parent reads of a child (its CPU time) or a child of itself (its resident memory)."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads), from /proc/PID/stat; 0.0 where it cannot be
    read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # (after the name, which may hold spaces)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # (fields 14 and 15: utime, stime)


def resident_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
