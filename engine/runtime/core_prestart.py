"""An engine core process started before its configuration exists, so that its imports (torch, the engine's
modules: ~1.5 s on 2 vCPUs) run while the front imports its own and reads its settings; ``launch_core`` hands it
its arguments then, instead of spawning a process.

``pagedchat serve`` (one front, the default) calls ``prestart_core`` first thing; ``launch_core`` takes the process
with ``take_prestarted`` (None: spawn as usual). Until it has its arguments the process dies with its parent, is
stopped by ``close`` (also at the front's exit, when it was never handed them), and ignores Ctrl-C as the core does
(the front handles it). Nothing heavy is imported here: this module runs in the front before torch.
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
from multiprocessing.connection import Connection
from collections.abc import Callable
from typing import Any

from engine.child_process import die_with_parent

_prestarted: PrestartedCore | None = None


class PrestartedCore:
    """A spawned process importing the core's modules, then waiting for its entry point and arguments."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_wait_then_run, name="pagedchat-engine-core", daemon=True, args=(child,)
        )
        self.process.start()
        child.close()
        atexit.register(self.close)

    def hand(self, target: Callable[..., None], args: tuple[Any, ...]) -> bool:
        """Send the process its entry point (``run_engine_core``) and arguments; False (the process closed) if it
        has died meanwhile."""
        if not self.process.is_alive():
            self.close()
            return False
        try:
            self._conn.send((target, args))
        except OSError:  # (broken pipe: it died meanwhile)
            self.close()
            return False
        self._conn.close()  # (handed: the core's life is now launch_core's caller's)
        return True

    def close(self) -> None:
        """Not handed its arguments: the process (importing, or waiting) is stopped and reaped."""
        if self._conn.closed:
            return
        self._conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def prestart_core() -> None:
    """Start the process ``launch_core`` will take (once per process)."""
    global _prestarted
    if _prestarted is None:
        _prestarted = PrestartedCore()


def take_prestarted() -> PrestartedCore | None:
    """The process ``prestart_core`` started, once (None: none was, or it was taken)."""
    global _prestarted
    taken, _prestarted = _prestarted, None
    return taken


def _wait_then_run(conn: Connection) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engine.runtime.engine_core import EngineCore  # noqa: F401 - imported while the front starts

    try:
        target, args = conn.recv()
    except EOFError:  # (the front did not need it: a mistake in its settings, or it stopped)
        return
    finally:
        conn.close()
    target(*args)
