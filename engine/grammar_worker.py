"""GrammarWorkers: response_format schemas compiled and checked in processes of their own, within time and memory
limits.

A large or hostile schema costs seconds of CPU and hundreds of megabytes inside llguidance. Compiled in a worker
process instead of a thread of the front:
- the front's event loop and heap never see it: the front receives only the compiled grammar (text);
- a compile past its time limit is stopped by killing the worker (a thread cannot be stopped) and the request gets
  a 400 naming ``response_format``;
- the worker's heap is capped (``RLIMIT_DATA``): a schema that needs more ends the worker (or raises MemoryError
  in it), and the request gets a 400 instead of the host swapping;
- a worker whose resident memory has grown past ``recycle_bytes`` after a compile is replaced, so what the allocator
  keeps of large compiles goes back to the system with it.
``count`` workers (started on first use, each loading the tokenizer once) serve compiles one at a time each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import resource
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.child_process import die_with_parent, name_process
from engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

MEMORY_BYTES = 4 * 2**30  # heap of one worker
RECYCLE_BYTES = 2**30  # resident memory after which a worker is replaced
START_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What a worker needs to build the front's own GrammarCompiler."""

    model_path: str | None
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    memory_bytes: int = MEMORY_BYTES


def _serve(conn: Connection, setup: WorkerSetup) -> None:
    """The worker: compile each spec it is sent, answering ("ok", spec) or ("invalid", message), with its RSS."""
    die_with_parent()  # (no orphan when the front is killed)
    name_process("pagedchat-gramm")
    resource.setrlimit(resource.RLIMIT_DATA, (setup.memory_bytes, setup.memory_bytes))
    from engine.worker.loader import load_tokenizer
    from engine.output.structured_output import GrammarCompiler

    tokenizer = load_tokenizer(Path(setup.model_path)) if setup.model_path else None
    compiler = GrammarCompiler(tokenizer, setup.vocab_size, setup.eos_token_ids)
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", compiler.compiled(spec))
        except ValueError as exc:
            answer = ("invalid", str(exc))
        except MemoryError:
            answer = ("invalid", _OUT_OF_MEMORY)
        except Exception as exc:  # noqa: BLE001 - the grammar library's own failure: this request's
            answer = (
                "invalid",
                f"response_format: the schema could not be compiled: {type(exc).__name__}: {exc}",
            )
        conn.send((*answer, _rss_bytes()))


_OUT_OF_MEMORY = "response_format: compiling the schema needs more memory than allowed; simplify it"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _Worker:
    def __init__(self, setup: WorkerSetup) -> None:
        self._setup = setup
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    async def compile(
        self, spec: StructuredOutput, timeout_s: float, recycle_bytes: int
    ) -> StructuredOutput:
        try:
            await self._start()
            assert self._conn is not None
            self._conn.send(spec)
            answered = await asyncio.to_thread(self._conn.poll, timeout_s)
        # (cancelled: the client left; its answer must not reach the next compile)
        except BaseException:
            self.stop()
            raise
        if not answered:
            self.stop()  # (the only way to stop a compile)
            raise ValueError(
                f"response_format: the schema did not compile within {timeout_s:.0f} s; simplify it"
            )
        try:
            kind, value, rss = self._conn.recv()
        # the worker died: its heap limit (an allocation the grammar library aborts on)
        except (EOFError, OSError):
            self.stop()
            raise ValueError(_OUT_OF_MEMORY) from None
        if rss > recycle_bytes:
            logger.info("grammar worker at %d MiB after a compile: replaced", rss >> 20)
            self.stop()
        if kind != "ok":
            raise ValueError(value)
        return value

    async def _start(self) -> None:
        if self.alive:
            return
        self.stop()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child, self._setup), name="pagedchat-grammar", daemon=True
        )
        self._process.start()
        child.close()
        self._conn = parent
        if not await asyncio.to_thread(parent.poll, START_TIMEOUT_S) or parent.recv() != "ready":
            self.stop()
            raise RuntimeError("the grammar worker did not start")

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(5.0)
            self._process = None


class GrammarWorkers:
    def __init__(
        self, setup: WorkerSetup, count: int = 2, recycle_bytes: int = RECYCLE_BYTES
    ) -> None:
        self._workers = [_Worker(setup) for _ in range(count)]
        self._idle: asyncio.Queue[_Worker] | None = None
        self._recycle_bytes = recycle_bytes

    async def compile(self, spec: StructuredOutput, timeout_s: float) -> StructuredOutput:
        """``spec`` checked, with its compiled grammar; ValueError naming ``response_format`` otherwise (past
        ``timeout_s`` of compiling, out of memory, or refused by the grammar library or our checks)."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for worker in self._workers:
                self._idle.put_nowait(worker)
        worker = await self._idle.get()
        try:
            return await worker.compile(spec, timeout_s, self._recycle_bytes)
        finally:
            self._idle.put_nowait(worker)

    @property
    def running(self) -> int:
        """Workers started and alive (each is started on first use and replaced when it grows too large)."""
        return sum(worker.alive for worker in self._workers)

    def close(self) -> None:
        for worker in self._workers:
            with contextlib.suppress(Exception):
                worker.stop()
