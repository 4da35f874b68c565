"""POST /v1/sessions/{id}/fork: a new session holding the first N turns of one of the caller's sessions (the chat
UI's edit and branch).

The fork keeps the parent's exact token ids up to the end of turn N (app/sessions/token_marks.py), its system
prompt and its cache salt, so its next turn's prompt extends those ids exactly and hits the parent's KV blocks by
their prefix hashes: a fork costs no prefill. Where the end of turn N is not known (turns stored before marks
existed, re-rendered by the template since, or stored under an earlier system prompt) the fork keeps no ids: its
next turn renders the whole conversation (one prefill, never a wrong prefix)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from app.errors import APIError
from app.protocol.sessions import ForkSessionRequest
from app.request_body import read_model
from app.sessions.service import SessionService
from app.sessions.store import TOKEN_END, Session, new_session_id, public_message
from app.sessions.token_marks import turn_starts
from app.sessions.turn_api import requested_session
from app.sessions.turns import session_stats


def forked(parent: Session, turn: int) -> Session:
    """The parent's first ``turn`` turns as a new session of the same owner (not stored). ValueError naming
    ``turn`` when out of range."""
    starts = turn_starts(parent.messages)
    if not 0 <= turn <= len(starts):
        raise ValueError(
            f"turn: must be an integer in [0, {len(starts)}] (the session's number of turns)"
        )
    if turn == len(starts):
        cut, end = len(parent.messages), len(parent.token_ids)
    else:
        cut = starts[turn]
        end = parent.messages[cut - 1].get(TOKEN_END) if cut else 0
    messages = [dict(m) for m in parent.messages[:cut]]
    if end is None or end > len(parent.token_ids):  # (not known: no ids, nor marks into them)
        messages, end = [public_message(m) for m in messages], 0
    return Session(
        id=new_session_id(),
        owner=parent.owner,
        title=parent.title,
        system=parent.system,
        preset=parent.preset,
        cache_salt=parent.cache_salt,
        created_at=time.time(),
        messages=messages,
        token_ids=parent.token_ids[:end],
        stats=session_stats(messages),
        source=parent.source,
        parent_id=parent.id,
        forked_at_turn=turn,
    )


async def fork_session(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    body = await read_model(request, ForkSessionRequest, service.limits.max_request_bytes)
    parent = await requested_session(request, service)
    try:
        fork = forked(parent, body.turn)
    except ValueError as exc:
        raise APIError.from_value_error(exc) from None
    await create_session_within_quota(service, fork, "turn")
    return JSONResponse(fork.public(), status_code=201)


async def create_session_within_quota(
    service: SessionService, session: Session, param: str
) -> None:
    """Store a new session under the quotas of any new session: its bytes and the key's number of sessions
    (SessionQuotaExceeded: 429)."""
    check_session_bytes(service, session, param)
    if not await service.store.create(session, service.limits.max_sessions_per_key):
        raise APIError(409, "session id collision; retry", code="session_exists")


def check_session_bytes(service: SessionService, session: Session, param: str) -> None:
    size, cap = session.stored_bytes(), service.limits.max_session_bytes
    if size > cap:
        raise APIError(
            400,
            f"{param}: the session would hold {size} bytes, over this server's cap of {cap} "
            "(--max-session-bytes)",
            param=param,
            code="session_full",
        )
