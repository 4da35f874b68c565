"""POST /v1/sessions/{id}/warm: a client about to send a turn (the chat UI, when its input box gets focus) asks the
engine to start bringing the session's cached KV blocks back to the device from the lower tiers (host, disk,
Redis), so the turn's prompt finds them there instead of waiting for them or computing them again.

The prefix warmed is the session's stored token ids, which the next turn's prompt extends exactly, under the salt
that turn's blocks are keyed by (Admission.cache_salt): nothing is tokenized or rendered here. One warm of a session
runs at a time in a front; another asked meanwhile answers 0 blocks at once."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from app.sessions.service import SessionService
from app.sessions.store import Session
from app.sessions.turn_api import requested_session


async def warm_session(request: Request) -> JSONResponse:
    """The caller's own session only (404 as for GET /v1/sessions/{id}); ``blocks``: how many are on their way."""
    service: SessionService = request.app.state.server.sessions
    session = await requested_session(request, service)
    salt = service.admission.cache_salt(request, session.cache_salt)
    blocks = await warm_prefix(service, session, salt)
    return JSONResponse({"id": session.id, "object": "session.warm", "blocks": blocks})


async def warm_prefix(service: SessionService, session: Session, cache_salt: str | None) -> int:
    if not session.token_ids or session.id in service.warming:
        return 0
    service.warming.add(session.id)
    try:
        return await service.engine.warm_prefix(session.token_ids, cache_salt)
    finally:
        service.warming.discard(session.id)
