"""Grammar workers (engine/grammar_worker.py): a schema compiles in a process of its own, which a compile past its
time or heap limit ends (a 400 naming response_format, and the next compile works), which is replaced once it has
grown too large, and whose memory never shows up in the front."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.grammar_worker import GrammarWorkers, WorkerSetup
from engine.worker.model_sources import ensure_default_model
from engine.sampling_params import StructuredOutput

SMALL = StructuredOutput(
    "json_schema",
    schema=json.dumps(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    ),
)


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


@contextlib.contextmanager
def running(setup: WorkerSetup, **options) -> Iterator[GrammarWorkers]:
    workers = GrammarWorkers(setup, count=1, **options)
    try:
        yield workers
    finally:
        workers.close()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def test_a_schema_needing_more_than_the_heap_limit_is_refused_and_the_worker_recovers(setup):
    limited = dataclasses.replace(setup, memory_bytes=450 * 2**20)
    with running(limited) as workers:
        assert (await workers.compile(SMALL, 60)).grammar, (
            "the limit leaves room for ordinary schemas"
        )
        # (the worker dies, or the grammar library fails inside it: a 400 either way)
        with pytest.raises(
            ValueError,
            match="response_format: (compiling the schema needs more memory|invalid JSON "
            "schema: .*memory)",
        ):
            await workers.compile(enum_spec(300_000), 60)
        assert (await workers.compile(SMALL, 60)).grammar


async def test_a_compile_past_its_time_limit_is_stopped_and_the_next_one_works(setup):
    with running(setup) as workers:
        await workers.compile(SMALL, 60)  # (started: the limit below is the compile's own)
        with pytest.raises(ValueError, match="response_format: the schema did not compile within"):
            await workers.compile(enum_spec(20_000, "slow"), 0.05)
        assert workers.running == 0, "the worker was stopped"
        compiled = await workers.compile(SMALL, 60)
        assert compiled.grammar and compiled.schema == SMALL.schema


async def test_a_worker_grown_past_the_recycle_bound_is_replaced(setup):
    with running(setup, recycle_bytes=1) as workers:
        assert (await workers.compile(SMALL, 60)).grammar
        assert workers.running == 0, "replaced (started again on the next compile)"
        assert (await workers.compile(SMALL, 60)).grammar


async def test_large_compiles_leave_the_front_as_large_as_it_was(setup):
    with running(setup) as workers:
        await workers.compile(SMALL, 60)
        before = rss_bytes()
        for tag in "abcd":  # four large schemas, none cached: each ~160 MB in the compiling process
            compiled = await workers.compile(enum_spec(20_000, tag), 60)
            assert len(compiled.grammar) > 100_000
            del compiled
        assert rss_bytes() - before < 0.1 * before
