"""The allocator's free memory handed back to the system after a large transient (a load's parse buffers, a large
grammar's matchers): glibc keeps what large frees leave in its arenas, so a process would otherwise stay at its
peak for good (a 262k-token tokenizer.json parsed leaves ~300 MiB of free heap behind)."""

from __future__ import annotations

import contextlib
import ctypes
import sys


def release_free_heap() -> None:
    """``malloc_trim(0)`` where the C library is glibc (elsewhere: nothing to do)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
