"""Running the server: one front process under uvicorn (the default), or several over one engine core.

``--api-server-count N`` (vLLM's API-server scale-out): one front process tops out at one CPU, and at hundreds
of streams its HTTP, SSE and output work is more than that while the engine core still has room. Then this
process binds the listening socket, starts the core for N clients and N fronts (each a whole server,
app/server.py, attached to the core as client i and accepting on the shared socket), and supervises them:

- SIGTERM or Ctrl-C here: each front gets one SIGTERM (it drains its open streams for up to
  ``--shutdown-timeout-s``); once all have exited, the core is stopped. The fronts run in a process group of their
  own, so a terminal's Ctrl-C reaches this process only, which passes it on once.
- The core dies: each front sees it at once (a pidfd) and ends its streams with an error event; they exit with
  ENGINE_DIED (or keep answering 503 with ``--no-exit-on-engine-death``), and so does this process.
- A front exits on its own (it failed to start, or crashed): the others are stopped, then the core.
- This process is killed: the kernel ends the fronts and the core (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from app.front import Front
from app.metrics import MULTIPROC_DIR_ENV
from app.settings import ServerSettings
from engine.runtime.core_process import launch_core
from engine.log_format import configure_logging

logger = logging.getLogger("pagedchat")

ENGINE_DIED = 3  # the exit status after the engine failed (a supervisor restarts the server)
START_FAILED = 1  # the exit status when start-up failed for another reason (a bug, the device)
# a mistake of the operator's (a flag, the port, Redis, the model): one line says what to fix
CONFIG_ERROR = 2
_PR_SET_PDEATHSIG = 1
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class PreflightError(ValueError):
    """A start-up mistake found before any weights load: one line to the operator, exit status 2."""


def serve(settings: ServerSettings) -> int:
    """``pagedchat serve``: check what needs no model (the port, Redis, the model's directory), then run until
    stopped; the exit status (0, CONFIG_ERROR, START_FAILED or ENGINE_DIED)."""
    try:
        preflight(settings)
        listener = listen(settings.host, settings.port)
    except PreflightError as exc:
        logger.error("%s", exc)
        return CONFIG_ERROR
    if settings.api_server_count > 1:
        return run_api_servers(settings, listener)
    from app.server import create_app

    return run_server(create_app(settings), settings, sockets=[listener])


def preflight(settings: ServerSettings) -> None:
    """PreflightError for a mistake that would otherwise surface only after the model has loaded."""
    engine = settings.engine
    if engine.model is not None and engine.load_format != "dummy":
        from engine.worker.model_sources import resolve_model

        # a hub id is downloaded (or found in the hub cache) and a .gguf file described here, once
        try:
            path = resolve_model(engine.model, Path(engine.cache_dir))
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
        if not (path / "config.json").is_file():
            raise PreflightError(
                f"model: {engine.model} is not a Hugging Face model directory (no config.json)"
            )
    if settings.redis_url is not None:
        _check_redis(settings.redis_url)
    if settings.resolved_session_store == "sqlite":
        from app.sessions.sqlite_file import check_database

        try:
            check_database(settings.sessions_path)
        except ValueError as exc:
            raise PreflightError(str(exc)) from None


def _check_redis(url: str) -> None:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    except ValueError as exc:
        raise PreflightError(
            f"redis_url: {url!r} is not a Redis URL ({exc}); e.g. redis://localhost:6379/0"
        ) from None
    try:
        client.ping()
    except redis.RedisError as exc:
        raise PreflightError(
            f"redis_url: no Redis answers at {url} ({exc}); start it, fix --redis-url, or leave "
            "it unset to keep sessions in memory"
        ) from None
    finally:
        client.close()


def listen(host: str, port: int) -> socket.socket:
    """The listening socket (as uvicorn binds it: SO_REUSEADDR, IPv6 for a ':' host), bound before the model
    loads so that a busy port is said at once; uvicorn, or every front, accepts on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise PreflightError(
            f"port: cannot listen on {host}:{port} ({exc.strerror or exc}); another server may "
            "hold it: stop it or choose another --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def run_server(
    app: Any, settings: ServerSettings, sockets: list[socket.socket] | None = None
) -> int:
    """Serve ``app`` with uvicorn until stopped (on ``sockets`` if given, else on host:port); the exit status: 0
    after a normal stop, CONFIG_ERROR when the engine refused its configuration at start-up (one line says why),
    START_FAILED when start-up failed otherwise, ENGINE_DIED when the engine failed (with
    ``exit_on_engine_death``)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
        log_config=None,
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips,
        # (app/access_log.py writes one line per request, with its numbers)
        access_log=False,
    )
    server = uvicorn.Server(config)
    app.state.request_shutdown = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    except SystemExit:  # uvicorn's own status when the lifespan failed (3): ours is said below
        if server.started:
            raise
    if app.state.engine_died and settings.exit_on_engine_death:
        return ENGINE_DIED
    if getattr(app.state, "config_error", None) is not None:
        return CONFIG_ERROR
    return 0 if server.started else START_FAILED


def run_api_servers(settings: ServerSettings, listener: socket.socket) -> int:
    """N fronts over one core, supervised until they have all exited; the exit status as ``run_server``'s."""
    count = settings.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="pagedchat-metrics-")
    # (inherited by the fronts: their histograms go there)
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir
    level = logging.getLogger().getEffectiveLevel()
    core = launch_core(settings.engine, count, level, settings.log_format)
    spawn = multiprocessing.get_context("spawn")
    fronts = [
        spawn.Process(
            target=run_front,
            name=f"pagedchat-api-server-{i}",
            args=(settings, Front(endpoint, i, count), listener, level),
        )
        for i, endpoint in enumerate(core.endpoints)
    ]
    stopping = False

    def stop_fronts(signum: int | None = None, frame: Any = None) -> None:
        nonlocal stopping
        if signum is not None:
            logger.info("%s: stopping the %d front processes", signal.Signals(signum).name, count)
        stopping = True
        for front in fronts:
            if front.pid is not None and front.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(front.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop_fronts) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for front in fronts:
            front.start()
        listener.close()  # each front holds its own copy
        logger.info(
            "%d front processes (pids %s) over one engine core (pid %d)",
            count,
            ", ".join(str(f.pid) for f in fronts),
            core.process.pid,
        )
        statuses = _supervise(fronts, core.process, stop_fronts, lambda: stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_core(core.process)
        core.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if ENGINE_DIED in statuses:
        return ENGINE_DIED
    if CONFIG_ERROR in statuses:
        return CONFIG_ERROR
    failed = [s for s in statuses if s not in (0, -signal.SIGTERM)]
    return failed[0] if failed and failed[0] > 0 else (START_FAILED if failed else 0)


def _supervise(fronts: list, core: Any, stop_fronts: Any, stopping: Any) -> list[int]:
    """Wait until every front has exited; a front that exits while the others serve stops them all. Returns
    the fronts' exit statuses in the order they exited."""
    waiting = {front.sentinel: front for front in fronts}
    statuses: list[int] = []
    core_watched = True
    while waiting:
        watched = list(waiting) + ([core.sentinel] if core_watched else [])
        for sentinel in multiprocessing.connection.wait(watched):
            if sentinel == core.sentinel:
                core_watched = False
                logger.error(
                    "the engine core exited (status %s); the fronts end their streams",
                    core.exitcode,
                )
                continue
            front = waiting.pop(sentinel)
            front.join()
            statuses.append(front.exitcode)
            if not stopping():
                logger.error(
                    "front process %s exited (status %s); stopping the others",
                    front.name,
                    front.exitcode,
                )
                stop_fronts()
    return statuses


def _stop_core(core: Any) -> None:
    """The fronts are gone, so nothing is left to finish: SIGKILL (the core ignores SIGTERM and SIGINT, which a
    terminal or systemd send to every process at once, so that it outlives the fronts' draining)."""
    if core.is_alive():
        core.kill()
    core.join()


def run_front(
    settings: ServerSettings, front: Front, listener: socket.socket, log_level: int
) -> None:
    """A front process's entry point (spawned: picklable by name)."""
    os.setpgrp()  # a terminal's Ctrl-C goes to the runner, which passes it on once
    if sys.platform.startswith("linux"):  # the runner killed: this front ends too
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    configure_logging(logging.getLevelName(log_level), settings.log_format, f"front {front.index}")
    from app.server import create_app

    sys.exit(run_server(create_app(settings, front), settings, sockets=[listener]))
