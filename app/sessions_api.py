"""/v1/sessions and /v1/presets: server-kept conversations whose every turn extends the previous one's exact
token ids (so earlier turns hit the prefix cache), and named shared system prompts pinned in the KV cache.

Session routes answer 503 while the session store is unreachable; the stateless routes keep serving."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app import conversation
from app.errors import APIError
from app.openai_api import answer_chat, sampling_params
from app.openapi import Operation
from app.protocol import (ChatCompletionRequest, CreatePresetRequest, CreateSessionRequest, SamplingFields,
                          SessionMessageRequest, UpdateSessionRequest)
from app.request_body import read_model
from app.serving import Serving
from app.session_turns import TurnPlan, TurnRecorder, plan_regeneration, plan_turn
from app.sessions import (InMemorySessionStore, Preset, RedisSessionStore, Session, SessionStore,
                          SessionStoreUnavailable, is_preset_name, is_session_id, new_session_id)

logger = logging.getLogger(__name__)

_TITLE_CHARS = 60


async def open_sessions(server: Serving) -> SessionStore:
    """The configured store (a clear error when Redis is configured but unreachable), presets pinned."""
    settings = server.settings
    if settings.redis_url:
        store: SessionStore = RedisSessionStore(settings.redis_url, settings.session_ttl_s)
        try:
            await store.ping()
        except SessionStoreUnavailable as exc:
            await store.close()
            logger.error("cannot start: %s (--redis-url %s)", exc, settings.redis_url)
            raise RuntimeError(f"session store: {exc}") from None
        logger.info("sessions in Redis at %s", settings.redis_url)
    else:
        store = InMemorySessionStore(settings.session_ttl_s)
        logger.info("sessions in memory: they will not survive a restart (set --redis-url to keep them)")
    server.sessions = store
    for preset in await store.list_presets():
        await _pin_preset(server, preset)
    return store


async def _session(request: Request, server: Serving) -> Session:
    session_id = request.path_params["session_id"]
    session = await server.sessions.get(session_id, server.tenant(request)) if is_session_id(session_id) else None
    if session is None:
        raise APIError(404, f"session {session_id!r} not found", param="session_id", code="session_not_found")
    return session


# sessions ---------------------------------------------------------------------------------------------


async def create_session(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    body = await read_model(request, CreateSessionRequest, server.settings.max_request_bytes)
    system = body.system
    if body.preset is not None:
        preset = await server.sessions.get_preset(body.preset) if is_preset_name(body.preset) else None
        if preset is None:
            raise APIError.bad_request(f"preset: no preset named {body.preset!r}", "preset")
        await _pin_preset(server, preset)
        system = preset.system
    session = Session(id=new_session_id(), owner=server.tenant(request), title=body.title or "", system=system,
                      preset=body.preset, cache_salt=body.cache_salt)
    await server.sessions.create(session)
    return JSONResponse(session.public(), status_code=201)


async def list_sessions(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    limit = request.query_params.get("limit", "50")
    if not limit.isdigit() or not 1 <= int(limit) <= 1000:
        raise APIError.bad_request("limit: must be an integer in [1, 1000]", "limit")
    sessions = await server.sessions.list(server.tenant(request), int(limit))
    return JSONResponse({"object": "list", "data": [s.summary() for s in sessions]})


async def get_session(request: Request) -> JSONResponse:
    return JSONResponse((await _session(request, request.app.state.server)).public())


async def update_session(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    body = await read_model(request, UpdateSessionRequest, server.settings.max_request_bytes)
    session = await _session(request, server)
    await server.sessions.set_title(session.id, session.owner, body.title)
    session.title = body.title
    return JSONResponse(session.public())


async def delete_session(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    session = await _session(request, server)
    await server.sessions.delete(session.id, session.owner)
    return JSONResponse({"id": session.id, "object": "session.deleted", "deleted": True})


async def post_message(request: Request) -> Response:
    server: Serving = request.app.state.server
    arrival = time.monotonic()
    body = await read_model(request, SessionMessageRequest, server.settings.max_request_bytes)
    server.check_model(body.model)
    session = await _session(request, server)
    new = None if body.regenerate else [{"role": "user", "content": body.content}]
    return await _run_turn(request, server, session, new, body, arrival)


async def chat_in_session(request: Request, server: Serving, body: ChatCompletionRequest, session_id: str,
                          arrival: float) -> Response:
    """/v1/chat/completions with ``session_id`` (or X-Session-ID): the request's messages are this turn's new
    messages; the server supplies the history. An unknown (well-formed) id starts a new session."""
    if not is_session_id(session_id):
        raise APIError(404, f"session {session_id!r} not found: ids are 22 URL-safe characters",
                       param="session_id", code="session_not_found")
    owner = server.tenant(request)
    new = [m.as_template_message() for m in body.messages]
    session = await server.sessions.get(session_id, owner)
    if session is None:
        system = new.pop(0)["content"] if new[0]["role"] == "system" else None
        session = Session(id=session_id, owner=owner, system=system, cache_salt=body.cache_salt)
        await server.sessions.create(session)
    if any(m["role"] == "system" for m in new):
        raise APIError.bad_request("messages: a session's system prompt is set when the session starts", "messages")
    if not new or new[-1]["role"] != "user":
        raise APIError.bad_request("messages: must end with the user's new message", "messages")
    return await _run_turn(request, server, session, new, body, arrival)


async def _run_turn(request: Request, server: Serving, session: Session, new: list[dict[str, Any]] | None,
                    body: SamplingFields, arrival: float) -> Response:
    store, lock_s = server.sessions, server.settings.session_lock_s
    token = await store.lock(session.id, lock_s)
    if token is None:
        raise APIError(409, f"session {session.id!r} is answering another message; retry when it is done",
                       param="session_id", code="session_busy")
    try:
        session = await store.get(session.id, session.owner) or session  # fresh, under the lock
        plan = await _plan(server, session, new)
        params = sampling_params(body, len(plan.prompt_ids), server.max_model_len)
        stream = server.submit(plan.prompt_ids, params, server.cache_salt(request, session.cache_salt), arrival)
    except BaseException:
        with contextlib.suppress(SessionStoreUnavailable):
            await store.unlock(session.id, token)
        raise
    if not session.title and new:
        await store.set_title(session.id, session.owner, _title(new[-1]["content"]))
    TurnRecorder(store, session, plan, token, lock_s, server.background).start(stream)
    return await answer_chat(request, server, body, stream, headers={"X-Session-ID": session.id})


async def _plan(server: Serving, session: Session, new: list[dict[str, Any]] | None) -> TurnPlan:
    if new is not None:
        return await plan_turn(server, session, new)
    try:
        return plan_regeneration(session)
    except ValueError as exc:
        raise APIError.from_value_error(exc) from None


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _TITLE_CHARS else line[: _TITLE_CHARS - 1] + "…"


# presets ----------------------------------------------------------------------------------------------


async def create_preset(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    body = await read_model(request, CreatePresetRequest, server.settings.max_request_bytes)
    if await server.sessions.get_preset(body.name) is not None:
        raise APIError(409, f"preset {body.name!r} exists; delete it first", param="name", code="preset_exists")
    preset = Preset(body.name, body.system)
    await server.sessions.save_preset(preset)
    num_tokens, pinned = await _pin_preset(server, preset)
    return JSONResponse(preset.public(num_tokens, pinned), status_code=201)


async def list_presets(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    presets = await server.sessions.list_presets()
    pins = server.preset_pins
    return JSONResponse({"object": "list", "data": [p.public(*pins.get(p.name, (None, None))) for p in presets]})


async def delete_preset(request: Request) -> JSONResponse:
    server: Serving = request.app.state.server
    name = request.path_params["name"]
    if not is_preset_name(name) or not await server.sessions.delete_preset(name):
        raise APIError(404, f"preset {name!r} not found", param="name", code="preset_not_found")
    if server.preset_pins.pop(name, None) is not None:
        await server.engine.unpin_prefix(f"preset:{name}")
    return JSONResponse({"name": name, "object": "preset.deleted", "deleted": True})


async def _pin_preset(server: Serving, preset: Preset) -> tuple[int, int]:
    """Prefill the preset's system prompt once on this replica and pin its full blocks (capped at
    ``preset_pin_share`` of the pool); returns (prompt tokens, pinned blocks)."""
    if preset.name in server.preset_pins:
        return server.preset_pins[preset.name]
    ids = await server.prompts.in_thread(conversation.system_prefix_ids, preset.system)
    cap = int(server.settings.preset_pin_share * server.engine.stats().num_blocks)
    pinned = await server.engine.pin_prefix(f"preset:{preset.name}", ids, None, cap) if len(ids) > 1 else 0
    server.preset_pins[preset.name] = (len(ids), pinned)
    logger.info("preset %r: %d tokens, %d blocks pinned (cap %d)", preset.name, len(ids), pinned, cap)
    return len(ids), pinned


async def store_unavailable_handler(request: Request, exc: Exception) -> JSONResponse:
    return APIError(503, f"sessions are unavailable: {exc}", code="session_store_unavailable",
                    headers={"Retry-After": "5"}).response()


routes = [
    Route("/v1/sessions", create_session, methods=["POST"]),
    Route("/v1/sessions", list_sessions, methods=["GET"]),
    Route("/v1/sessions/{session_id}", get_session, methods=["GET"]),
    Route("/v1/sessions/{session_id}", update_session, methods=["PATCH"]),
    Route("/v1/sessions/{session_id}", delete_session, methods=["DELETE"]),
    Route("/v1/sessions/{session_id}/messages", post_message, methods=["POST"]),
    Route("/v1/presets", create_preset, methods=["POST"]),
    Route("/v1/presets", list_presets, methods=["GET"]),
    Route("/v1/presets/{name}", delete_preset, methods=["DELETE"]),
]

OPERATIONS = [
    Operation("/v1/sessions", "POST", "Start a session", CreateSessionRequest),
    Operation("/v1/sessions", "GET", "Sessions, most recently updated first"),
    Operation("/v1/sessions/{session_id}", "GET", "A session's messages and stats"),
    Operation("/v1/sessions/{session_id}", "PATCH", "Rename a session", UpdateSessionRequest),
    Operation("/v1/sessions/{session_id}", "DELETE", "Delete a session"),
    Operation("/v1/sessions/{session_id}/messages", "POST", "Send a message; the reply as chat.completion(.chunk)",
              SessionMessageRequest, streams=True),
    Operation("/v1/presets", "POST", "Create a preset (a shared system prompt, pinned in the KV cache)",
              CreatePresetRequest),
    Operation("/v1/presets", "GET", "Presets"),
    Operation("/v1/presets/{name}", "DELETE", "Delete a preset"),
]
