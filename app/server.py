"""create_app(settings) -> the Starlette application. Its lifespan starts the AsyncEngine (model load, KV
sizing, a warm-up request) and the session store, and stops them on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import openai_api, responses_api, tokenize_api
from app.access_log import AccessLog
from app.errors import (
    APIError,
    api_error_handler,
    client_gone_handler,
    engine_dead_handler,
    http_error_handler,
    request_failed_handler,
)
from app.front import Front
from app.metrics import health_endpoint, metrics_endpoint
from app.openapi import Operation, openapi_document, openapi_endpoint
from app.prompts import NoTokenizer
from app.protocol.completions import ChatCompletionRequest, CompletionRequest
from app.request_body import ClientDisconnected
from app.security import security_middleware
from app.serving import Serving, build_serving
from app.sessions import api as sessions_api
from app.sessions import presets
from app.sessions.store import SessionQuotaExceeded, SessionStoreUnavailable
from app.sessions.turn_api import chat_in_session
from app.settings import ServerSettings
from app.version import version
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.engine_client import EngineClient
from engine.request_stream import RequestFailedError
from engine.sampling_params import SamplingParams

logger = logging.getLogger("pagedchat")

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
_WATCH_S = 0.5  # how often the engine's health is looked at

OPERATIONS = [
    Operation(
        "/v1/chat/completions",
        "POST",
        "Chat completion (OpenAI)",
        ChatCompletionRequest,
        streams=True,
    ),
    Operation(
        "/v1/completions", "POST", "Text completion (OpenAI)", CompletionRequest, streams=True
    ),
    Operation("/v1/models", "GET", "The served model, one card per name it is served as"),
    Operation(
        "/v1/models/{model_id}",
        "GET",
        "The served model's card under one of its names (404 for another name)",
        path_params={"model_id": "one of the model's names"},
    ),
    Operation("/health", "GET", "200 while the engine runs, 503 once it failed"),
    Operation("/ping", "GET", "As /health"),
    Operation("/version", "GET", "The server's version"),
    *tokenize_api.OPERATIONS,
    *responses_api.OPERATIONS,
    Operation(
        "/metrics", "GET", "Prometheus metrics (text exposition format)", content_type="text/plain"
    ),
    *sessions_api.OPERATIONS,
    *presets.OPERATIONS,
]


def create_app(settings: ServerSettings | None = None, front: Front | None = None) -> Starlette:
    """The application; its lifespan starts the engine (or, as one of several fronts, attaches to the shared
    core) and the session store. Whoever runs it may set
    ``app.state.request_shutdown`` (a callable): it is called when the engine dies and ``exit_on_engine_death``
    is on, and ``app.state.engine_died`` is True from then on (``pagedchat serve`` then exits non-zero)."""
    settings = settings or ServerSettings()
    routes = [
        *openai_api.routes,
        *responses_api.routes,
        *sessions_api.routes,
        *presets.routes,
        *tokenize_api.routes,
        Route("/health", health_endpoint, methods=["GET"]),
        Route("/ping", health_endpoint, methods=["GET", "POST"]),
        Route("/version", _version_endpoint, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
    ]
    if WEB_DIR.is_dir():  # the browser UI: static files, no build step
        api_paths = frozenset(route.path for route in routes)
        routes.append(WebMount(StaticFiles(directory=WEB_DIR, html=True), api_paths))
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(OneLineStartupErrors),
            Middleware(AccessLog),
            *security_middleware(settings),
        ],
        lifespan=_lifespan,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_error_handler,
            EngineDeadError: engine_dead_handler,
            RequestFailedError: request_failed_handler,
            ClientDisconnected: client_gone_handler,
            NoTokenizer: _no_tokenizer_handler,
            SessionStoreUnavailable: sessions_api.store_unavailable_handler,
            SessionQuotaExceeded: sessions_api.quota_handler,
        },
    )
    app.state.settings = settings
    app.state.front = front or Front()
    app.state.engine_died = False
    app.state.config_error = None  # set when the engine refused its configuration at start-up
    app.state.request_shutdown = None
    app.state.openapi = openapi_document(OPERATIONS, "pagedchat", version())
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    settings: ServerSettings = app.state.settings
    front: Front = app.state.front
    engine = AsyncEngine(settings.engine, endpoint=front.endpoint, log_format=settings.log_format)
    try:
        await engine.start(grammar_workers=settings.grammar_workers)
    except ValueError as exc:  # the operator's mistake (a flag, the model): one line, exit status 2
        app.state.config_error = str(exc)
        logger.error("%s", exc)
        raise
    names = tuple(settings.served_model_name or [_default_model_name(settings)])
    try:
        store = await sessions_api.open_store(settings)
    except BaseException:
        await engine.stop()
        raise
    server = build_serving(settings, engine, front, names, store, chat_in_session)
    app.state.server = server
    watcher = pinning = warming = None
    try:
        try:
            await _warm_up(engine, f"warm-up-{front.index}")
            # the grammar workers (spawned with the engine) warm once the warm-up request is done (beside it they
            # slowed it 0.1 -> 0.6 s on 2 vCPUs) and finish after /health is 200: a response_format sent meanwhile
            # waits for them (not counted in its compile's limits); /health waits for the engine alone
            warming = asyncio.create_task(
                engine.start_grammar_workers(), name="pagedchat-grammar-start"
            )
            if front.pins_stored_presets:
                pinning = presets.pin_stored_presets_later(server.sessions)
        # the core died while this front started: the engine's death, not a mistake
        except EngineDeadError:
            app.state.engine_died = True
            raise
        watcher = asyncio.create_task(_watch_engine(app, server))
        base = f"http://{_display_host(settings.host)}:{settings.port}"
        shown = ", ".join(map(repr, names))
        logger.info("serving %s — chat UI at %s/ — OpenAI base URL %s/v1", shown, base, base)
        yield
    finally:
        for task in (watcher, pinning, warming):
            if task is not None:
                task.cancel()
        await _drain(server)
        await engine.stop()
        server.prompts.close()


async def _watch_engine(app: Starlette, server: Serving) -> None:
    """Once the engine has failed, nothing can be served until the process restarts: shut down (the caller exits
    non-zero, so compose's ``restart:`` or systemd starts a fresh one), unless ``exit_on_engine_death`` is off."""
    while server.engine.healthy:
        await asyncio.sleep(_WATCH_S)
    app.state.engine_died = True
    if not app.state.settings.exit_on_engine_death:
        logger.critical(
            "the engine failed; every request now gets 503 (--no-exit-on-engine-death: not exiting)"
        )
        return
    logger.critical("the engine failed; shutting down so that a supervisor restarts the server")
    if app.state.request_shutdown is not None:
        app.state.request_shutdown()


async def _drain(server: Serving) -> None:
    """Let turns being stored finish, and try once more to store turns kept while the session store was away."""
    outbox = server.sessions.outbox
    outbox.stop()
    if server.background.tasks:
        await asyncio.wait(server.background.tasks, timeout=10)
    if len(outbox):
        with contextlib.suppress(SessionStoreUnavailable, asyncio.TimeoutError):
            await asyncio.wait_for(outbox.flush(), 5)
        if len(outbox):
            logger.error(
                "%d turns were never stored: the session store stayed unreachable", len(outbox)
            )
    await server.sessions.store.close()


async def _version_endpoint(request: Request) -> JSONResponse:
    return JSONResponse({"version": version()})


async def _no_tokenizer_handler(request: Request, exc: Exception) -> Response:
    return APIError.from_value_error(exc).response()


def _default_model_name(settings: ServerSettings) -> str:
    """A hub id as given (``Qwen/Qwen3-0.6B``, as vLLM names it); a directory's name; a .gguf file's stem."""
    config = settings.engine
    if config.model is None and config.load_format != "dummy":
        return "SmolLM2-135M-Instruct"
    if not config.model:
        return f"dummy-{config.model_config}"
    path = Path(config.model)
    if (
        not path.expanduser().exists()
        and "/" in config.model
        and not config.model.startswith(("/", ".", "~"))
    ):
        return config.model
    return path.stem if path.suffix.lower() == ".gguf" else path.name


async def _warm_up(engine: EngineClient, request_id: str) -> None:
    """One tiny request through the whole path, so the first user does not pay for lazy initialisation."""
    start = time.perf_counter()
    async for _ in engine.generate(
        [1, 2, 3, 4],
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        request_id=request_id,
    ):
        pass
    logger.info("warm-up request done in %.2f s", time.perf_counter() - start)


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class OneLineStartupErrors:
    """A configuration mistake at start-up was logged in one line by the lifespan; uvicorn would log Starlette's
    traceback of it too. Other start-up failures keep their traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_quietly(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and isinstance(
                sys.exc_info()[1], ValueError
            ):
                message = {"type": message["type"], "message": ""}
            await send(message)

        await self.app(scope, receive, send_quietly)


class WebMount(Mount):
    """The UI's static files answer GET and HEAD outside /v1/ and the API's own paths only, so an unknown API
    route is a 404 and a wrong method on an API route (``GET /tokenize``) a 405, as for any other route (not the
    static app's answers)."""

    def __init__(self, files: ASGIApp, api_paths: frozenset[str]) -> None:
        super().__init__("/", app=files, name="web")
        self._api_paths = api_paths

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and (
            scope["path"].startswith("/v1/")
            or scope["path"] in self._api_paths
            or scope["method"] not in ("GET", "HEAD")
        ):
            return Match.NONE, {}
        return super().matches(scope)
