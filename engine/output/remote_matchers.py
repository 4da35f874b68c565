"""Grammar matchers held in another process: the engine core's structured-output state kept where llguidance's form
of the tokenizer already is, so the core never builds its own.

That form of the tokenizer is ~250 MiB of Rust heap for Gemma 3's 262k-token vocabulary (2-3 s of CPU, the GIL held).
The grammar zygote (engine/grammar_zygote.py) builds it once for the front's compile workers; it also forks a
matcher server (``serve``, process ``pagedchat-gmask``) that shares those pages and holds the core's matchers: one
per constrained sequence, created from the grammar the front compiled. The core's ``RemoteMatcher`` stands for one
of them with the methods the step uses (consume, validate, roll back, mask), each one round trip on a Unix socket
(tens of microseconds); a step's masks for every constrained row are one round trip (``RemoteMatchers.fill_masks``).

Faults: the server ending (killed, out of memory) or not answering within ``REPLY_TIMEOUT_S`` ends the requests
whose matchers it held (their next call raises ValueError naming ``response_format``; the server is killed if it
hangs); the zygote forks a new one and the next grammar connects to it. No server at the path (an engine without
the front's zygote): ``connect`` says so and the core keeps its own matchers.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
from multiprocessing.connection import Client, Connection
from typing import Any

import numpy as np

REPLY_TIMEOUT_S = 30.0  # a server this late is stuck (a grammar's lexer exploding): it is killed
ENDED = "response_format: the grammar process ended; the request cannot go on"
# the matcher's methods a client may call by name (no state but the matcher's own is reachable)
_METHODS = frozenset(
    {
        "consume_token",
        "consume_tokens",
        "validate_tokens",
        "rollback",
        "is_error",
        "get_error",
        "is_accepting",
        "is_stopped",
    }
)


class RemoteMatchers:
    """The core's connection to a matcher server (made on first use, again after the server ended)."""

    def __init__(self, path: str, vocab_size: int) -> None:
        self.path = path
        self.words = -(-vocab_size // 32)
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._server_pid = 0
        # bumped when a connection is lost: the matchers of an older one are gone with their server
        self.generation = 0
        self._released: list[int] = []  # keys of dropped matchers, freed with the next call

    def connect(self) -> None:
        """Connect now (OSError: no server listens at the path)."""
        with self._lock:
            self._connection()

    def matcher(self, grammar: str) -> RemoteMatcher:
        """A new matcher for a compiled grammar (ValueError if the server refuses it)."""
        return RemoteMatcher(self, self.call("new", grammar))

    def call(self, op: str, *args: Any) -> Any:
        with self._lock:
            conn = self._connection()
            released, self._released = self._released, []
            try:
                conn.send((released, op, args))
                if not conn.poll(REPLY_TIMEOUT_S):
                    self._kill_server()
                    raise TimeoutError
                kind, value = conn.recv()
            except (OSError, EOFError, TimeoutError):
                self._lost()
                raise ValueError(ENDED) from None
        if kind != "ok":
            raise ValueError(value)
        return value

    def fill_masks(
        self, matchers: list[RemoteMatcher], mask: Any, rows: list[int]
    ) -> dict[int, str]:
        """Each matcher's next-token mask into its row of ``mask`` (a contiguous int32 ``[rows, words]`` CPU tensor),
        in one round trip; returns the rows whose grammar failed (row -> message), left as they were."""
        current = [m for m in matchers if m.generation == self.generation]
        failed = {row: ENDED for m, row in zip(matchers, rows) if m.generation != self.generation}
        if not current:
            return failed
        try:
            errors, data = self.call("masks", [m.key for m in current])
        except ValueError as exc:  # (the server ended: every row's request ends)
            return {row: str(exc) for row in rows}
        words = np.frombuffer(data, dtype=np.int32).reshape(len(current), self.words)
        kept = [row for m, row in zip(matchers, rows) if m.generation == self.generation]
        target = mask.numpy()
        for index, row in enumerate(kept):
            if index in errors:
                failed[row] = errors[index]
            else:
                target[row, : self.words] = words[index]
        return failed

    def release(self, key: int, generation: int) -> None:
        if generation == self.generation:
            self._released.append(key)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _connection(self) -> Connection:
        if self._conn is None:
            conn = Client(self.path, family="AF_UNIX")
            if not conn.poll(REPLY_TIMEOUT_S):
                conn.close()
                raise OSError(f"no matcher server answered at {self.path}")
            self._server_pid = conn.recv()
            self._conn = conn
        return self._conn

    def _kill_server(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self._server_pid > 0:
                os.kill(self._server_pid, signal.SIGKILL)

    def _lost(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None
        self._released.clear()
        self.generation += 1


class RemoteMatcher:
    """One sequence's matcher in the server: the parts of ``llguidance.LLMatcher`` the engine calls."""

    __slots__ = ("owner", "key", "generation")

    def __init__(self, owner: RemoteMatchers, key: int) -> None:
        self.owner = owner
        self.key = key
        self.generation = owner.generation

    def _call(self, method: str, *args: Any) -> Any:
        if self.generation != self.owner.generation:
            raise ValueError(ENDED)
        return self.owner.call("call", self.key, method, args)

    def deep_copy(self) -> RemoteMatcher:
        if self.generation != self.owner.generation:
            raise ValueError(ENDED)
        return RemoteMatcher(self.owner, self.owner.call("copy", self.key))

    def unsafe_compute_mask_ptr(self, pointer: int, num_bytes: int) -> None:
        if self.generation != self.owner.generation:
            raise ValueError(ENDED)
        errors, data = self.owner.call("masks", [self.key])
        if errors:
            raise ValueError(errors[0])
        ctypes.memmove(pointer, data, min(num_bytes, len(data)))

    def consume_token(self, token: int) -> bool:
        return self._call("consume_token", token)

    def validate_tokens(self, tokens: list[int]) -> int:
        return self._call("validate_tokens", tokens)

    def rollback(self, count: int) -> bool:
        return self._call("rollback", count)

    def is_error(self) -> bool:
        return self._call("is_error")

    def get_error(self) -> str:
        return self._call("get_error")

    def is_accepting(self) -> bool:
        return self._call("is_accepting")

    def is_stopped(self) -> bool:
        return self._call("is_stopped")

    def __del__(self) -> None:
        self.owner.release(self.key, self.generation)


# the server's side ---------------------------------------------------------------------------------


def listen(path: str) -> socket.socket:
    """The server's socket at ``path`` (a stale one from an ended zygote replaced), owner-only."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(4)
    return listener


def serve(listener: socket.socket, tokenizer: Any) -> None:
    """Serve one client at a time until killed: each connection starts with no matchers."""
    while True:
        try:
            conn = Connection(listener.accept()[0].detach())
        except OSError:
            continue
        try:
            conn.send(os.getpid())
            _serve_client(conn, tokenizer)
        except (OSError, EOFError):
            pass
        finally:
            conn.close()


def _serve_client(conn: Connection, tokenizer: Any) -> None:
    import llguidance

    matchers: dict[int, Any] = {}
    next_key = 0
    words = np.empty(0, dtype=np.int32)
    num_words = -(-tokenizer.vocab_size // 32)
    while True:
        released, op, args = conn.recv()
        for key in released:
            matchers.pop(key, None)
        try:
            if op == "new":
                matcher = llguidance.LLMatcher(tokenizer, args[0])
                if matcher.is_error():
                    raise ValueError(f"response_format: grammar failed: {matcher.get_error()}")
                next_key += 1
                matchers[next_key] = matcher
                value: Any = next_key
            elif op == "copy":
                next_key += 1
                matchers[next_key] = matchers[args[0]].deep_copy()
                value = next_key
            elif op == "masks":
                if words.size < len(args[0]) * num_words:
                    words = np.empty(len(args[0]) * num_words, dtype=np.int32)
                value = _masks([matchers[key] for key in args[0]], words, num_words)
            elif op == "call" and args[1] in _METHODS:
                value = getattr(matchers[args[0]], args[1])(*args[2])
            else:
                raise ValueError(f"unknown matcher call {op!r}")
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - the caller's grammar fault, raised there
            conn.send(("error", str(exc) or type(exc).__name__))
            continue
        conn.send(("ok", value))


def _masks(matchers: list[Any], words: np.ndarray, num_words: int) -> tuple[dict[int, str], bytes]:
    """Each matcher's mask as ``num_words`` int32 words, and the indices of those that failed (-> message)."""
    errors: dict[int, str] = {}
    for index, matcher in enumerate(matchers):
        row = words[index * num_words : (index + 1) * num_words]
        try:
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if matcher.is_error():
                raise ValueError(matcher.get_error().splitlines()[0])
        except Exception as exc:  # noqa: BLE001 - one matcher's failure is its request's
            errors[index] = f"response_format: grammar failed: {exc}"
    return errors, words[: len(matchers) * num_words].tobytes()
