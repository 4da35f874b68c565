"""The engine core in its own process: its life tied to the front's, faults that end every stream instead of
hanging, the stop strings found in the front ending requests in the core, and streams that catch up in one
event (or by ``stream_interval``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.conftest import SMALL_KV_GIB
from tests.engine_faults import check_idle_pool
from tests.server_harness import REPO_ROOT, running_server, server_env

PROMPT = "Tell me about the ocean and the creatures that live in it."
# a death seen by watching the process is seen at once; the margin is for a busy 2-vCPU machine, and still far
# below any timeout that could stand in for the watch (the streams' own are 10 s or more)
SEEN_AT_ONCE_S = 3.0
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie not reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def child_processes(pid: int, marker: bytes) -> list[int]:
    """The children of ``pid`` whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with (
                contextlib.suppress(OSError),
                open(f"/proc/{entry}/stat") as stat,
                open(f"/proc/{entry}/cmdline", "rb") as cmdline,
            ):
                if (
                    int(stat.read().rsplit(")", 1)[1].split()[1]) == pid
                    and marker in cmdline.read()
                ):
                    found.append(int(entry))
    return found


def core_processes_of(pid: int) -> list[int]:
    """The children of ``pid`` started by multiprocessing's spawn (not its resource tracker), other than its
    grammar workers (engine/grammar_worker.py: a front starts them warm)."""
    return [child for child in child_processes(pid, b"spawn_main") if not _is_grammar_worker(child)]


def _is_grammar_worker(pid: int) -> bool:
    return _name(pid) == "pagedchat-gramm"


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def server_core(pid: int) -> int:
    """The engine core among the server ``pid``'s children: the one named ``pagedchat-core`` (it is, once the server
    is healthy; its grammar workers, which warm after that, may not have named themselves yet)."""
    (core,) = [
        child for child in child_processes(pid, b"spawn_main") if _name(child) == "pagedchat-core"
    ]
    return core


async def first_token_then_rest(
    engine: AsyncEngine, prompt: list[int], started: asyncio.Event
) -> list:
    outputs = []
    async for out in engine.generate(prompt, LONG):
        outputs.append(out)
        started.set()
    return outputs


async def test_killed_core_ends_every_stream_and_the_engine_turns_unhealthy(engine: AsyncEngine):
    prompt = engine.tokenizer.encode(PROMPT)
    events = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(first_token_then_rest(engine, prompt, e)) for e in events]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
    killed_at = time.monotonic()
    os.kill(engine.core_pid, signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "exited" in str(results[0])
    # the front watches the process itself: no timeout involved
    assert time.monotonic() - killed_at < SEEN_AT_ONCE_S
    assert not engine.healthy
    with pytest.raises(EngineDeadError):
        engine.generate(prompt, LONG)


async def test_stop_ends_the_core_process(engine: AsyncEngine):
    pid = engine.core_pid
    assert not process_gone(pid)
    await engine.stop()
    assert process_gone(pid)
    assert not engine.healthy


async def test_a_failure_after_the_core_is_ready_stops_the_core(monkeypatch):
    """The front's tokenizer failing to load ends the start with its error and stops the core, which is ready by
    then: a core left running kept the server's process from exiting after its failed start."""
    import engine.async_engine as async_engine

    cores_before, running = set(core_processes_of(os.getpid())), set()

    def unreadable(path):
        running.update(set(core_processes_of(os.getpid())) - cores_before)
        raise OSError(f"{path}/tokenizer.json: unreadable")

    monkeypatch.setattr(async_engine, "_tokenizer", unreadable)
    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB)
    with pytest.raises(OSError, match="unreadable"):
        await engine.start()
    assert running, "the core was running when the tokenizer failed"
    assert wait_until(lambda: all(process_gone(pid) for pid in running), 5.0), running
    assert not engine.healthy


def test_the_core_exits_when_its_front_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import asyncio, sys, time
        from engine.async_engine import AsyncEngine

        async def main():
            engine = AsyncEngine(kv_cache_memory_gib={SMALL_KV_GIB}, num_threads=1)
            await engine.start()
            print(engine.core_pid, flush=True)
            await asyncio.sleep(600)

        if __name__ == "__main__":
            asyncio.run(main())
    """)
    (tmp_path / "front.py").write_text(script)
    front = subprocess.Popen(
        [sys.executable, str(tmp_path / "front.py")],
        cwd=REPO_ROOT,
        env=server_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        core_pid = int(front.stdout.readline())
        assert core_pid in core_processes_of(front.pid)
        front.kill()  # no shutdown code runs in the front
        front.wait(10)
        assert wait_until(lambda: process_gone(core_pid), 10), "the core outlived its front"
    finally:
        front.kill()


@pytest.mark.asyncio(loop_scope="module")
async def test_stop_string_found_in_the_front_ends_the_request_in_the_core(
    shared_engine: AsyncEngine,
):
    """The output processor (front) sees the text; the core only tokens: the core must hear of the stop."""
    prompt = shared_engine.tokenizer.encode(PROMPT)
    offline = LLM(kv_cache_memory_gib=SMALL_KV_GIB).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )[0]
    words = offline.text.split()
    stop = words[len(words) // 2]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, stop=[stop])
    outputs = [out async for out in shared_engine.generate(prompt, params)]
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == offline.text[: offline.text.index(stop)]
    assert (
        final.token_ids == offline.token_ids[: len(final.token_ids)] and len(final.token_ids) < 40
    )
    deadline = time.monotonic() + 10
    while shared_engine.stats().num_running and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert shared_engine.stats().num_running == 0  # not the 400 tokens asked for
    assert await shared_engine.call(check_idle_pool) == shared_engine.stats().num_blocks


@pytest.mark.asyncio(loop_scope="module")
async def test_a_reader_behind_gets_every_ready_token_in_one_output(shared_engine: AsyncEngine):
    prompt = shared_engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = shared_engine.stats().generation_tokens
    stream = shared_engine.generate(prompt, params)
    deadline = time.monotonic() + 60
    while shared_engine.stats().generation_tokens < before + 24 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the core runs ahead; nobody reads
    outputs = [out async for out in stream]
    assert len(outputs) == 1 and outputs[0].finished  # 24 steps' outputs, one event
    assert outputs[0].token_ids_delta == outputs[0].token_ids and len(outputs[0].token_ids) == 24
    # (the text skips special tokens: a greedy reply may hold some, e.g. on an AVX2-only CPU this one starts with
    # <|im_end|>)
    text = shared_engine.tokenizer.decode(outputs[0].token_ids, skip_special_tokens=True)
    assert outputs[0].text_delta == outputs[0].text == text


async def test_stream_interval_sends_fewer_larger_outputs():
    engine = AsyncEngine(kv_cache_memory_gib=SMALL_KV_GIB, stream_interval=4)
    await engine.start()
    try:
        prompt = engine.tokenizer.encode(PROMPT)
        outputs = [
            out
            async for out in engine.generate(
                prompt, SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
            )
        ]
    finally:
        await engine.stop()
    sizes = [len(out.token_ids_delta) for out in outputs]
    # the first token is not held back for the interval (a reader that is late finds the next step's tokens
    # with it: the wake rule itself, deterministically, in tests/engine/test_request_stream.py)
    assert sizes[0] < 4
    assert all(size >= 4 for size in sizes[1:-1]) and sum(sizes) == 18, sizes
    assert [t for out in outputs for t in out.token_ids_delta] == outputs[-1].token_ids


# under the HTTP server ---------------------------------------------------------------------------------


def data_events(response: httpx.Response):
    """The ``data:`` payloads of an SSE response as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def stream_body(max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


def test_core_killed_under_the_server_ends_streams_with_an_error_and_exits_3():
    with running_server() as server:
        core_pid = server_core(server.process.pid)
        with httpx.stream(
            "POST", server.url("/v1/chat/completions"), json=stream_body(2000), timeout=60
        ) as resp:
            events = data_events(resp)
            next(events), next(events)  # streaming
            os.kill(core_pid, signal.SIGKILL)
            rest = list(events)
        assert rest[-1] == "[DONE]" and '"engine_unavailable"' in rest[-2]
        assert server.process.wait(30) == 3  # a supervisor restarts it


def test_core_killed_without_exit_on_death_turns_health_503_at_once():
    with running_server("--no-exit-on-engine-death") as server:
        core_pid = server_core(server.process.pid)
        os.kill(core_pid, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(
            lambda: httpx.get(server.url("/health"), timeout=5).status_code == 503, SEEN_AT_ONCE_S
        )
        assert time.monotonic() - killed <= SEEN_AT_ONCE_S
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert (
            httpx.post(server.url("/v1/chat/completions"), json=body, timeout=10).status_code == 503
        )


def test_sigterm_drains_open_streams_then_stops_the_core():
    with running_server("--shutdown-timeout-s", "60") as server:
        core_pid = server_core(server.process.pid)
        with httpx.stream(
            "POST", server.url("/v1/chat/completions"), json=stream_body(48), timeout=60
        ) as resp:
            events = data_events(resp)
            next(events), next(events)
            server.process.send_signal(signal.SIGTERM)
            rest = list(events)
        assert rest[-1] == "[DONE]" and '"finish_reason":"length"' in rest[-2]
        # (uvicorn re-raises the signal once drained)
        assert server.process.wait(30) in (0, -signal.SIGTERM)
        assert wait_until(lambda: process_gone(core_pid), 10)
