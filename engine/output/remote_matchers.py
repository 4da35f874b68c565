"""Grammar matchers held in another process: the engine core's structured-output state kept where llguidance's form
of the tokenizer already is, so the core never builds its own.

That form of the tokenizer is ~250 MiB of Rust heap for Gemma 3's 262k-token vocabulary (2-3 s of CPU, the GIL held).
The grammar zygote (engine/grammar_zygote.py) builds it once for the front's compile workers; it also forks a
matcher server (``serve``, process ``pagedchat-gmask``) that shares those pages and holds the core's matchers: one
per constrained sequence, created from the grammar the front compiled. The core's ``RemoteMatcher`` stands for one
of them with the methods the engine uses (consume, validate, roll back, mask), each one round trip on a Unix socket
(0.13-0.16 ms on a 2-vCPU VM, against 6-40 us for a call on a matcher in the process). The step's own calls avoid
the wait: after sampling, each row's token goes without waiting (``advance``) and the server answers with the row's
next mask, computed while the core runs its next pass and read when that step builds its masks; the masks not
known so (a new request, a rolled-back speculative walk) come in one round trip for every row
(``RemoteMatchers.fill_masks``).

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
import time
import weakref
from collections import deque
from multiprocessing.connection import Client, Connection
from typing import Any

import numpy as np

from engine.output.matcher_step import consume, next_mask

REPLY_TIMEOUT_S = 30.0  # a server this late is stuck (a grammar's lexer exploding): it is killed
ENDED = "response_format: the grammar process ended; the request cannot go on"
# the matcher's methods a client may call by name (no state but the matcher's own is reachable)
_METHODS = frozenset(
    {
        "consume_token",
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
        # the matchers whose advance's answer (the next mask) is not read yet, in sending order
        self._pending: deque[weakref.ref[RemoteMatcher]] = deque()

    def connect(self) -> None:
        """Connect now (OSError: no server listens at the path)."""
        with self._lock:
            self._connection()

    def matcher(self, grammar: str) -> RemoteMatcher:
        """A new matcher for a compiled grammar (ValueError if the server refuses it)."""
        return RemoteMatcher(self, self.call("new", grammar))

    def call(self, op: str, *args: Any) -> Any:
        """One round trip (the answers of advances sent before it read first)."""
        with self._lock:
            try:
                self._send(op, args)
                self._read_pending()
                kind, value = self._receive()
            except (OSError, EOFError, TimeoutError):
                self._lost()
                raise ValueError(ENDED) from None
        if kind != "ok":
            raise ValueError(value)
        return value

    def advance(self, matcher: RemoteMatcher, token: int) -> None:
        """Send ``matcher``'s token without waiting: the server consumes it and computes the next mask while the
        core runs its next pass; the answer is read with the next call (its verdict with that mask)."""
        with self._lock:
            try:
                self._send("advance", (matcher.key, token))
            except OSError:
                self._lost()
                raise ValueError(ENDED) from None
            self._pending.append(weakref.ref(matcher))

    def fill_masks(
        self, matchers: list[RemoteMatcher], target: np.ndarray, rows: list[int]
    ) -> dict[int, str]:
        """Each matcher's next-token mask into its row of ``target`` (int32 ``[rows, words]``):
        the masks its advance computed, the others in one round trip; returns the rows whose grammar failed (row ->
        message), left as they were."""
        try:
            with self._lock:
                self._read_pending()
        except (OSError, EOFError, TimeoutError):
            with self._lock:
                self._lost()
        failed: dict[int, str] = {}
        asked: list[tuple[RemoteMatcher, int]] = []
        for matcher, row in zip(matchers, rows):
            if matcher.generation != self.generation:
                failed[row] = ENDED
            elif matcher.error is not None:
                failed[row] = matcher.error
            elif matcher.ready is not None:
                target[row, : self.words] = np.frombuffer(matcher.ready, dtype=np.int32)
            else:
                asked.append((matcher, row))
        if asked:
            try:
                errors, data = self.call("masks", [m.key for m, _ in asked])
            except ValueError as exc:  # (the server ended: every row's request ends)
                return {row: str(exc) for row in rows}
            words = np.frombuffer(data, dtype=np.int32).reshape(len(asked), self.words)
            for index, (matcher, row) in enumerate(asked):
                if index in errors:
                    failed[row] = errors[index]
                else:
                    target[row, : self.words] = words[index]
                    matcher.ready = data[index * self.words * 4 : (index + 1) * self.words * 4]
        return failed

    def release(self, key: int, generation: int) -> None:
        if generation == self.generation:
            self._released.append(key)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _send(self, op: str, args: Any) -> None:
        conn = self._connection()
        released, self._released = self._released, []
        conn.send((released, op, args))

    def _receive(self) -> tuple[str, Any]:
        if not self._conn.poll(REPLY_TIMEOUT_S):
            self._kill_server()
            raise TimeoutError
        return self._conn.recv()

    def _read_pending(self) -> None:
        """The answers of the advances sent: each matcher's next mask, or the error that ends its request."""
        while self._pending:
            kind, value = self._receive()
            matcher = self._pending.popleft()()
            if matcher is None:
                continue
            if kind == "ok":
                matcher.ready = value
            else:
                matcher.error = value

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
        self._pending.clear()
        self.generation += 1


class RemoteMatcher:
    """One sequence's matcher in the server: the parts of ``llguidance.LLMatcher`` the engine calls, and
    ``advance`` (the step's consume, answered with the next mask)."""

    __slots__ = ("owner", "key", "generation", "ready", "error", "__weakref__")

    def __init__(self, owner: RemoteMatchers, key: int) -> None:
        self.owner = owner
        self.key = key
        self.generation = owner.generation
        self.ready: bytes | None = None  # the next mask, where known (its state unchanged since)
        self.error: str | None = None  # why an advance failed: the request ends at its next mask

    def _call(self, method: str, *args: Any) -> Any:
        if self.generation != self.owner.generation:
            raise ValueError(ENDED)
        return self.owner.call("call", self.key, method, args)

    def _change(self, method: str, *args: Any) -> Any:
        self._check()
        self.ready = None
        return self.owner.call("call", self.key, method, args)

    def _check(self) -> None:
        if self.generation != self.owner.generation:
            raise ValueError(ENDED)
        if self.error is not None:
            raise ValueError(self.error)

    def advance(self, token: int) -> None:
        """Consume ``token``, its verdict and the next mask read later (RemoteMatchers.advance)."""
        self._check()
        self.ready = None
        self.owner.advance(self, token)

    def deep_copy(self) -> RemoteMatcher:
        self._check()
        copy = RemoteMatcher(self.owner, self.owner.call("copy", self.key))
        copy.ready = self.ready
        return copy

    def unsafe_compute_mask_ptr(self, pointer: int, num_bytes: int) -> None:
        words = np.full((1, self.owner.words), -1, dtype=np.int32)
        failed = self.owner.fill_masks([self], words, [0])
        if failed:
            raise ValueError(failed[0])
        ctypes.memmove(pointer, words.ctypes.data, min(num_bytes, words.nbytes))

    def consume_token(self, token: int) -> bool:
        return self._change("consume_token", token)

    def validate_tokens(self, tokens: list[int]) -> int:
        return self._call("validate_tokens", tokens)

    def rollback(self, count: int) -> bool:
        return self._change("rollback", count)

    def is_error(self) -> bool:
        return self.error is not None or self._call("is_error")

    def get_error(self) -> str:
        return self.error or self._call("get_error")

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
        except OSError:  # (a connection reset before it was taken, or out of descriptors: a moment)
            time.sleep(0.01)
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
    num_words = -(-tokenizer.vocab_size // 32)
    words = np.empty(num_words, dtype=np.int32)
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
            elif op == "advance":
                value = _advance(matchers[args[0]], args[1], words, num_words)
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


def _advance(matcher: Any, token: int, words: np.ndarray, num_words: int) -> bytes:
    """Consume ``token`` (ValueError if the grammar refuses it) and compute the next mask."""
    consume(matcher, token)
    errors, data = _masks([matcher], words, num_words)
    if errors:
        raise ValueError(errors[0])
    return data


def _masks(matchers: list[Any], words: np.ndarray, num_words: int) -> tuple[dict[int, str], bytes]:
    """Each matcher's mask as ``num_words`` int32 words, and the indices of those that failed (-> message)."""
    errors: dict[int, str] = {}
    for index, matcher in enumerate(matchers):
        row = words[index * num_words : (index + 1) * num_words]
        if (error := next_mask(matcher, row.ctypes.data, row.nbytes)) is not None:
            errors[index] = error
    return errors, words[: len(matchers) * num_words].tobytes()
