"""A core process started before the front has its configuration (engine/runtime/core_prestart.py): the front's
connection takes it when it configured itself as the front would launch its core, and otherwise (another
configuration, a configure that failed, a process that died) stops it and spawns one; one never taken is stopped
at close; ``pagedchat serve`` runs its core in it, and exiting on a settings mistake leaves no process behind."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import time

import pytest

import engine.runtime.core_prestart as module
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.runtime.core_prestart import PrestartedCore, prestart_core, take_prestarted
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_KV_GIB
from tests.engine.test_engine_process import child_processes, process_gone, wait_until
from tests.server_harness import running_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def configured(kv_gib: float, level: int) -> tuple[EngineConfig, int, str]:
    """(run in the prestarted process)"""
    return EngineConfig(kv_cache_memory_gib=kv_gib), level, "text"


def failing() -> tuple[EngineConfig, int, str]:
    raise ValueError("a mistake the front reports itself")


def configure(kv_gib: float = SMALL_KV_GIB):
    return functools.partial(configured, kv_gib, logging.getLogger().getEffectiveLevel())


async def generated(engine: AsyncEngine) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate([1, 2, 3, 4], GREEDY):
        tokens = list(out.token_ids)  # (every token so far)
    return tokens


async def started_engine() -> AsyncEngine:
    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB)
    await engine.start()
    return engine


@pytest.fixture(autouse=True)
def nothing_prestarted_after():
    yield
    left = take_prestarted()
    if left is not None:
        left.close()


async def test_the_core_configured_as_the_front_would_launch_it_is_taken():
    prestart_core(configure())
    prestarted = module._prestarted
    prestart_core(configure(2 * SMALL_KV_GIB))
    assert prestarted is not None and module._prestarted is prestarted, "once per process"
    engine = await started_engine()
    try:
        assert engine._core.process is prestarted.process, "the prestarted process is the core"
        assert len(await generated(engine)) == 4
    finally:
        await engine.stop()
    assert wait_until(lambda: process_gone(prestarted.process.pid), 10.0)
    assert take_prestarted() is None, "taken by the launch"


@pytest.mark.parametrize("how", ["configured otherwise", "configure failed", "died"])
async def test_otherwise_it_is_stopped_and_a_core_spawned(how: str):
    prestart_core(
        failing
        if how == "configure failed"
        else configure(2 * SMALL_KV_GIB if how == "configured otherwise" else SMALL_KV_GIB)
    )
    prestarted = module._prestarted
    if how == "died":
        prestarted.process.kill()
        prestarted.process.join(10.0)
    engine = await started_engine()
    try:
        assert engine._core.process.pid != prestarted.process.pid
        assert process_gone(prestarted.process.pid)
        assert len(await generated(engine)) == 4
    finally:
        await engine.stop()


def test_one_never_taken_is_stopped_at_close_while_it_imports():
    prestarted = PrestartedCore(configure())
    pid, ipc_dir = prestarted.process.pid, prestarted.ipc_dir
    began = time.monotonic()
    prestarted.close()
    assert time.monotonic() - began < 5.0
    assert process_gone(pid)
    assert not os.path.exists(ipc_dir), "its socket directory removed"


def test_serve_runs_its_core_in_the_prestarted_process():
    with running_server("--session-store", "memory") as server:
        log = server.log()
        cores = [
            pid
            for pid in child_processes(server.process.pid, b"spawn_main")
            if open(f"/proc/{pid}/comm").read().strip() == "pagedchat-core"
        ]
        # the front runs without torch (engine/config.py: the core resolves the device), the core with it
        with (
            open(f"/proc/{server.process.pid}/maps") as front,
            open(f"/proc/{cores[0]}/maps") as core,
        ):
            assert ("libtorch" in front.read(), "libtorch" in core.read()) == (False, True)
    assert len(cores) == 1, cores
    assert "configured otherwise" not in log, log[-3000:]


def test_serve_exiting_on_a_settings_mistake_leaves_no_process():
    process = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--grammar-workers", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # (the prestarted process is spawned before the front reads its settings)
    children: list[int] = []
    while not children and process.poll() is None:
        children = child_processes(process.pid, b"spawn_main")
        time.sleep(0.02)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and "grammar_workers" in stderr, stderr
    assert children, "the serve command prestarted its core"
    assert all(wait_until(lambda c=c: process_gone(c), 5.0) for c in children)
