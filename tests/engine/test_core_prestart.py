"""A core process started before its configuration (engine/runtime/core_prestart.py): ``launch_core`` runs the core
in it once prestarted, a dead one is replaced by a spawn, one never handed its arguments is stopped at close, and a
``pagedchat serve`` that exits on a settings mistake leaves no process behind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import engine.runtime.core_prestart as module
from engine.async_engine import AsyncEngine
from engine.runtime.core_prestart import PrestartedCore, prestart_core, take_prestarted
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_KV_GIB
from tests.engine.test_engine_process import child_processes, process_gone, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def generated(engine: AsyncEngine) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate([1, 2, 3, 4], GREEDY):
        tokens = list(out.token_ids)  # (every token so far)
    return tokens


@pytest.fixture(autouse=True)
def nothing_prestarted_after():
    yield
    left = take_prestarted()
    if left is not None:
        left.close()


async def test_launch_core_runs_the_core_in_the_prestarted_process():
    prestart_core()
    prestarted = module._prestarted
    prestart_core()
    assert prestarted is not None and module._prestarted is prestarted, "once per process"
    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB)
    await engine.start()
    try:
        assert engine._core.process is prestarted.process, "the prestarted process is the core"
        assert len(await generated(engine)) == 4
    finally:
        await engine.stop()
    assert wait_until(lambda: process_gone(prestarted.process.pid), 10.0)
    assert take_prestarted() is None, "taken by the launch"


async def test_a_prestarted_process_that_died_is_replaced_by_a_spawn():
    prestart_core()
    dead = module._prestarted
    assert dead is not None
    dead.process.kill()
    dead.process.join(10.0)
    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB)
    await engine.start()
    try:
        assert engine._core.process.pid != dead.process.pid
        assert len(await generated(engine)) == 4
    finally:
        await engine.stop()


def test_one_never_handed_its_arguments_is_stopped_at_close_while_it_imports():
    prestarted = PrestartedCore()
    pid = prestarted.process.pid
    began = time.monotonic()
    prestarted.close()
    assert time.monotonic() - began < 5.0
    assert not prestarted.process.is_alive() and process_gone(pid)
    assert not prestarted.hand(print, ()), "a closed one takes nothing"


def test_serve_exiting_on_a_settings_mistake_leaves_no_process():
    process = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--grammar-workers", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # (the prestarted process is importing torch by now)
    children = child_processes(process.pid, b"spawn_main")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and "grammar_workers" in stderr, stderr
    assert children, "the serve command prestarted its core"
    assert all(wait_until(lambda c=c: process_gone(c), 5.0) for c in children)
