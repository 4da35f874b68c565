"""create_app(settings) -> the Starlette application. Its lifespan starts the AsyncEngine (model load, KV
sizing, a warm-up request) and the session store, and stops them on shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from app import openai_api, sessions_api
from app.errors import (APIError, api_error_handler, client_gone_handler, engine_dead_handler,
                        http_error_handler)
from app.metrics import ServerMetrics, health_endpoint, metrics_endpoint
from app.openapi import Operation, openapi_document, openapi_endpoint
from app.prompts import NoTokenizer, PromptRenderer
from app.protocol import ChatCompletionRequest, CompletionRequest
from app.serving import Serving
from app.sessions import SessionStoreUnavailable
from app.settings import ServerSettings
from app.request_body import ClientDisconnected
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.sampling_params import SamplingParams

logger = logging.getLogger("pagedchat")

WEB_DIR = Path(__file__).resolve().parent.parent / "web"

OPERATIONS = [
    Operation("/v1/chat/completions", "POST", "Chat completion (OpenAI)", ChatCompletionRequest, streams=True),
    Operation("/v1/completions", "POST", "Text completion (OpenAI)", CompletionRequest, streams=True),
    Operation("/v1/models", "GET", "The served model"),
    Operation("/health", "GET", "200 while the engine runs, 503 once it failed"),
    Operation("/metrics", "GET", "Prometheus metrics"),
    *sessions_api.OPERATIONS,
]


def create_app(settings: ServerSettings | None = None) -> Starlette:
    settings = settings or ServerSettings()
    routes = [
        *openai_api.routes,
        *sessions_api.routes,
        Route("/health", health_endpoint, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
    ]
    if WEB_DIR.is_dir():  # the browser UI: static files, no build step
        routes.append(WebMount("/", app=StaticFiles(directory=WEB_DIR, html=True), name="web"))
    middleware = [Middleware(ApiKeyMiddleware, api_key=settings.api_key)] if settings.api_key else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=_lifespan, exception_handlers={
        APIError: api_error_handler, HTTPException: http_error_handler, EngineDeadError: engine_dead_handler,
        ClientDisconnected: client_gone_handler,
        SessionStoreUnavailable: sessions_api.store_unavailable_handler, NoTokenizer: _no_tokenizer_handler})
    app.state.settings = settings
    app.state.openapi = openapi_document(OPERATIONS, "pagedchat", "0.1.0")
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    settings: ServerSettings = app.state.settings
    engine = AsyncEngine(settings.engine)
    await engine.start()
    name = settings.served_model_name or _default_model_name(settings)
    server = Serving(settings=settings, engine=engine, prompts=PromptRenderer(engine.tokenizer),
                     metrics=ServerMetrics(name, engine.stats), model_name=name,
                     started=int(time.time()))
    app.state.server = server
    try:
        await _warm_up(engine)
        await sessions_api.open_sessions(server)
        base = f"http://{_display_host(settings.host)}:{settings.port}"
        logger.info("serving %r — chat UI at %s/ — OpenAI base URL %s/v1", name, base, base)
        yield
    finally:
        if server.background:  # turns being stored
            await asyncio.wait(server.background, timeout=10)
        if server.sessions is not None:
            await server.sessions.close()
        await engine.stop()
        server.prompts.close()


async def _no_tokenizer_handler(request: Request, exc: Exception) -> Response:
    return APIError.from_value_error(exc).response()


def _default_model_name(settings: ServerSettings) -> str:
    config = settings.engine
    if config.model is None and config.load_format != "dummy":
        return "SmolLM2-135M-Instruct"
    return Path(config.model).name if config.model else f"dummy-{config.model_config}"


async def _warm_up(engine: AsyncEngine) -> None:
    """One tiny request through the whole path, so the first user does not pay for lazy initialisation."""
    start = time.perf_counter()
    async for _ in engine.generate([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                   request_id="warm-up"):
        pass
    logger.info("warm-up request done in %.2f s", time.perf_counter() - start)


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class WebMount(Mount):
    """The UI's static files answer GET and HEAD outside /v1/ only, so an unknown API route is a 404 and a
    wrong method on an API route a 405, as for any other route (not the static app's answers)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["method"] not in ("GET", "HEAD")):
            return Match.NONE, {}
        return super().matches(scope)


class ApiKeyMiddleware:
    """``--api-key``: every /v1/ route needs ``Authorization: Bearer <key>`` (health, metrics and the UI's
    static files stay open, as load balancers and browsers need them)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._keys = [k.strip().encode() for k in api_key.split(",") if k.strip()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self._authorized(scope):
            error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and any(hmac.compare_digest(token.strip(), k) for k in self._keys)
