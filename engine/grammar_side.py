"""The front's grammar processes, as one owner: the zygote spawned early (engine/grammar_zygote.py), the pool of
compile workers forked from it (engine/grammar_worker.py), and the private directory where the zygote's matcher
server listens for the engine core (engine/output/remote_matchers.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from engine.grammar_worker import GrammarWorkers, WorkerSetup
from engine.grammar_zygote import Spawned, spawn

_SOCKET = "matchers.sock"


class GrammarSide:
    """Spawned by ``start`` while the core loads the model; the pool made at its first use; ``close`` ends all."""

    def __init__(self) -> None:
        self.workers: GrammarWorkers | None = None  # schema compiles, in processes
        self._spawned: list[Spawned] = []  # their zygote, started early
        self._count = 2
        self._directory: str | None = None  # (owner-only: the socket's)

    @property
    def matchers_path(self) -> str | None:
        """Where the zygote's matcher server listens (None before ``start``, after ``close``)."""
        return None if self._directory is None else os.path.join(self._directory, _SOCKET)

    def start(self, known_model_dir: Path | None, workers: int) -> None:
        """Spawn the zygote now where the model's directory is known and ``workers`` (the pool's size, 2 for 0)
        are wanted: it builds the tokenizer's grammar form once told the vocabulary (the pool's start)."""
        self._directory = tempfile.mkdtemp(prefix="pagedchat-grammar-")
        if known_model_dir and workers:
            self._spawned = [spawn(str(known_model_dir), matchers_path=self.matchers_path)]
        self._count = workers or 2

    def pool(self, model_path: str | None, vocab_size: int, eos: tuple[int, ...]) -> GrammarWorkers:
        """The worker pool (made at the first call, with the early zygote where it is this model's)."""
        if self.workers is None:
            setup = WorkerSetup(model_path, vocab_size, eos, matchers_path=self.matchers_path)
            self.workers = GrammarWorkers(setup, count=self._count, spawned=self._spawned)
        return self.workers

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
        for spawned in self._spawned if self.workers is None else ():
            spawned.stop()  # (never handed over)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
