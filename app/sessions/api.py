"""/v1/sessions: server-kept conversations whose every turn extends the previous one's exact token ids (so earlier
turns hit the prefix cache): started, listed, shown, renamed and deleted here, their turns taken in turn_api.py (also
/v1/chat/completions with a session id).

Every path that touches a session checks its owner: another tenant's session is answered exactly as one that does
not exist (404). Session routes answer 503 while the session store is unreachable; the stateless routes keep
serving."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.errors import APIError
from app.openapi import Operation, QueryParam
from app.protocol.sessions import (
    CreateSessionRequest,
    ForkSessionRequest,
    ImportSessionRequest,
    SessionMessageRequest,
    UpdateSessionRequest,
)
from app.request_body import read_model
from app.sessions.find import LIST_LIMIT, MAX_QUERY_CHARS, list_sessions
from app.sessions.fork import fork_session
from app.sessions.presets import check_system, pin_preset, visible_preset
from app.sessions.redis_store import RedisSessionStore
from app.sessions.service import SessionService
from app.sessions.sqlite_store import SQLiteSessionStore
from app.sessions.store import (
    InMemorySessionStore,
    Session,
    SessionStore,
    SessionStoreUnavailable,
    new_session_id,
)
from app.sessions.transfer import export_session, import_session
from app.sessions.turn_api import not_found, post_message, requested_session, session_locked
from app.sessions.warm_api import warm_session
from app.settings import ServerSettings

logger = logging.getLogger(__name__)


async def open_store(settings: ServerSettings) -> SessionStore:
    """The configured store (a clear error when it cannot be reached)."""
    kind = settings.resolved_session_store
    if kind == "redis":
        store: SessionStore = RedisSessionStore(settings.redis_url, settings.session_ttl_s)
        where = f"Redis at {settings.redis_url}"
    elif kind == "sqlite":
        store = SQLiteSessionStore(settings.sessions_path, settings.session_ttl_s)
        where = f"{settings.sessions_path} (SQLite)"
    else:
        store = InMemorySessionStore(settings.session_ttl_s)
        where = "memory: they will not survive a restart"
    try:
        await store.ping()
    except SessionStoreUnavailable as exc:
        await store.close()
        logger.error("cannot start: %s", exc)
        raise RuntimeError(f"session store: {exc}") from None
    logger.info("sessions in %s", where)
    return store


async def create_session(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    body = await read_model(request, CreateSessionRequest, service.limits.max_request_bytes)
    tenant, system = service.admission.tenant(request), body.system
    if body.preset is not None:
        preset = await visible_preset(service, body.preset, tenant, param="preset")
        await pin_preset(service, preset, param="preset")
        system = preset.system
    elif system is not None:
        await check_system(service, system, "system")
    session = Session(
        id=new_session_id(),
        owner=tenant,
        title=body.title or "",
        system=system,
        preset=body.preset,
        cache_salt=body.cache_salt,
        source=body.source,
    )
    if not await service.store.create(session, service.limits.max_sessions_per_key):
        # 128 random bits: never
        raise APIError(409, "session id collision; retry", code="session_exists")
    return JSONResponse(session.public(), status_code=201)


async def sessions_root(request: Request) -> Response:
    return await (create_session(request) if request.method == "POST" else list_sessions(request))


async def get_session(request: Request) -> JSONResponse:
    """The session; while the store is away, a session whose last turn waits in the outbox is shown from there,
    with ``"turn_pending": true``."""
    service: SessionService = request.app.state.server.sessions
    try:
        return JSONResponse((await requested_session(request, service)).public())
    except SessionStoreUnavailable:
        kept = service.outbox.kept(
            request.path_params["session_id"], service.admission.tenant(request)
        )
        if kept is None:
            raise
        return JSONResponse({**kept.public(), "turn_pending": True})


async def update_session(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    body = await read_model(request, UpdateSessionRequest, service.limits.max_request_bytes)
    session = await requested_session(request, service)
    if body.changes_system:
        session = await _set_system(service, session, body.system)
    if body.title is not None:
        await service.store.set_title(session.id, session.owner, body.title)
        session.title = body.title
    if body.pinned is not None:
        await service.store.set_pinned(session.id, session.owner, body.pinned)
        session.pinned = body.pinned
    return JSONResponse(session.public())


async def _set_system(service: SessionService, session: Session, system: str | None) -> Session:
    """Checked as at creation. Under the session's turn lock, so that no turn being answered stores ids rendered
    with the old prompt (409 while one is); the store's revision check covers a turn whose lock expired."""
    if system is not None:
        await check_system(service, system, "system")
    async with session_locked(service, session.id):
        current = await service.store.get(session.id, session.owner)
        if current is None:
            raise not_found(session.id)
        if current.system == system and current.preset is None:
            return current
        current.reset_system(system)
        if not await service.store.set_system(current):
            raise APIError(
                409,
                f"session {session.id!r} changed meanwhile; retry",
                param="session_id",
                code="session_changed",
            )
    return current


async def delete_session(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    session = await requested_session(request, service)
    await service.store.delete(session.id, session.owner)
    return JSONResponse({"id": session.id, "object": "session.deleted", "deleted": True})


async def session_item(request: Request) -> Response:
    handler = {"PATCH": update_session, "DELETE": delete_session}.get(request.method, get_session)
    return await handler(request)


async def store_unavailable_handler(request: Request, exc: Exception) -> JSONResponse:
    return APIError(
        503,
        f"sessions are unavailable: {exc}",
        code="session_store_unavailable",
        headers={"Retry-After": "5"},
    ).response()


async def quota_handler(request: Request, exc: Exception) -> JSONResponse:
    return APIError(
        429,
        f"session_id: {exc} (--max-sessions-per-key); delete some first",
        param="session_id",
        code="session_quota_exceeded",
    ).response()


routes = [
    Route("/v1/sessions", sessions_root, methods=["GET", "POST"]),
    Route("/v1/sessions/import", import_session, methods=["POST"]),
    Route("/v1/sessions/{session_id}", session_item, methods=["GET", "PATCH", "DELETE"]),
    Route("/v1/sessions/{session_id}/messages", post_message, methods=["POST"]),
    Route("/v1/sessions/{session_id}/warm", warm_session, methods=["POST"]),
    Route("/v1/sessions/{session_id}/fork", fork_session, methods=["POST"]),
    Route("/v1/sessions/{session_id}/export", export_session, methods=["GET"]),
]
_SESSION_ID = {"session_id": "22 URL-safe characters"}
OPERATIONS = [
    Operation("/v1/sessions", "POST", "Start a session", CreateSessionRequest, status=201),
    Operation(
        "/v1/sessions",
        "GET",
        "Sessions, pinned ones first, then the most recently updated, a page at a time; or those "
        "holding a text",
        query=[
            QueryParam(
                "limit",
                {
                    "type": "integer",
                    "minimum": LIST_LIMIT[0],
                    "maximum": LIST_LIMIT[1],
                    "default": 50,
                },
            ),
            QueryParam(
                "after",
                {"type": "string", "pattern": "^[A-Za-z0-9_-]{22}$"},
                "the last id of the previous page",
            ),
            QueryParam("source", {"type": "string", "enum": ["ui", "api"]}, "only these"),
            QueryParam(
                "q",
                {"type": "string", "maxLength": MAX_QUERY_CHARS},
                "only sessions whose title or a message holds this text (case-insensitive), newest "
                "first, each with a snippet",
            ),
        ],
    ),
    Operation(
        "/v1/sessions/{session_id}",
        "GET",
        "A session's messages and stats",
        path_params=_SESSION_ID,
    ),
    Operation(
        "/v1/sessions/{session_id}",
        "PATCH",
        "Rename a session, pin it (pinned sessions are listed first) or change its system prompt",
        UpdateSessionRequest,
        path_params=_SESSION_ID,
    ),
    Operation("/v1/sessions/{session_id}", "DELETE", "Delete a session", path_params=_SESSION_ID),
    Operation(
        "/v1/sessions/{session_id}/messages",
        "POST",
        "Send a message; the reply as chat.completion(.chunk)",
        SessionMessageRequest,
        streams=True,
        path_params=_SESSION_ID,
    ),
    Operation(
        "/v1/sessions/{session_id}/warm",
        "POST",
        "Start bringing the session's cached KV blocks back to the device before its next turn",
        path_params=_SESSION_ID,
    ),
    Operation(
        "/v1/sessions/{session_id}/fork",
        "POST",
        "A new session holding the first `turn` turns (and their exact tokens: its next turn hits the "
        "parent's KV blocks)",
        ForkSessionRequest,
        status=201,
        path_params=_SESSION_ID,
    ),
    Operation(
        "/v1/sessions/{session_id}/export",
        "GET",
        "The session as JSON (each message's token count) or a Markdown transcript, as a download",
        query=[QueryParam("format", {"type": "string", "enum": ["json", "markdown"]}, "json")],
        other_types=("text/markdown",),
        path_params=_SESSION_ID,
    ),
    Operation(
        "/v1/sessions/import",
        "POST",
        "A new session holding an exported session's messages",
        ImportSessionRequest,
        status=201,
    ),
]
