"""Taking a turn in a session: POST /v1/sessions/{id}/messages, and /v1/chat/completions with a session id
(chat_in_session). The turn is checked before the session is touched, holds the session's lock, and is planned on
the session as stored, submitted and recorded when its stream ends (run_turn); also finding a tenant's own session,
which every session route does first."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.chat_format.plan import ChatSetup, ToolUse
from app.errors import APIError
from app.protocol.completions import ChatCompletionRequest
from app.protocol.sampling import SamplingFields
from app.protocol.sessions import SessionMessageRequest
from app.request_body import read_model
from app.sessions.earlier_reply import replaced_reply_ids
from app.sessions.presets import check_system
from app.sessions.service import SessionService
from app.sessions.store import Session, SessionStoreUnavailable, is_session_id
from app.sessions.turns import (
    TurnPlan,
    TurnRecorder,
    TurnTemplate,
    plan_regeneration,
    plan_turn,
    rendered_regeneration,
)
from app.timed_stream import TimedStream

_TITLE_CHARS = 60


def not_found(session_id: str) -> APIError:
    return APIError(
        404, f"session {session_id!r} not found", param="session_id", code="session_not_found"
    )


def busy(session_id: str) -> APIError:
    return APIError(
        409,
        f"session {session_id!r} is answering another message; retry when it is done",
        param="session_id",
        code="session_busy",
    )


async def own_session(service: SessionService, session_id: str, owner: str) -> Session | None:
    """The session if ``owner`` owns it (a turn kept while the store was away is written first)."""
    if not is_session_id(session_id):
        return None
    await service.outbox.flush_session(session_id)
    return await service.store.get(session_id, owner)


async def requested_session(request: Request, service: SessionService) -> Session:
    session_id = request.path_params["session_id"]
    session = await own_session(service, session_id, service.admission.tenant(request))
    if session is None:
        raise not_found(session_id)
    return session


async def post_message(request: Request) -> Response:
    service: SessionService = request.app.state.server.sessions
    arrival = time.monotonic()
    body = await read_model(request, SessionMessageRequest, service.limits.max_request_bytes)
    service.admission.check_model(body.model)
    _check_one_reply(body)
    session = await requested_session(request, service)
    token = await _lock(service, session.id)
    new = None if body.regenerate else [{"role": "user", "content": body.content}]
    return await run_turn(request, service, session, new, body, arrival, token)


async def chat_in_session(
    request: Request,
    service: SessionService,
    body: ChatCompletionRequest,
    session_id: str,
    arrival: float,
) -> Response:
    """/v1/chat/completions with ``session_id`` (or X-Session-ID): the request's messages are this turn's new
    messages; the server supplies the history. A well-formed id nobody has starts a new session, atomically: of
    concurrent first turns one creates it, the others find it busy (409)."""
    _check_one_reply(body)
    setup = service.replies.chat_setup(body)
    owner = service.admission.tenant(request)
    new = [m.as_stored_message() for m in body.messages]
    if not is_session_id(session_id):
        raise APIError(
            404,
            f"session {session_id!r} not found: ids are 22 URL-safe characters",
            param="session_id",
            code="session_not_found",
        )
    session = await own_session(service, session_id, owner)
    if session is not None:
        token = await _lock(service, session_id)
        with _unlocked_on_error(service, session_id, token):
            _check_turn_messages(new)
    else:
        system = new.pop(0)["content"] if new[0]["role"] == "system" else None
        _check_turn_messages(new)
        if system is not None:
            await check_system(service, system, "messages")
        session = Session(id=session_id, owner=owner, system=system, cache_salt=body.cache_salt)
        token = await service.store.create_locked(
            session, service.limits.session_lock_s, service.limits.max_sessions_per_key
        )
        # taken meanwhile: by a concurrent first turn of this tenant, or by another tenant
        if token is None:
            raise (
                busy(session_id)
                if await service.store.get(session_id, owner)
                else not_found(session_id)
            )
    return await run_turn(request, service, session, new, body, arrival, token, setup)


def _check_one_reply(body: SamplingFields) -> None:
    """Checked before the session is looked up, locked or created: a refused turn leaves no trace."""
    if body.n != 1:
        raise APIError.bad_request(
            "n: a session turn stores one reply, so n must be 1 (for several choices, ask "
            "/v1/chat/completions without a session)",
            "n",
        )
    if getattr(body, "chat_template_kwargs", None):
        raise APIError.bad_request(
            "chat_template_kwargs: not supported in a session (its turns extend the stored "
            "tokens exactly; the template renders each turn the same way)",
            "chat_template_kwargs",
        )


def _check_turn_messages(new: list[dict[str, Any]]) -> None:
    if any(m["role"] == "system" for m in new):
        raise APIError.bad_request(
            "messages: a session's system prompt is set when the session starts", "messages"
        )
    if not new or new[-1]["role"] not in ("user", "tool"):
        raise APIError.bad_request(
            "messages: must end with the user's new message (or the results of the reply's tool "
            "calls)",
            "messages",
        )


async def _lock(service: SessionService, session_id: str) -> str:
    token = await service.store.lock(session_id, service.limits.session_lock_s)
    if token is None:
        raise busy(session_id)
    return token


@contextlib.asynccontextmanager
async def session_locked(service: SessionService, session_id: str) -> AsyncIterator[None]:
    """The session's turn lock, held by a change that must not meet a turn (409 while one is answered)."""
    token = await _lock(service, session_id)
    try:
        yield
    finally:
        await _unlock_quietly(service, session_id, token)


@contextlib.contextmanager
def _unlocked_on_error(service: SessionService, session_id: str, token: str):
    """Release the turn's lock if the turn does not start (the release runs in the background)."""
    try:
        yield
    except BaseException:
        service.spawn(_unlock_quietly(service, session_id, token))
        raise


async def _unlock_quietly(service: SessionService, session_id: str, token: str) -> None:
    with contextlib.suppress(SessionStoreUnavailable):
        await service.store.unlock(session_id, token)


async def run_turn(
    request: Request,
    service: SessionService,
    session: Session,
    new: list[dict[str, Any]] | None,
    body: SamplingFields,
    arrival: float,
    token: str,
    setup: ChatSetup | None = None,
) -> Response:
    """The turn (start_turn), answered as a chat completion."""
    stream = await start_turn(request, service, session, new, body, arrival, token, setup)
    return await service.replies.answer_chat(
        request, body, stream, headers={"X-Session-ID": session.id}
    )


async def start_turn(
    request: Request,
    service: SessionService,
    session: Session,
    new: list[dict[str, Any]] | None,
    body: SamplingFields,
    arrival: float,
    token: str,
    setup: ChatSetup | None = None,
) -> TimedStream:
    """The turn, holding the session's lock (``token``): planned on the session as stored now, submitted, and
    recorded when its stream ends (the stream carries its reply plan). ``new``: stored-shape messages (None:
    regenerate); ``setup``: a chat request's tools and template variables."""
    setup = setup or ChatSetup(ToolUse(), {})
    try:
        await service.outbox.flush_session(session.id)
        # fresh, under the lock
        session = await service.store.get(session.id, session.owner) or session
        if new is not None:
            _check_size(service, session, new)
        plan = await _plan(
            service,
            session,
            new,
            TurnTemplate(setup.kwargs, setup.instructions, service.replies.chat_format),
        )
        params = service.replies.sampling_params(body, len(plan.prompt_ids))
        if params.speculative:
            params.speculative_context = plan.speculative_context
        params, reply_plan = await service.replies.constrain(params, setup, plan.prompt_ids)
        admission = service.admission
        stream = await admission.submit(
            plan.prompt_ids,
            params,
            admission.cache_salt(request, session.cache_salt),
            arrival,
            request,
            body.priority,
            retain=True,
        )
    except BaseException:
        await _unlock_quietly(service, session.id, token)
        raise
    stream.reply_plan = reply_plan
    if not session.title and new:
        await service.store.set_title(session.id, session.owner, _title(new[-1]["content"]))
    TurnRecorder(service, session, plan, token).start(stream)
    return stream


def _check_size(service: SessionService, session: Session, new: list[dict[str, Any]]) -> None:
    cap = service.limits.max_session_bytes
    size = session.stored_bytes() + sum(len(json.dumps(m, ensure_ascii=False)) for m in new)
    if size > cap:
        raise APIError(
            400,
            f"session_id: the session holds {size} bytes, over this server's cap of {cap} "
            "(--max-session-bytes); start a new session",
            param="session_id",
            code="session_full",
        )


async def _plan(
    service: SessionService,
    session: Session,
    new: list[dict[str, Any]] | None,
    template: TurnTemplate,
) -> TurnPlan:
    if new is not None:
        plan = await plan_turn(service, session, new, template)
        # (the earlier reply feeds n-gram drafts; a draft model, or no speculation, needs no store read)
        if service.engine.info.speculative == "ngram":
            plan.speculative_context = await replaced_reply_ids(service, session)
        return plan
    try:
        plan = plan_regeneration(session)
    except ValueError as exc:
        raise APIError.from_value_error(exc) from None
    if not session.token_ids:  # (reset with a new system prompt)
        return await rendered_regeneration(service, session, plan, template.fmt)
    return plan


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _TITLE_CHARS else line[: _TITLE_CHARS - 1] + "…"
