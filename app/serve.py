"""Running the server: one front process under uvicorn (the default), or several supervised over one engine core.

``pagedchat serve`` checks what needs no model and binds the listening socket, then either serves in this process
(uvicorn; the engine starts its own core) or, with ``--api-server-count N`` (N > 1) or ``--restart-core``, hands
the socket to app/supervisor.py, which starts the core and the front processes (``run_front`` here) and watches
them. The exit status: app/exit_status.py.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from app.exit_status import CONFIG_ERROR, ENGINE_DIED, START_FAILED
from app.front import Front
from app.settings import ServerSettings
from app.supervisor import run_supervised
from engine.log_format import configure_logging

logger = logging.getLogger("pagedchat")

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
    if settings.api_server_count > 1 or settings.restart_core:
        return run_supervised(settings, listener, run_front)
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


# an idle client connection is closed after this long (uvicorn's default); a proxy that keeps connections to the
# server open must close its idle ones sooner (docker/nginx.conf's upstream keepalive_timeout), or it may send a
# request on one the server is closing, and nginx then counts the replica as failed
KEEP_ALIVE_S = 5


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
        timeout_keep_alive=KEEP_ALIVE_S,
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


def run_front(
    settings: ServerSettings, front: Front, listener: socket.socket, log_level: int
) -> None:
    """A front process's entry point (spawned: picklable by name)."""
    os.setpgrp()  # a terminal's Ctrl-C goes to the supervisor, which passes it on once
    if sys.platform.startswith("linux"):  # the supervisor killed: this front ends too
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    configure_logging(logging.getLevelName(log_level), settings.log_format, f"front {front.index}")
    from app.server import create_app

    sys.exit(run_server(create_app(settings, front), settings, sockets=[listener]))
