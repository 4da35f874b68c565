"""Grammar workers (engine/grammar_worker.py): a schema compiles in a process of its own, started and warm before
the first request; a compile is limited by its own CPU time (a worker the machine does not run is not blamed for the
wait), past which that compile alone is stopped and a warm spare answers the next; outcomes are kept by spec; a
compile past the heap limit ends its worker; a worker grown too large is replaced; their memory never shows up in
the front, and a worker holds neither torch nor the Hugging Face tokenizer. Each refusal's message says why."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.child_process import resident_bytes
from engine.config import EngineConfig
from engine.grammar_worker import GrammarWorkers, WorkerSetup, spawn
from engine.sampling_params import StructuredOutput
from engine.worker.model_sources import ensure_default_model

SMALL = StructuredOutput(
    "json_schema",
    schema=json.dumps(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    ),
)
JSON_OBJECT = StructuredOutput("json_object")


def enum_spec(count: int, tag: str = "") -> StructuredOutput:
    values = [f"value-{i}-{tag}abcabc" for i in range(count)]
    return StructuredOutput(
        "json_schema",
        schema=json.dumps(
            {"type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]}
        ),
    )


@pytest.fixture(scope="module")
def setup() -> WorkerSetup:
    path = ensure_default_model(Path(EngineConfig().cache_dir))
    return WorkerSetup(str(path), 49152, (2,))


@contextlib.asynccontextmanager
async def started(setup: WorkerSetup, count: int = 1, **options) -> AsyncIterator[GrammarWorkers]:
    workers = GrammarWorkers(setup, count=count, **options)
    try:
        await workers.start()
        yield workers
    finally:
        workers.close()


@contextlib.contextmanager
def paused(pid: int):
    """The process is not run at all meanwhile (as by a machine too busy to schedule it)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def test_started_workers_are_warm_and_the_first_requests_start_none(setup):
    async with started(setup, count=2) as workers:
        pids = workers.pids
        assert len(pids) == 2, "both workers run before any compile"
        for pid in pids:
            maps = Path(f"/proc/{pid}/maps").read_text()
            # (torch, and the Hugging Face tokenizer beside llguidance's own: hundreds of MiB a worker)
            assert "libtorch" not in maps and "tokenizers.abi3" not in maps
        compiled = await workers.compile(JSON_OBJECT)
        assert compiled.grammar and workers.compiles == 0, (
            "json_object's grammar was compiled at start"
        )
        assert (await workers.compile(SMALL)).grammar
        assert workers.compiles == 1 and workers.starts == 2 and workers.pids == pids


async def test_a_compile_past_its_cpu_limit_is_stopped_and_the_spare_answers_the_next(setup):
    began = time.perf_counter()
    async with started(setup, count=2, cpu_limit_s=0.05) as workers:
        start_s = time.perf_counter() - began
        pids = workers.pids
        with pytest.raises(
            ValueError,
            match=r"^response_format: compiling the schema took more than 0\.05 s of CPU on this machine",
        ):
            await workers.compile(enum_spec(80_000, "slow"))  # (~0.4 s of CPU)
        assert len(workers.pids & pids) == 1, "only the worker of that compile was stopped"
        began = time.perf_counter()
        compiled = await workers.compile(SMALL)
        small_s = time.perf_counter() - began
        assert compiled.grammar and compiled.schema == SMALL.schema
        assert workers.starts == 3, (
            "one replacement, started in the background; none for this compile"
        )
        assert small_s < start_s / 2, (
            f"the spare answered in {small_s:.2f} s; a start takes {start_s:.2f}"
        )


async def test_a_worker_the_machine_does_not_run_is_not_blamed_for_the_wait(setup):
    async with started(setup, cpu_limit_s=0.5) as workers:
        (pid,) = workers.pids
        with paused(pid):
            compiling = asyncio.ensure_future(workers.compile(SMALL))
            # (twice the limit of wall clock, none of CPU)
            done, _ = await asyncio.wait([compiling], timeout=1.0)
            assert not done
        assert (await compiling).grammar
        assert workers.pids == {pid}, "the worker was not stopped"


async def test_a_compile_past_the_wall_clock_backstop_says_the_machine_is_busy(setup):
    async with started(setup, wall_limit_s=0.5) as workers:
        (pid,) = workers.pids
        with (
            paused(pid),
            pytest.raises(
                ValueError,
                match=r"^response_format: the schema did not compile within 0\.5 s: this machine is too busy",
            ),
        ):
            await workers.compile(SMALL)


async def test_a_spec_seen_before_is_answered_without_a_compile(setup):
    async with started(setup) as workers:
        first = await workers.compile(SMALL)
        workers.close()  # (no worker left to ask)
        again = await workers.compile(dataclasses.replace(SMALL))
        assert again.grammar == first.grammar and workers.compiles == 1
        assert workers.cache.hits >= 1 and workers.cache.nbytes >= len(first.grammar)


async def test_a_schema_the_grammar_library_refuses_says_so_and_is_refused_again_without_a_compile(
    setup,
):
    refused = StructuredOutput("json_schema", schema=json.dumps({"type": "no-such-type"}))
    async with started(setup) as workers:
        for _ in range(2):
            with pytest.raises(ValueError, match=r"^response_format: invalid JSON schema: .+"):
                await workers.compile(refused)
        assert workers.compiles == 1


async def test_one_spec_asked_for_at_once_is_compiled_once(setup):
    async with started(setup, count=2) as workers:
        spec = enum_spec(200, "together")
        results = await asyncio.gather(*(workers.compile(spec) for _ in range(3)))
        assert all(r.grammar == results[0].grammar for r in results) and workers.compiles == 1


async def test_a_requester_that_leaves_does_not_stop_the_compile(setup):
    async with started(setup) as workers:
        spec = enum_spec(50, "left")
        pids = workers.pids
        with paused(next(iter(pids))):  # (so the compile is under way when its requester leaves)
            leaving = asyncio.ensure_future(workers.compile(spec))
            await asyncio.sleep(0.05)
            leaving.cancel()
            (outcome,) = await asyncio.gather(leaving, return_exceptions=True)
            assert isinstance(outcome, asyncio.CancelledError)
        compiled = await workers.compile(spec)
        assert compiled.grammar and workers.compiles == 1 and workers.pids == pids


async def test_a_schema_needing_more_than_the_heap_limit_is_refused_and_the_worker_recovers(setup):
    limited = dataclasses.replace(setup, memory_bytes=450 * 2**20)
    async with started(limited, cpu_limit_s=60) as workers:
        assert (await workers.compile(SMALL)).grammar, "the limit leaves room for ordinary schemas"
        # (the worker dies, or the grammar library fails inside it: a 400 either way)
        with pytest.raises(
            ValueError,
            match="response_format: (compiling the schema needs more memory|invalid JSON "
            "schema: .*memory)",
        ):
            await workers.compile(enum_spec(300_000))
        assert (await workers.compile(enum_spec(50, "after"))).grammar


async def test_a_worker_grown_past_the_recycle_bound_is_replaced(setup):
    async with started(setup, recycle_bytes=1) as workers:
        assert (await workers.compile(SMALL)).grammar
        assert workers.starts == 2, "replaced after its compile"
        assert (await workers.compile(enum_spec(50, "next"))).grammar, "the replacement serves"


async def test_large_compiles_leave_the_front_as_large_as_it_was(setup):
    async with started(setup) as workers:
        await workers.compile(SMALL)
        before = resident_bytes()
        for tag in "abcd":  # four large schemas, none cached: each ~160 MB in the compiling process
            compiled = await workers.compile(enum_spec(20_000, tag))
            assert len(compiled.grammar) > 100_000
            del compiled
        assert resident_bytes() - before < 0.1 * before


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


async def test_the_zygote_spawned_early_forks_the_workers_and_others_are_stopped(
    setup: WorkerSetup,
):
    """A server spawns the zygote while the core loads the model (its imports load meanwhile): the pool takes the one
    for its model over, without starting another, forks its workers from it, and stops any spawned for another
    path."""
    mine, other = spawn(setup.model_path), spawn(None)
    workers = GrammarWorkers(setup, count=2, spawned=[mine, other])
    try:
        assert not other.process.is_alive()
        await workers.start()
        assert workers.zygote_pid == mine.process.pid and workers.zygote_starts == 1
        assert len(workers.pids) == 2 and {parent_of(p) for p in workers.pids} == {mine.process.pid}
        assert (await workers.compile(SMALL)).grammar is not None
    finally:
        workers.close()
    assert not mine.process.is_alive()


async def test_a_stopped_worker_is_forked_again_and_the_tokenizer_is_built_once(setup):
    async with started(setup, count=2, cpu_limit_s=0.05) as workers:
        zygote = workers.zygote_pid
        with pytest.raises(ValueError, match="took more than 0.05 s of CPU"):
            await workers.compile(enum_spec(80_000, "fork"))
        for _ in range(100):  # (the replacement forks in the background)
            if len(workers.pids) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(workers.pids) == 2 and workers.starts == 3
        assert workers.zygote_starts == 1 and workers.zygote_pid == zygote
        assert {parent_of(p) for p in workers.pids} == {zygote}


async def test_workers_share_the_zygotes_memory(setup):
    """A forked worker's pages are the zygote's until written: most of a worker's resident memory (its imports,
    the tokenizer's grammar form) is shared, not its own."""
    async with started(setup, count=2) as workers:
        await workers.compile(SMALL)
        for pid in workers.pids:
            rollup = dict(
                (line.split()[0].rstrip(":"), int(line.split()[1]))
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
            )
            private = rollup["Private_Clean"] + rollup["Private_Dirty"]
            assert private < 0.5 * rollup["Rss"], rollup


async def test_a_zygote_that_ended_is_spawned_again_by_the_next_compile(setup):
    async with started(setup, count=1) as workers:
        first = workers.zygote_pid
        assert first is not None
        (worker,) = workers.pids
        os.kill(first, signal.SIGKILL)  # (its worker dies with it: its parent-death signal)
        for _ in range(100):
            if not Path(f"/proc/{worker}").exists() or "Z" in _state(worker):
                break
            await asyncio.sleep(0.05)
        assert (await workers.compile(SMALL)).grammar is not None
        assert workers.zygote_starts == 2 and workers.zygote_pid not in (None, first)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    return "X"


@pytest.mark.parametrize("reported", ["as_the_directory", "another_vocabulary"])
async def test_a_worker_builds_for_the_vocabulary_it_is_set_up_with(
    setup: WorkerSetup, reported: str
):
    """A worker builds the tokenizer's grammar form for the vocabulary the core reported (the directory's, or a
    padded one): either way it starts and compiles."""
    if reported == "another_vocabulary":
        setup = dataclasses.replace(setup, vocab_size=setup.vocab_size + 64)
    async with started(setup) as workers:
        assert (await workers.compile(SMALL)).grammar is not None
