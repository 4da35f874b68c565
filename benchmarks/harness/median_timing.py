"""Median time of a call, for the benchmarks that time one function many times: the host's clock
(``perf_counter``) for CPU work, CUDA events around each call for device work."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(
    fn: Callable[[], object], repeats: int, device: torch.device | None = None, warm_up: int = 0
) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn`` after ``warm_up`` untimed ones; on a CUDA ``device``
    timed by events, each call waited for."""
    for _ in range(warm_up):
        fn()
    times = []
    for _ in range(repeats):
        if device is not None and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(times)
