"""The supervisor: front processes over one engine core, watched (``--api-server-count N``, ``--restart-core``).

With several fronts (vLLM's API-server scale-out: one front tops out at one CPU, and at hundreds of streams its
HTTP, SSE and output work is more than that while the core still has room), or with one and ``--restart-core``,
this process holds the listening socket (bound by app/serve.py), starts the core for N clients and N fronts (each
a whole server, app/server.py, attached to the core as client i and accepting on the shared socket), and watches
them:

- SIGTERM or Ctrl-C here: each front gets one SIGTERM (it drains its open streams for up to
  ``--shutdown-timeout-s``); once all have exited, the core is stopped. The fronts run in a process group of their
  own, so a terminal's Ctrl-C reaches this process only, which passes it on once.
- The core dies: each front sees it at once (a pidfd) and ends its streams with an error event; they exit with
  ENGINE_DIED (or keep answering 503 with ``--no-exit-on-engine-death``), and so does this process.
- With ``--restart-core``, a core that dies is replaced instead: the fronts end their streams as above and exit
  (told to, if need be), then a new core and new fronts start on the same listening socket, which this process
  keeps open meanwhile, so a connection made during the restart waits in the backlog and is served by the new
  fronts. The fronts are restarted rather than re-attached because everything a front holds is its core's (the
  core's limits, its requests, its preset pins, its sockets): a fresh front builds all of it by its ordinary
  start, with no second path into the engine. At most ``--max-core-restarts`` restarts within RESTART_WINDOW_S,
  then ENGINE_DIED; a failed first start is not restarted (the start's own status), nor a configuration mistake.
- A front dies while the others serve (killed, crashed): the server is short of a front, and the requests it
  had sent the core are nobody's. The core is stopped at once, which every other front sees as the engine's
  death (each open stream ends with the error event, then ``[DONE]``); they exit, and so does this process, with
  ENGINE_DIED. A front that fails to start (status START_FAILED or CONFIG_ERROR) stops the others, and that
  is the status. A front's exit during a stop (SIGTERM, Ctrl-C) is the stop's.
- This process is killed: the kernel ends the fronts and the core (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.exit_status import CONFIG_ERROR, ENGINE_DIED, START_FAILED
from app.front import Front
from app.metrics import MULTIPROC_DIR_ENV
from app.settings import ServerSettings
from engine.runtime.core_process import LaunchedCore, launch_core

logger = logging.getLogger("pagedchat")

# --max-core-restarts counts the restarts within this many seconds
RESTART_WINDOW_S = 600.0

# a front process's entry point: (settings, which front, the listening socket, the log level)
FrontMain = Callable[[ServerSettings, Front, socket.socket, int], None]


@dataclass(slots=True)
class Ending:
    """How one generation (a core and its fronts) ended."""

    statuses: list[int] = field(default_factory=list)  # the fronts' exit statuses, in exit order
    core_died: bool = False  # the core exited without being told to
    front_lost: bool = False  # a front died while the others served


def run_supervised(settings: ServerSettings, listener: socket.socket, front_main: FrontMain) -> int:
    """Run the fronts and the core (and restart them, with ``restart_core``) until stopped; the exit status as
    app/serve.py's ``run_server``'s."""
    metrics_dir = None
    if settings.api_server_count > 1:
        metrics_dir = tempfile.mkdtemp(prefix="pagedchat-metrics-")
        # (inherited by the fronts: their histograms go there)
        os.environ[MULTIPROC_DIR_ENV] = metrics_dir
    supervisor = Supervisor(settings, listener, front_main)
    previous = {sig: signal.signal(sig, supervisor.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        supervisor.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


class Supervisor:
    def __init__(
        self, settings: ServerSettings, listener: socket.socket, front_main: FrontMain
    ) -> None:
        self.settings = settings
        self.count = settings.api_server_count
        # kept open between generations with restart_core, else closed once the fronts have theirs
        self.listener: socket.socket | None = listener
        self.front_main = front_main
        self.log_level = logging.getLogger().getEffectiveLevel()
        self.core: LaunchedCore | None = None
        self.fronts: list[multiprocessing.process.BaseProcess] = []
        self.stopping = False  # SIGTERM or Ctrl-C: the fronts drain, nothing restarts
        # a generation's fronts have started (each holds the socket) and not all have exited
        self.serving = False
        self.core_stopped = False  # this generation's core was stopped here (its exit is no death)
        self.restarts: collections.deque[float] = collections.deque()  # their times (monotonic)

    def run(self) -> int:
        first = True
        while True:
            self._start()
            ending = self._watch()
            self.serving = False
            self._stop_core()
            if not self._restarts_after(ending, first):
                return exit_status(ending)
            if not self._may_restart():
                return ENGINE_DIED
            first = False

    def stop(self, signum: int | None = None, frame: Any = None) -> None:
        """The SIGTERM and SIGINT handler: every front drains and exits, then the core is stopped."""
        if signum is not None:
            logger.info(
                "%s: stopping the %d front processes", signal.Signals(signum).name, self.count
            )
        self.stopping = True
        self._signal_fronts()
        # (new connections are refused from now on; not before the fronts have their copies: then _start
        # closes it)
        if self.serving:
            self._close_listener()

    def close(self) -> None:
        self._stop_core()
        self._close_listener()

    def _start(self) -> None:
        """A new generation: the core, then the fronts, each given the listening socket."""
        self.core_stopped = False
        self.core = launch_core(
            self.settings.engine, self.count, self.log_level, self.settings.log_format
        )
        spawn = multiprocessing.get_context("spawn")
        self.fronts = [
            spawn.Process(
                target=self.front_main,
                name=f"pagedchat-api-server-{i}",
                args=(self.settings, Front(endpoint, i, self.count), self.listener, self.log_level),
            )
            for i, endpoint in enumerate(self.core.endpoints)
        ]
        for front in self.fronts:
            front.start()
        self.serving = True
        if self.stopping:  # (a signal came while they started)
            self._signal_fronts()
        if self.stopping or not self.settings.restart_core:
            self._close_listener()  # (each front holds its own copy)
        logger.info(
            "%d front processes (pids %s) over one engine core (pid %d)",
            self.count,
            ", ".join(str(f.pid) for f in self.fronts),
            self.core.process.pid,
        )

    def _watch(self) -> Ending:
        """Wait until every front of this generation has exited."""
        ending = Ending()
        waiting = {front.sentinel: front for front in self.fronts}
        core = self.core.process
        core_seen = False
        while waiting:
            watched = list(waiting) + ([] if core_seen else [core.sentinel])
            ready = multiprocessing.connection.wait(watched)
            # a front that exits because the core died is seen after the core, whatever the order of ``ready``
            if not core_seen and (core.sentinel in ready or not core.is_alive()):
                core_seen = True
                self._core_exited(ending)
            for sentinel in ready:
                if sentinel in waiting:
                    self._front_exited(waiting.pop(sentinel), ending)
        return ending

    def _core_exited(self, ending: Ending) -> None:
        if self.core_stopped:
            return
        core = self.core.process
        core.join()  # (its status)
        ending.core_died = True
        logger.error(
            "the engine core (pid %d) exited (status %s); the fronts end their streams",
            core.pid,
            core.exitcode,
        )
        # (they exit on their own, with their own status, unless told to stay up answering 503)
        if self.settings.restart_core and not self.settings.exit_on_engine_death:
            self._signal_fronts()

    def _front_exited(self, front: multiprocessing.process.BaseProcess, ending: Ending) -> None:
        front.join()
        status = front.exitcode
        ending.statuses.append(status)
        if self.stopping or ending.core_died or self.core_stopped:
            return
        if status in (START_FAILED, CONFIG_ERROR):
            logger.error(
                "front process %s failed to start (status %s); stopping the others",
                front.name,
                status,
            )
            self._signal_fronts()
            return
        ending.front_lost = True
        logger.error(
            "front process %s (pid %d) died (status %s) while the others served; stopping the engine "
            "core so that they end their streams, then exiting with status %d",
            front.name,
            front.pid,
            status,
            ENGINE_DIED,
        )
        self._stop_core()
        self._signal_fronts()

    def _restarts_after(self, ending: Ending, first: bool) -> bool:
        """Whether this ending calls for a new core: it died on its own, and the fronts did not fail to start
        the first time (the operator's to look at) nor for a mistake in the configuration."""
        return (
            self.settings.restart_core
            and ending.core_died
            and not self.stopping
            and not ending.front_lost
            and CONFIG_ERROR not in ending.statuses
            and not (first and START_FAILED in ending.statuses)
        )

    def _may_restart(self) -> bool:
        """Count one restart, or refuse it: one line either way."""
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        core = self.core.process
        limit = self.settings.max_core_restarts
        if len(self.restarts) >= limit:
            logger.critical(
                "the engine core (pid %d, status %s) died again after %d restarts within %.0f s "
                "(--max-core-restarts %d); exiting with status %d",
                core.pid,
                core.exitcode,
                len(self.restarts),
                RESTART_WINDOW_S,
                limit,
                ENGINE_DIED,
            )
            return False
        self.restarts.append(now)
        logger.warning(
            "the engine core (pid %d, status %s) died: restarting it and the %d front processes "
            "(restart %d of at most %d within %.0f s)",
            core.pid,
            core.exitcode,
            self.count,
            len(self.restarts),
            limit,
            RESTART_WINDOW_S,
        )
        return True

    def _signal_fronts(self) -> None:
        for front in self.fronts:
            if front.pid is not None and front.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(front.pid, signal.SIGTERM)

    def _stop_core(self) -> None:
        """SIGKILL: the core ignores SIGTERM and SIGINT (which a terminal or systemd send to every process at once,
        so that it outlives the fronts' draining); when the fronts are gone nothing is left to finish."""
        core = self.core
        if core is None:
            return
        self.core_stopped = True
        if core.process.is_alive():
            core.process.kill()
        core.process.join()
        core.close()

    def _close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def exit_status(ending: Ending) -> int:
    """A lost front or the engine's death is ENGINE_DIED; else a front's failed start says why; else 0."""
    statuses = ending.statuses
    if ending.front_lost or ENGINE_DIED in statuses:
        return ENGINE_DIED
    if CONFIG_ERROR in statuses:
        return CONFIG_ERROR
    failed = [s for s in statuses if s not in (0, -signal.SIGTERM)]
    return failed[0] if failed and failed[0] > 0 else (START_FAILED if failed else 0)
