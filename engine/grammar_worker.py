"""GrammarWorkers: response_format schemas compiled and checked in processes of their own, within limits of CPU
time and memory, warm before the first request (the server warms them once healthy: a request sooner waits), and
remembered across requests.

A large or hostile schema costs seconds of CPU and hundreds of megabytes inside llguidance. Compiled in a worker
process instead of a thread of the front:
- the front's event loop and heap never see it: the front receives only the compiled grammar (text);
- a compile is limited by the CPU time its worker spends on it (``cpu_limit_s``, read from /proc/PID/stat, with
  ``RLIMIT_CPU`` in the worker as the backstop), not by a wall clock that a busy machine stretches; a much longer
  wall-clock limit (``wall_limit_s``) remains for a worker the OS does not run at all. Past either, the worker is
  killed (a thread cannot be stopped) and the request gets a 400 that says so; the other worker answers the next
  request at once while a replacement starts in the background;
- the worker's heap is capped (``RLIMIT_DATA``): a schema that needs more ends the worker (or raises MemoryError
  in it), and the request gets a 400 instead of the host swapping;
- a worker whose resident memory has grown past ``recycle_bytes`` after a compile is replaced, so what the allocator
  keeps of large compiles goes back to the system with it.
``start()`` readies the zygote (engine/grammar_zygote.py: it builds the tokenizer's grammar form once and compiles
``{"type": "json_object"}``, whose grammar is kept: the start, not the first request, pays llguidance's set-up) and
forks ``count`` workers from it, which share its memory; each serves one compile at a time, and a worker stopped is
replaced by a fork in milliseconds. A zygote that ended is spawned again by the next start of a worker.
Outcomes are kept by a hash of the spec (engine/output/grammar_cache.py): a schema seen before is not compiled
again, and a requester that leaves does not stop a compile whose outcome the next one will want.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.child_process import cpu_seconds
from engine.grammar_zygote import (
    MEMORY_BYTES,
    OUT_OF_MEMORY,
    WARM_SPEC,
    ForkedWorker,
    Spawned,
    spawn,
)
from engine.output.grammar_cache import GrammarCache, Outcome, spec_key
from engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

CPU_LIMIT_S = 10.0  # CPU seconds one compile may take in its worker
WALL_LIMIT_S = 120.0  # a compile's wall clock, for a worker the machine does not run at all
RECYCLE_BYTES = 2**30  # resident memory after which a worker is replaced
# wall clock of the zygote's start (imports, tokenizer, llguidance) on a busy machine
START_TIMEOUT_S = 300.0
FORK_TIMEOUT_S = 30.0  # wall clock of a fork's answer
_POLL_S = 0.05  # how often a compile's CPU time is read


def cpu_limit_message(limit_s: float) -> str:
    return (
        f"response_format: compiling the schema took more than {limit_s:g} s of CPU on this machine; "
        "simplify it"
    )


def wall_limit_message(limit_s: float) -> str:
    return (
        f"response_format: the schema did not compile within {limit_s:g} s: this machine is too busy to "
        "run the compile; try again later"
    )


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What the zygote needs to build the front's own GrammarCompiler."""

    model_path: str | None
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    memory_bytes: int = MEMORY_BYTES
    # where the zygote's matcher server listens for the engine core (None: the core keeps its own matchers)
    matchers_path: str | None = None


async def _answered(
    conn: Connection, wall_limit_s: float, over: Callable[[], str | None] = lambda: None
) -> str | None:
    """None once ``conn`` turns readable (an answer, or the end of its process); "wall" past ``wall_limit_s``; or
    what ``over`` returns other than None (asked every ``_POLL_S``)."""
    loop = asyncio.get_running_loop()
    answered = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: answered.done() or answered.set_result(None))
    deadline = loop.time() + wall_limit_s
    try:
        while not (await asyncio.wait([answered], timeout=_POLL_S))[0]:
            if (reason := over()) is not None:
                return reason
            if loop.time() > deadline:
                return "wall"
        return None
    finally:
        loop.remove_reader(fd)
        # (uvloop's add_reader made it non-blocking: a large send would fail)
        os.set_blocking(fd, True)


class _Worker:
    def __init__(self, fork: Callable[[], Awaitable[tuple[ForkedWorker, Connection]]]) -> None:
        self._fork = fork  # (the pool's: a worker forked from its ready zygote)
        self._process: ForkedWorker | None = None
        self._conn: Connection | None = None

    async def start(self) -> None:
        """A fresh process, forked from the zygote: warm (its tokenizer, its grammar cache)."""
        self.stop()
        self._process, self._conn = await self._fork()

    async def compile(
        self, spec: StructuredOutput, cpu_limit_s: float, wall_limit_s: float, recycle_bytes: int
    ) -> Outcome:
        """What compiling ``spec`` gave; ValueError past a limit or when the worker died (outcomes of this
        machine and moment, not of the schema: not to be kept)."""
        if not self.alive:
            await self.start()
        assert self._conn is not None
        try:
            self._conn.send((spec, cpu_limit_s))
            over = await self._wait(wall_limit_s, cpu_limit_s)
        except BaseException:
            self.stop()  # (cancelled: its answer must not reach the next compile)
            raise
        if over is not None:
            self.stop()  # (the only way to stop a compile)
            raise ValueError(
                cpu_limit_message(cpu_limit_s)
                if over == "cpu"
                else wall_limit_message(wall_limit_s)
            )
        try:
            kind, value, rss = self._conn.recv()
        except (EOFError, OSError):
            raise ValueError(self._died_of(cpu_limit_s)) from None
        if rss > recycle_bytes:
            logger.info("grammar worker at %d MiB after a compile: replaced", rss >> 20)
            self.stop()
        if kind == "memory":
            raise ValueError(value)
        return Outcome(compiled=value) if kind == "ok" else Outcome(refusal=value)

    async def _wait(self, wall_limit_s: float, cpu_limit_s: float) -> str | None:
        """Until the worker answers or dies (None), its CPU time since now passes ``cpu_limit_s`` ("cpu"), or the
        wall clock ``wall_limit_s`` ("wall")."""
        assert self._conn is not None and self._process is not None
        pid = self._process.pid
        cpu_start = cpu_seconds(pid)
        return await _answered(
            self._conn,
            wall_limit_s,
            lambda: "cpu" if cpu_seconds(pid) - cpu_start > cpu_limit_s else None,
        )

    def _died_of(self, cpu_limit_s: float) -> str:
        """Why the worker ended during a compile: RLIMIT_CPU (SIGXCPU), else its heap limit (an allocation the
        grammar library aborts on)."""
        assert self._process is not None
        self._process.join(5.0)
        exitcode = self._process.exitcode
        logger.warning("grammar worker ended during a compile (exit code %s)", exitcode)
        self.stop()
        return cpu_limit_message(cpu_limit_s) if exitcode == -signal.SIGXCPU else OUT_OF_MEMORY

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.alive else None

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
    """``count`` warm workers, each serving one compile at a time: while one compiles (or is being replaced), the
    others are its warm spares; the outcomes by spec in ``cache``."""

    def __init__(
        self,
        setup: WorkerSetup,
        count: int = 2,
        recycle_bytes: int = RECYCLE_BYTES,
        cpu_limit_s: float = CPU_LIMIT_S,
        wall_limit_s: float = WALL_LIMIT_S,
        cache: GrammarCache | None = None,
        spawned: SequenceOf[Spawned] = (),
    ) -> None:
        """``spawned``: zygotes started early (``spawn``); the one for ``setup.model_path`` is this pool's, the
        others are stopped."""
        early = next((p for p in spawned if p.model_path == setup.model_path), None)
        for unused in (p for p in spawned if p is not early):
            unused.stop()
        self._setup = setup
        self._zygote: Spawned | None = early
        self._zygote_ready = False
        self._forking = asyncio.Lock()
        self._workers = [_Worker(self._fork) for _ in range(count)]
        self._recycle_bytes = recycle_bytes
        self.cpu_limit_s = cpu_limit_s
        self.wall_limit_s = wall_limit_s
        self.cache = cache or GrammarCache()
        self.compiles = 0  # specs sent to a worker (the cache had no outcome for them)
        self.starts = 0  # worker processes started
        self.zygote_starts = 0  # zygotes made ready (each builds the tokenizer's grammar form once)
        self._idle: asyncio.Queue[_Worker] | None = None
        self._starting: asyncio.Future | None = None
        self._compiling: dict[str, asyncio.Future[Outcome]] = {}  # spec key -> its compile
        self._restarts: set[asyncio.Future] = set()
        self._closed = False

    async def start(self) -> None:
        """Ready the zygote and fork every worker from it (once; later calls wait for the first): the first request
        pays for no start. A worker that fails to start is logged and started again by its first compile."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start_all())
        await asyncio.shield(self._starting)

    async def _start_all(self) -> None:
        began = time.perf_counter()
        self._idle = asyncio.Queue()
        self.starts += len(self._workers)
        started = await asyncio.gather(*(w.start() for w in self._workers), return_exceptions=True)
        for worker, outcome in zip(self._workers, started):
            if isinstance(outcome, BaseException):
                logger.warning("%s", outcome)
            self._idle.put_nowait(worker)
        logger.info("%d grammar workers ready in %.1f s", self.running, time.perf_counter() - began)

    async def _fork(self) -> tuple[ForkedWorker, Connection]:
        """A worker forked from the zygote, which is spawned (again, if it ended) and made ready first; one fork
        at a time. RuntimeError when the zygote does not start or answer."""
        async with self._forking:
            zygote = await self._ready_zygote()
            try:
                zygote.request_fork()
                if await _answered(zygote.conn, FORK_TIMEOUT_S) is None:
                    return zygote.fork()
                why = f"no answer within {FORK_TIMEOUT_S:g} s"
            except (EOFError, OSError) as exc:
                why = repr(exc)
            self._stop_zygote()
            raise RuntimeError(f"the grammar zygote did not fork a worker: {why}")

    async def _ready_zygote(self) -> Spawned:
        if self._zygote is not None and self._zygote_ready and self._zygote.process.is_alive():
            return self._zygote
        if self._zygote is None or not self._zygote.process.is_alive():
            self._stop_zygote()
            self._zygote = spawn(
                self._setup.model_path, self._setup.memory_bytes, self._setup.matchers_path
            )
        zygote, answer = self._zygote, None
        why = f"no answer within {START_TIMEOUT_S:g} s"
        try:
            zygote.send_setup(self._setup.vocab_size, self._setup.eos_token_ids)
            if await _answered(zygote.conn, START_TIMEOUT_S) is None:
                answer = zygote.conn.recv()
        except (EOFError, OSError) as exc:  # (it ended while starting)
            why = repr(exc)
        except BaseException:
            self._stop_zygote()
            raise
        if answer is None:
            self._stop_zygote()
            raise RuntimeError(f"the grammar worker did not start: {why}")
        self.zygote_starts += 1
        self._zygote_ready = True
        _, kind, value = answer
        if kind == "ok":
            self.cache.put(spec_key(WARM_SPEC), Outcome(compiled=value))
        return zygote

    def _stop_zygote(self) -> None:
        if self._zygote is not None:
            self._zygote.stop()
        self._zygote, self._zygote_ready = None, False

    async def compile(self, spec: StructuredOutput) -> StructuredOutput:
        """``spec`` checked, with its compiled grammar; ValueError naming ``response_format`` otherwise (refused by
        the grammar library or our checks, past the CPU or wall-clock limit, out of memory)."""
        key = spec_key(spec)
        known = self.cache.get(key)
        if known is not None:
            return known.result()
        await self.start()
        compiling = self._compiling.get(key)
        if compiling is None:  # (the same spec asked for meanwhile waits for the same compile)
            compiling = asyncio.ensure_future(self._compile(key, spec))
            self._compiling[key] = compiling
            compiling.add_done_callback(lambda done: self._forget(key, done))
        # (shielded: a requester that leaves does not stop the compile; its outcome is kept for the next)
        return (await asyncio.shield(compiling)).result()

    async def _compile(self, key: str, spec: StructuredOutput) -> Outcome:
        assert self._idle is not None
        worker = await self._idle.get()
        self.compiles += 1
        try:
            outcome = await worker.compile(
                spec, self.cpu_limit_s, self.wall_limit_s, self._recycle_bytes
            )
        finally:
            self._release(worker)
        self.cache.put(key, outcome)
        return outcome

    def _forget(self, key: str, done: asyncio.Future) -> None:
        self._compiling.pop(key, None)
        if not done.cancelled():
            done.exception()  # (retrieved: nobody may be waiting for it any more)

    def _release(self, worker: _Worker) -> None:
        """Back to the idle workers; one that was stopped is started again first, in the background, while the
        others serve."""
        if self._closed:
            return
        if worker.alive:
            assert self._idle is not None
            self._idle.put_nowait(worker)
            return
        self.starts += 1
        restart = asyncio.ensure_future(self._restart(worker))
        self._restarts.add(restart)
        restart.add_done_callback(self._restarts.discard)

    async def _restart(self, worker: _Worker) -> None:
        assert self._idle is not None
        try:
            await worker.start()
        except Exception as exc:  # noqa: BLE001 - logged; its next compile starts it again
            logger.warning("%s", exc)
        self._idle.put_nowait(worker)

    @property
    def running(self) -> int:
        """Worker processes alive (started, or being started again after a compile stopped one)."""
        return sum(worker.alive for worker in self._workers)

    @property
    def pids(self) -> set[int]:
        return {worker.pid for worker in self._workers if worker.pid is not None}

    @property
    def zygote_pid(self) -> int | None:
        alive = self._zygote is not None and self._zygote.process.is_alive()
        return self._zygote.process.pid if alive else None

    def close(self) -> None:
        self._closed = True
        for task in (self._starting, *self._restarts, *self._compiling.values()):
            if task is not None:
                task.cancel()
        for worker in self._workers:
            with contextlib.suppress(Exception):
                worker.stop()
        with contextlib.suppress(Exception):
            self._stop_zygote()
