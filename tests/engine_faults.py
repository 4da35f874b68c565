"""Faults injected into a running engine core (in the core's own process, through ``AsyncEngine.call``), and
checks run there: each function takes the EngineCore first and is pickled by name, so it lives in a module."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.sample.sampler import Sampler


def fail_model_after(core: Any, num_calls: int) -> None:
    """The model runner works ``num_calls`` more times, then raises (as a CUDA error or OOM would)."""
    original, calls = core.runner.execute, []

    def execute(batch, in_flight):
        calls.append(1)
        if len(calls) > num_calls:
            raise RuntimeError("injected model failure")
        return original(batch, in_flight)

    core.runner.execute = execute


def fail_sampling_of(core: Any, request_id: str) -> None:
    """Sampling raises for any batch holding ``request_id`` (as a broken logits processor would)."""
    original = Sampler.__call__

    def sample(self, logits, seqs, *args, **kwargs):
        if any(seq.request_id == request_id for seq in seqs):
            raise RuntimeError("injected logits-processor fault")
        return original(self, logits, seqs, *args, **kwargs)

    Sampler.__call__ = sample


def check_idle_pool(core: Any) -> int:
    """The block pool's invariants with no sequence alive; returns the free blocks."""
    from tests.block_invariants import check_pool

    assert not core.has_unfinished_requests()
    check_pool(core.block_manager, [])
    return core.block_manager.num_free_blocks


def call_in_engine(engine: Any, fn: Any, *args: Any) -> Any:
    """``engine.call(fn, *args)`` from a thread other than the engine's event loop (TestClient, a server thread)."""
    return asyncio.run_coroutine_threadsafe(engine.call(fn, *args), engine.loop).result(60)
