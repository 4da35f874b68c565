"""The grammar zygote (engine/grammar_zygote.py) on its own: it builds once told the vocabulary, forks workers that
compile on their own connection, and reports each worker's exit code as multiprocessing would (the pool tells a
worker ended by its CPU backstop, SIGXCPU, from one out of memory by it); a worker dies with its zygote."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.grammar_zygote import ForkedWorker, spawn
from engine.sampling_params import StructuredOutput
from engine.worker.model_sources import ensure_default_model

SMALL = StructuredOutput(
    "json_schema", schema=json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
)


@pytest.fixture()
def zygote():
    path = ensure_default_model(Path(EngineConfig().cache_dir))
    spawned = spawn(str(path))
    try:
        spawned.send_setup(49152, (2,))
        assert spawned.conn.poll(120), "the zygote answers its setup"
        ready, kind, value = spawned.conn.recv()
        assert (ready, kind) == ("ready", "ok") and value.grammar
        yield spawned
    finally:
        spawned.stop()


def fork(zygote) -> tuple[ForkedWorker, object]:
    zygote.request_fork()
    assert zygote.conn.poll(30)
    return zygote.fork()


def test_a_forked_worker_compiles_and_its_exit_code_is_the_signal_that_ended_it(zygote):
    worker, conn = fork(zygote)
    assert worker.is_alive() and worker.exitcode is None
    deadline = time.monotonic() + 10  # (it names itself once forked)
    while _name(worker.pid) != "pagedchat-gramm" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _name(worker.pid) == "pagedchat-gramm"
    conn.send((SMALL, 10.0))
    kind, value, rss = conn.recv()
    assert kind == "ok" and value.grammar and rss > 0
    os.kill(worker.pid, signal.SIGXCPU)
    worker.join(5.0)
    assert worker.exitcode == -signal.SIGXCPU and not worker.is_alive()
    other, other_conn = fork(zygote)
    assert other.pid != worker.pid
    other_conn.close()  # (its loop ends: a clean exit)
    other.join(5.0)
    assert other.exitcode == 0


def test_workers_die_with_their_zygote(zygote):
    workers = [fork(zygote) for _ in range(2)]
    zygote.process.kill()
    for worker, _ in workers:
        worker.join(5.0)
        assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL
        # (the zygote's exit closes the exit pipes a moment before its children get their signal)
        deadline = time.monotonic() + 10
        while not _zombie_or_gone(worker.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _zombie_or_gone(worker.pid)


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in "ZX"
    except OSError:
        return True


def _name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()
