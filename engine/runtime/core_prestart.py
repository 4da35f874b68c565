"""An engine core process started before the front has its configuration: it imports the core's modules (torch,
the engine: ~1.5 s on 2 vCPUs), computes the configuration itself with the front's own function of its command
line, tells the front, and starts the core at once, so the model loads while the front still imports torch, reads
its settings and loads its tokenizer (Gemma 3's second start on 2 vCPUs: 4.5 s with a spawn at the front's
lifespan, 3.8-4.2 s now, with the front's tokenizer loaded first thing too: docs/BENCHMARKS.md).

``pagedchat serve`` (one front, the default) calls ``prestart_core`` first thing. When the front's connection
launches its core it takes this one if it was configured exactly as the front's own configuration says (the same
EngineConfig, log level and format, one front), else stops it and spawns one as usual (``take``). The process dies
with its parent, is stopped by ``close`` (also at the front's exit, when never taken), and ignores Ctrl-C as the
core does (the front handles it). Nothing heavy is imported at this module's top: it runs in the front before
torch.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import shutil
import signal
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from engine.child_process import die_with_parent

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.runtime.core_process import LaunchedCore

logger = logging.getLogger(__name__)

# the process's imports and configuration, on a machine too busy to run it soon
_CONFIGURE_TIMEOUT_S = 120.0
# (configuration, log level, log format) from the front's command line
Configure = Callable[[], "tuple[EngineConfig, int, str]"]

_prestarted: PrestartedCore | None = None


def socket_addresses(ipc_dir: str, num_clients: int) -> tuple[str, list[str]]:
    """The core's input socket and one output socket per front, in ``ipc_dir``."""
    return f"ipc://{ipc_dir}/inputs", [f"ipc://{ipc_dir}/outputs-{i}" for i in range(num_clients)]


class PrestartedCore:
    """A spawned process that imports the core's modules, configures itself with ``configure`` and runs the core
    for one front on sockets in a fresh 0700 directory."""

    def __init__(self, configure: Configure) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedchat-")
        self.inputs, self.outputs = socket_addresses(self.ipc_dir, 1)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_configure_then_run,
            name="pagedchat-engine-core",
            daemon=True,
            args=(child, configure, self.inputs, self.outputs),
        )
        self.process.start()
        child.close()
        atexit.register(self.close)

    def take(
        self, config: EngineConfig, log_level: int, log_format: str, num_clients: int
    ) -> LaunchedCore | None:
        """The running core, if it configured itself as ``config`` (field for field), ``log_level`` and
        ``log_format``, for one front; None otherwise, the process stopped (the caller spawns one). Waits for the
        process to have configured itself (it has, by the time a front reaches its lifespan, unless the machine is
        too busy to run it: then up to ``_CONFIGURE_TIMEOUT_S``, before the front serves anything)."""
        from engine.runtime.core_process import CoreEndpoint, LaunchedCore

        configured = self._configured()
        if configured != (config, log_level, log_format) or num_clients != 1:
            if configured is not None:
                logger.info("the core started early was configured otherwise: starting another")
            self.close()
            return None
        atexit.unregister(self.close)
        endpoint = CoreEndpoint(self.inputs, self.outputs[0], 0, self.process.pid)
        return LaunchedCore(self.process, [endpoint], self.ipc_dir)

    def _configured(self) -> tuple[Any, ...] | None:
        """What the process configured itself with (None: it could not, or died)."""
        try:
            if not self._conn.poll(_CONFIGURE_TIMEOUT_S):
                return None
            return self._conn.recv()
        except (EOFError, OSError):
            return None
        finally:
            self._conn.close()

    def close(self) -> None:
        """Not taken: the process is stopped and reaped, its socket directory removed."""
        atexit.unregister(self.close)
        if not self._conn.closed:
            self._conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def prestart_core(configure: Configure) -> None:
    """Start the process the front's core launch takes (once per process)."""
    global _prestarted
    if _prestarted is None:
        _prestarted = PrestartedCore(configure)


def take_prestarted() -> PrestartedCore | None:
    """The process ``prestart_core`` started, once (None: none was, or it was taken)."""
    global _prestarted
    taken, _prestarted = _prestarted, None
    return taken


def _configure_then_run(
    conn: Connection, configure: Configure, inputs: str, outputs: list[str]
) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # (torch and the engine's modules, while the front starts)
    from engine.runtime import core_process

    try:
        configured = configure()
    except Exception:  # noqa: BLE001 - the front finds the same mistake and reports it
        configured = None
    try:
        conn.send(configured)
    except OSError:  # (the front is gone)
        return
    finally:
        conn.close()
    if configured is not None:
        config, log_level, log_format = configured
        core_process.run_engine_core(config, inputs, outputs, log_level, log_format)
