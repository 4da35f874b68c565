"""Triton's CUDA-graph timing, made safe for inputs just written: ``triton.testing.do_bench_cudagraph`` (3.6) warms
up on a new stream that does not wait for the current one, so its first call can read inputs still being written
(on the H200 the decode-attention benchmark read stale block ids and faulted: docs/BENCHMARKS.md)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton


def graph_ms(fn: Callable[[], object], rep: int = 200) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph, after the current stream's work is done."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
