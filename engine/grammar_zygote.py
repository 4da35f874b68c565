"""The grammar workers' processes: a zygote that builds llguidance's form of the tokenizer once and forks every
worker from itself, and the forked worker's compile loop.

Each worker needs the tokenizer's llguidance form, which for Gemma 3's 262k-token vocabulary is ~220 MiB of Rust
heap and 2-3 s of CPU to build (the slicer's sub-tries ~90 MiB of it). Built in each worker, two workers held two
copies and a worker stopped for a hostile schema was replaced only after a fresh build. Forked from the zygote, the
workers share its pages (copy-on-write: nothing writes the built tokenizer), so the grammar side holds one copy
whatever the worker count, and a replacement is ready in milliseconds.

The zygote is spawned (no torch, no front state: the spawn context) early, while the core loads the model; it builds
once told the vocabulary's size and end ids (``ready``), then forks a worker per ``fork``: the worker's end of a
socket pair serves its compiles, and a pipe the zygote writes the worker's exit code to when it reaps it stands for
the worker's sentinel (``ForkedWorker``: is_alive, join, exitcode, kill, as a multiprocessing Process). A worker
re-arms its parent-death signal (a fork clears it), so it dies with the zygote, which dies with the front. The
zygote forks from its main thread and starts no other: llguidance's matchers run on the calling thread."""

from __future__ import annotations

import array
import contextlib
import math
import multiprocessing
import os
import resource
import select
import signal
import socket
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from engine.child_process import die_with_parent, name_process, resident_bytes
from engine.output.remote_matchers import listen
from engine.output.remote_matchers import serve as serve_matchers
from engine.sampling_params import StructuredOutput

MEMORY_BYTES = 4 * 2**30  # heap of the zygote and of each worker
WARM_SPEC = StructuredOutput("json_object")
OUT_OF_MEMORY = "response_format: compiling the schema needs more memory than allowed; simplify it"
_REAP_S = 1.0  # how often the zygote reaps ended workers without being woken (SIGCHLD wakes it)
_EXIT = struct.Struct("i")


class ForkedWorker:
    """The front's handle of a worker the zygote forked (not the front's child: the zygote reaps it and writes its
    exit code to ``status_fd``), with the parts of multiprocessing's Process the pool uses."""

    def __init__(self, pid: int, status_fd: int) -> None:
        self.pid = pid
        self._status_fd: int | None = status_fd
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        self._poll(0.0)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self._poll(timeout)

    def kill(self) -> None:
        if (
            self.is_alive()
        ):  # (its pid is not reused while its exit code is unread: the zygote reaps it first)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def _poll(self, timeout: float | None) -> None:
        if self._status_fd is None or not select.select([self._status_fd], [], [], timeout)[0]:
            return
        data = os.read(self._status_fd, _EXIT.size)
        # (nothing written: the zygote ended first, and the worker with it, by its parent-death signal)
        self._exitcode = _EXIT.unpack(data)[0] if len(data) == _EXIT.size else -signal.SIGKILL
        os.close(self._status_fd)
        self._status_fd = None

    def __del__(self) -> None:
        if self._status_fd is not None:
            os.close(self._status_fd)


@dataclass(slots=True)
class Spawned:
    """A zygote process (``spawn``): loading its imports until ``ready`` tells it the rest of its setup."""

    model_path: str | None
    process: multiprocessing.process.BaseProcess
    conn: Connection

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.conn.close()

    def send_setup(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """Start the build; the zygote answers ``("ready", kind, value)``: the warm compile's outcome."""
        self.conn.send((vocab_size, eos_token_ids))

    def fork(self) -> tuple[ForkedWorker, Connection]:
        """A new worker, warm (the zygote's tokenizer and grammar cache), and the connection its compiles go by;
        call once the zygote is ready and its answer to ``fork`` is readable after ``request_fork``."""
        with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as channel:
            fds = array.array("i")
            data, ancillary, _, _ = channel.recvmsg(_EXIT.size, socket.CMSG_SPACE(2 * fds.itemsize))
        if len(data) != _EXIT.size or len(ancillary) != 1:
            raise EOFError("the grammar zygote ended")
        fds.frombytes(ancillary[0][2][: 2 * fds.itemsize])
        return ForkedWorker(_EXIT.unpack(data)[0], fds[1]), Connection(fds[0])

    def request_fork(self) -> None:
        self.conn.send("fork")


def spawn(
    model_path: str | None, memory_bytes: int = MEMORY_BYTES, matchers_path: str | None = None
) -> Spawned:
    """The zygote, started now: its imports load while the core loads the model. ``matchers_path``: where its
    matcher server (engine/output/remote_matchers.py) listens for the engine core; None: none."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=_zygote,
        args=(child, model_path, memory_bytes, matchers_path),
        name="pagedchat-grammar",
        daemon=True,
    )
    process.start()
    child.close()
    return Spawned(model_path, process, parent)


# the zygote's side ---------------------------------------------------------------------------------


def _zygote(
    conn: Connection, model_path: str | None, memory_bytes: int, matchers_path: str | None
) -> None:
    """Take the vocabulary's size and end ids (sent once the front is healthy), build the compiler and compile
    ``WARM_SPEC``, fork the matcher server, answer ("ready", kind, value); then fork a worker per "fork", answering
    its pid with its connection's and exit pipe's ends, and reap ended workers, writing each one's exit code to its
    pipe (an ended matcher server is forked again)."""
    die_with_parent()  # (no orphan when the front is killed)
    name_process("pagedchat-gfork")
    resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))  # (SIGXCPU would write a core file)
    # (listening from the start: the core may connect before the build is done, and waits for the answer)
    listener = listen(matchers_path) if matchers_path else None
    # the build waits for the setup, which the front sends once it is healthy (the pool's start): beside the
    # core's load and the front's start it cost a 2-vCPU machine seconds of its /health
    try:
        setup = conn.recv()
    except EOFError:  # (spawned early for a model the core did not load)
        return
    compiler, warm = _warmed(model_path, *setup)
    exits: dict[int, int] = {}  # worker pid -> its exit pipe's write end
    # a worker's end wakes the loop (SIGCHLD writes to this pipe), so its exit code reaches the front at once
    woken, wake = os.pipe()
    for fd in (woken, wake):
        os.set_blocking(fd, False)
    inherited = [conn.fileno(), woken, wake, *([listener.fileno()] if listener else [])]
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    server = _fork_matchers(listener, compiler, inherited) if listener else 0
    conn.send(("ready", *warm))
    while True:
        ready = wait([conn, woken], timeout=_REAP_S)
        if woken in ready:
            os.read(woken, 4096)
        if conn in ready:
            try:
                conn.recv()
            except EOFError:
                return
            _fork(conn, compiler, exits, inherited)
        if server in _reap(exits):
            server = _fork_matchers(listener, compiler, [*inherited, *exits.values()])


def _forked(name: str, inherited: list[int], body: Callable[[], None]) -> int:
    """Fork a child that runs ``body`` as process ``name`` with the zygote's own descriptors closed (and its parent-
    death signal re-armed: a fork clears it); its pid."""
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            die_with_parent()
            # (the zygote ended before the line above: no signal will come)
            if os.getppid() != zygote:
                return 0
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in inherited:
                os.close(fd)
            name_process(name)
            body()
            code = 0
        finally:
            os._exit(code)
    return pid


def _fork_matchers(listener: socket.socket, compiler: Any, inherited: list[int]) -> int:
    """The matcher server (the engine core's grammar state), sharing the built tokenizer's pages."""
    tokenizer = compiler.ll_tokenizer()
    # (its listening socket is the one thing it keeps of the zygote's)
    closed = [fd for fd in inherited if fd != listener.fileno()]
    return _forked("pagedchat-gmask", closed, lambda: serve_matchers(listener, tokenizer))


def _fork(conn: Connection, compiler: Any, exits: dict[int, int], inherited: list[int]) -> None:
    front_end, worker_end = socket.socketpair()
    status_read, status_write = os.pipe()
    closed = [*inherited, front_end.fileno(), status_read, status_write, *exits.values()]
    pid = _forked(
        "pagedchat-gramm", closed, lambda: serve(Connection(worker_end.detach()), compiler)
    )
    worker_end.close()
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as channel:
        fds = array.array("i", [front_end.fileno(), status_read])
        channel.sendmsg([_EXIT.pack(pid)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    front_end.close()
    os.close(status_read)
    exits[pid] = status_write


def _reap(exits: dict[int, int]) -> list[int]:
    """Reap every ended child, writing a worker's exit code to its pipe; the pids reaped."""
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append(pid)
        fd = exits.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, _EXIT.pack(os.waitstatus_to_exitcode(status)))
            os.close(fd)


# the worker's side ---------------------------------------------------------------------------------


def serve(conn: Connection, compiler: Any) -> None:
    """Compile each (spec, CPU limit) sent, answering (kind, spec or message, RSS) with kind "ok", "invalid"
    (refused: the same schema is refused again) or "memory"; return when the front closes the connection."""
    while True:
        try:
            spec, cpu_limit_s = conn.recv()
        except EOFError:
            return
        _limit_cpu(cpu_limit_s)
        answer = answer_for(compiler, spec)
        _limit_cpu(None)
        conn.send((*answer, resident_bytes()))


def _warmed(model_path: str | None, vocab_size: int, eos_token_ids: Any) -> tuple[Any, tuple]:
    """A compiler with the tokenizer's llguidance form built (no torch and no Hugging Face tokenizer in this process
    where the model has a tokenizer.json), and the outcome of the grammar library's first compile."""
    from engine.output.grammar_compiler import GrammarCompiler
    from engine.worker.tokenizer_files import grammar_source

    compiler = GrammarCompiler(grammar_source(model_path), vocab_size, tuple(eos_token_ids))
    return compiler, answer_for(compiler, WARM_SPEC)


def answer_for(compiler: Any, spec: StructuredOutput) -> tuple[str, Any]:
    try:
        return "ok", compiler.compiled(spec)
    except ValueError as exc:
        return "invalid", str(exc)
    except MemoryError:
        return "memory", OUT_OF_MEMORY
    except Exception as exc:  # noqa: BLE001 - the grammar library's own failure: this request's
        message = f"response_format: the schema could not be compiled: {type(exc).__name__}: {exc}"
        return "invalid", message


def _limit_cpu(limit_s: float | None) -> None:
    """The backstop of the front's own check: SIGXCPU (its default action ends this process) a second or two
    past ``limit_s`` more CPU seconds, should the front not have stopped the compile; None: no limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = hard if limit_s is None else math.ceil(time.process_time() + limit_s) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
