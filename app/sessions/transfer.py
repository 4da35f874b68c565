"""A session out and in: GET /v1/sessions/{id}/export (JSON with each message's token count, or a Markdown
transcript) and POST /v1/sessions/import (that JSON back as a new session of the caller).

An imported session's token ids are built turn by turn exactly as its turns would have been (plan_turn), each
reply as the model would have stored it (its text's tokens and an end-of-sequence token), so the next turn after
an import extends them exactly and its turns can be forked."""

from __future__ import annotations

import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.errors import APIError
from app.protocol.sessions import ImportSessionRequest
from app.request_body import read_model
from app.sessions import conversation
from app.sessions.fork import check_session_bytes, create_session_within_quota
from app.sessions.presets import check_system
from app.sessions.service import SessionService
from app.sessions.store import Session, new_session_id
from app.sessions.token_marks import marked_turn, message_tokens
from app.sessions.turn_api import requested_session
from app.sessions.turns import plan_turn, session_stats

EXPORT_VERSION = 1
FORMATS = ("json", "markdown")
_KEPT_FIELDS = ("tool_calls", "tool_call_id", "reasoning_content")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


async def export_session(request: Request) -> Response:
    service: SessionService = request.app.state.server.sessions
    kind = request.query_params.get("format", "json")
    if kind not in FORMATS:
        raise APIError.bad_request(f"format: must be one of {', '.join(FORMATS)}", "format")
    session = await requested_session(request, service)
    exported = exported_session(session, service.admission.model_name)
    name = file_name(session)
    if kind == "markdown":
        return Response(
            markdown_transcript(exported),
            media_type="text/markdown; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{name}.md"'},
        )
    return JSONResponse(
        exported, headers={"Content-Disposition": f'attachment; filename="{name}.json"'}
    )


def exported_session(session: Session, model: str) -> dict[str, Any]:
    messages = []
    for message, tokens in zip(session.messages, message_tokens(session.messages)):
        out = {"role": message["role"], "content": message.get("content"), "tokens": tokens}
        out.update({k: message[k] for k in _KEPT_FIELDS if message.get(k)})
        messages.append(out)
    return {
        "object": "session.export",
        "version": EXPORT_VERSION,
        "title": session.title,
        "model": model,
        "source": session.source,
        "created_at": session.created_at,
        "system": session.system,
        "messages": messages,
    }


def file_name(session: Session) -> str:
    """Letters, digits, '.', '_' and '-' only (the title's, else the id's)."""
    name = _UNSAFE.sub("-", session.title).strip("-.")[:60]
    return name or f"session-{session.id}"


def markdown_transcript(exported: dict[str, Any]) -> str:
    parts = [f"# {exported['title'] or 'Chat'}", f"Model: {exported['model']}"]
    if exported["system"]:
        parts += ["## System", exported["system"]]
    for message in exported["messages"]:
        parts.append(f"## {message['role'].capitalize()}")
        if message.get("reasoning_content"):
            parts.append(
                f"<details><summary>Reasoning</summary>\n\n{message['reasoning_content']}\n\n"
                "</details>"
            )
        if message.get("content"):
            parts.append(message["content"])
        for call in message.get("tool_calls", []):
            function = call["function"]
            parts.append(
                f"Tool call `{function['name']}`:\n\n```json\n{function['arguments']}\n```"
            )
    return "\n\n".join(parts) + "\n"


async def import_session(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    body = await read_model(request, ImportSessionRequest, service.limits.max_request_bytes)
    if body.system is not None:
        await check_system(service, body.system, "system")
    session = Session(
        id=new_session_id(),
        owner=service.admission.tenant(request),
        title=body.title or "",
        system=body.system,
        source=body.source,
    )
    messages = [m.stored() for m in body.messages]
    session.messages = messages  # (the byte quota first, before any rendering)
    check_session_bytes(service, session, "messages")
    session.messages = []
    await replay(service, session, messages)
    await create_session_within_quota(service, session, "messages")
    return JSONResponse(session.public(), status_code=201)


async def replay(service: SessionService, session: Session, messages: list[dict[str, Any]]) -> None:
    """``messages`` into ``session``, turn by turn, with the token ids its turns would have stored."""
    eos = service.engine.info.eos_token_ids[:1]
    now, pending = time.time(), []
    for message in messages:
        message["created_at"] = now
        if message["role"] != "assistant":
            pending.append(message)
            continue
        plan = await plan_turn(service, session, pending)
        text = message.get("content") or ""
        completion = await service.prompts.in_thread(conversation.encode, text) + list(eos)
        usage = {
            "prompt_tokens": len(plan.prompt_ids),
            "completion_tokens": len(completion),
            "cached_tokens": 0,
        }
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        reply = {**message, "finish_reason": finish, "usage": usage}
        session.messages = marked_turn(
            plan.messages, session.token_ids, plan.prompt_ids, reply, len(completion)
        )
        session.token_ids = plan.prompt_ids + completion
        pending = []
        if len(session.token_ids) > service.max_model_len:  # (also bounds the rendering work)
            raise APIError.bad_request(
                f"messages: over the model's context of {service.max_model_len} tokens",
                "messages",
            )
    session.stats = session_stats(session.messages)
