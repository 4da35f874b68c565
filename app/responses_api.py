"""OpenAI's Responses API on sessions: POST /v1/responses and GET /v1/responses/{response_id}.

A stored response is a session turn (app/sessions/turn_api.py's start_turn): a response without
``previous_response_id`` starts a session (``instructions`` and any leading system or developer messages become its
system prompt, fixed from then on), one with it takes the next turn of that response's session, whose prompt extends
the stored tokens exactly, so the whole history is a prefix-cache hit (``usage.input_tokens_details.cached_tokens``).
Only the latest response of a conversation can be continued (branching from an older one is not supported yet).
The response id names the session and the turn (app/responses/objects.py), so a GET reads the turn back, and the
session's owner check is the response's: another key's response is not found. ``store: false`` answers as a
stateless chat completion; its id cannot be retrieved."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.errors import APIError
from app.openapi import Operation, QueryParam
from app.protocol.responses import ResponseAsChat, ResponseRequest
from app.request_body import cancel_on_disconnect, read_model
from app.responses import objects
from app.responses.events import ResponseEvents
from app.responses.objects import ReplyParts, ResponseRef
from app.serving import Serving
from app.sessions.presets import check_system
from app.sessions.service import SessionService
from app.sessions.store import Session, SessionStoreUnavailable, new_session_id
from app.sessions.turn_api import busy, own_session, start_turn
from app.sse import sse_response
from app.timed_stream import TimedStream
from engine.output.outputs import RequestOutput


async def create_response(request: Request) -> Response:
    server: Serving = request.app.state.server
    arrival = time.monotonic()
    body = await read_model(request, ResponseRequest, server.max_request_bytes)
    model = server.admission.check_model(body.model)
    settings = objects.request_settings(body)
    if body.store:
        chat = _chat_request(body, body.messages())
        stream, ref, previous = await _stored_turn(request, server.sessions, body, chat, arrival)
        suffix, response_id = ref.suffix, ref.id
    else:
        chat = _chat_request(body, await _stateless_messages(request, server.sessions, body))
        stream = await _stateless(request, server, chat, arrival)
        suffix, previous = secrets.token_hex(16), body.previous_response_id
        response_id = f"resp_{suffix}"
    response = objects.response_object(response_id, time.time(), model, settings, previous)
    events = ResponseEvents(response, suffix)
    if body.stream:
        return sse_response(_stream_events(server, stream, events), named=True)
    finals = await cancel_on_disconnect(request, stream.collect())
    parts = _reply_parts(server, stream, finals[0], finals[0].text)
    return JSONResponse(objects.finished(response, objects.output_items(suffix, parts), parts))


async def get_response(request: Request) -> Response:
    server: Serving = request.app.state.server
    response_id = request.path_params["response_id"]
    ref, session = await _response_session(request, server.sessions, response_id, "response_id")
    found = objects.stored_response(session.messages, ref, server.model_name)
    if found is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(found)


async def list_input_items(request: Request) -> Response:
    """The response's input items, all on one page (a turn has few), newest first unless ``order=asc``."""
    server: Serving = request.app.state.server
    response_id = request.path_params["response_id"]
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError.bad_request("order: must be asc or desc", "order")
    ref, session = await _response_session(request, server.sessions, response_id, "response_id")
    items = objects.stored_input_items(session.messages, ref)
    if items is None:
        raise _not_found(response_id, "response_id")
    data = items if order == "asc" else items[::-1]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )


async def _response_session(
    request: Request, service: SessionService, response_id: str, param: str
) -> tuple[ResponseRef, Session]:
    """The stored response's session, if the request's tenant owns it (else 404 naming ``param``)."""
    ref = ResponseRef.parse(response_id)
    owner = service.admission.tenant(request)
    session = await own_session(service, ref.session_id, owner) if ref is not None else None
    if session is None:
        raise _not_found(response_id, param)
    return ref, session


def _chat_request(body: ResponseRequest, messages: list[dict[str, Any]]) -> ResponseAsChat:
    try:
        return body.chat_request(messages)
    except ValueError as exc:
        raise APIError.from_value_error(exc) from None


# taking the turn --------------------------------------------------------------------------------------


async def _stored_turn(
    request: Request,
    service: SessionService,
    body: ResponseRequest,
    chat: ResponseAsChat,
    arrival: float,
) -> tuple[TimedStream, ResponseRef, str | None]:
    """The response as its session's next turn (a new session without previous_response_id): the stream, the
    response's ref and the previous response's id."""
    setup = service.replies.chat_setup(chat)
    new = [m.as_stored_message() for m in chat.messages]
    if body.previous_response_id is None:
        session, token = await _new_session(request, service, body, new)
        ref, previous = ResponseRef(session.id, 1), None
    else:
        session, token = await _continued_session(request, service, body, new)
        ref, previous = ResponseRef(session.id, _num_turns(session) + 1), body.previous_response_id
    new[-1]["response_settings"] = objects.request_settings(body)
    try:
        stream = await start_turn(request, service, session, new, chat, arrival, token, setup)
    except BaseException:
        if previous is None:  # a refused first response leaves no empty session behind
            with contextlib.suppress(SessionStoreUnavailable):
                await service.store.delete(session.id, session.owner)
        raise
    return stream, ref, previous


async def _new_session(
    request: Request, service: SessionService, body: ResponseRequest, new: list[dict[str, Any]]
) -> tuple[Session, str]:
    """A new session, locked: its system prompt the instructions and the input's leading system messages."""
    system = [body.instructions] if body.instructions is not None else []
    while new and new[0]["role"] == "system":
        system.append(new.pop(0)["content"])
    _check_input(new)
    joined = "\n\n".join(system) if system else None
    if joined is not None:
        await check_system(service, joined, "instructions")
    session = Session(
        id=new_session_id(),
        owner=service.admission.tenant(request),
        system=joined,
        cache_salt=body.cache_salt,
    )
    token = await service.store.create_locked(
        session, service.limits.session_lock_s, service.limits.max_sessions_per_key
    )
    if token is None:  # (a fresh random id is never taken)
        raise busy(session.id)
    return session, token


async def _continued_session(
    request: Request, service: SessionService, body: ResponseRequest, new: list[dict[str, Any]]
) -> tuple[Session, str]:
    """The previous response's session, locked, checked to end with that response. A previous response still
    being written holds the lock: 409, as for a session turn."""
    previous = body.previous_response_id or ""
    ref, session = await _response_session(request, service, previous, "previous_response_id")
    if ref.turn > _num_turns(session) + 1:
        raise _not_found(previous, "previous_response_id")
    token = await service.store.lock(session.id, service.limits.session_lock_s)
    if token is None:
        raise busy(session.id)
    try:  # as stored now, under the lock
        session = await service.store.get(session.id, session.owner) or session
        if ref.turn > _num_turns(session):
            raise _not_found(previous, "previous_response_id")
        _check_continuation(session, ref, body, new)
    except BaseException:
        with contextlib.suppress(SessionStoreUnavailable):
            await service.store.unlock(session.id, token)
        raise
    return session, token


def _check_continuation(
    session: Session, ref: ResponseRef, body: ResponseRequest, new: list[dict[str, Any]]
) -> None:
    latest = _num_turns(session)
    if ref.turn != latest:
        raise APIError.bad_request(
            f"previous_response_id: response {ref.id} is not the latest of its conversation "
            f"(that is {ResponseRef(ref.session_id, latest).id}); continuing an earlier response "
            "(a branch) is kept only with store false",
            "previous_response_id",
        )
    if body.instructions is not None and body.instructions != session.system:
        raise APIError.bad_request(
            "instructions: fixed by the conversation's first response; repeat them or leave "
            "them out",
            "instructions",
        )
    _check_input(new)


def _check_input(new: list[dict[str, Any]]) -> None:
    if any(m["role"] == "system" for m in new):
        raise APIError.bad_request(
            "input: system and developer messages only open a conversation (they join its "
            "instructions), before any other message",
            "input",
        )
    if not new or new[-1]["role"] not in ("user", "tool"):
        raise APIError.bad_request(
            "input: must end with a user message or function_call_output items", "input"
        )


def _num_turns(session: Session) -> int:
    return sum(1 for m in session.messages if m.get("role") == "assistant" and "usage" in m)


async def _stateless_messages(
    request: Request, service: SessionService, body: ResponseRequest
) -> list[dict[str, Any]]:
    """A response not kept: its input after the history up to the previous response, if any (any of its
    conversation's responses: nothing is stored, so this may branch), under the request's instructions or else
    the conversation's."""
    system, history = body.instructions, []
    if body.previous_response_id is not None:
        previous = body.previous_response_id
        ref, session = await _response_session(request, service, previous, "previous_response_id")
        history = objects.history_through(session.messages, ref.turn)
        if history is None:
            raise _not_found(previous, "previous_response_id")
        system = system if system is not None else session.system
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + history + body.messages()


async def _stateless(
    request: Request, server: Serving, chat: ResponseAsChat, arrival: float
) -> TimedStream:
    replies, admission = server.replies, server.admission
    prompt_ids, params, plan = await replies.prepare_chat(chat)
    stream = await admission.submit(
        prompt_ids,
        params,
        admission.cache_salt(request, chat.cache_salt),
        arrival,
        request,
        chat.priority,
    )
    stream.reply_plan = plan
    return stream


# answering --------------------------------------------------------------------------------------------


async def _stream_events(
    server: Serving, stream: TimedStream, events: ResponseEvents
) -> AsyncIterator[dict[str, Any]]:
    for event in events.start():
        yield event
    parser = server.replies.reply_plan(stream).parser(f"{stream.request_id}:0")
    final = None
    async for out in stream:
        for event in events.feed(parser.feed(out.text_delta, final=out.finished)):
            yield event
        if out.finished:
            final = out
    await stream.settled()
    if final is None:
        raise APIError(500, "the reply ended without a final output", code="request_failed")
    for event in events.finish(_reply_parts(server, stream, final, None, parser)):
        yield event


def _reply_parts(
    server: Serving, stream: TimedStream, out: RequestOutput, text: str | None, parser=None
) -> ReplyParts:
    """The reply's parts: ``text`` parsed whole (the same seed as the turn's recorder, so the calls' ids agree), or
    what ``parser`` has read."""
    if parser is None:
        parser = server.replies.reply_plan(stream).parser(f"{stream.request_id}:0")
        parser.feed(text or "", final=True)
    finish = out.finish_reason
    if finish == "stop" and parser.calls and out.stop_reason is None:
        finish = "tool_calls"
    return ReplyParts(
        content=parser.content,
        reasoning=parser.reasoning,
        calls=[call.message_call() for call in parser.calls],
        finish_reason=finish,
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        cached_tokens=out.num_cached_tokens,
        error=out.error,
    )


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        404, f"response {response_id!r} not found", param=param, code="response_not_found"
    )


routes = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
]

OPERATIONS = [
    Operation(
        "/v1/responses",
        "POST",
        "Response (OpenAI's Responses API), kept as a session turn unless store is false",
        ResponseRequest,
        streams=True,
    ),
    Operation(
        "/v1/responses/{response_id}",
        "GET",
        "A stored response (404 for another key's)",
        path_params={"response_id": "the response's id"},
    ),
    Operation(
        "/v1/responses/{response_id}/input_items",
        "GET",
        "A stored response's input items, on one page",
        path_params={"response_id": "the response's id"},
        query=[QueryParam("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"})],
    ),
]
