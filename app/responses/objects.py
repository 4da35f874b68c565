"""Response objects of the Responses API, built from a reply's parts: the output items (reasoning, the message, each
function call), usage, status, and the request's settings echoed back. A stored response is a session turn; its id
names the session and the turn (ResponseRef), so finding one needs no index of its own."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from app.protocol.responses import FunctionChoice, ResponseRequest

_REF = re.compile(r"^resp_([A-Za-z0-9_-]{22})([0-9a-f]{4,8})$")


@dataclass(frozen=True, slots=True)
class ResponseRef:
    """A stored response: turn ``turn`` (from 1) of session ``session_id``."""

    session_id: str
    turn: int

    @classmethod
    def parse(cls, value: str) -> ResponseRef | None:
        match = _REF.match(value)
        if match is None or int(match[2], 16) < 1:
            return None
        return cls(match[1], int(match[2], 16))

    @property
    def suffix(self) -> str:
        return f"{self.session_id}{self.turn:04x}"

    @property
    def id(self) -> str:
        return f"resp_{self.suffix}"


@dataclass(slots=True)
class ReplyParts:
    """What one reply said and cost. ``calls``: the stored shape (``{"id", "function": {"name", "arguments"}}``)."""

    content: str = ""
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


def request_settings(body: ResponseRequest) -> dict[str, Any]:
    """The request's fields a response object repeats (kept with the turn, for GET)."""
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "name": choice.name}
    return {
        "instructions": body.instructions,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None},
        "store": body.store,
        "user": body.user,
        "text": body.text.echo() if body.text else {"format": {"type": "text"}},
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [text_part(text)],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(suffix: str, parts: ReplyParts) -> list[dict[str, Any]]:
    """Reasoning, then the message (unless the reply is only calls), then each call."""
    status = item_status(parts.finish_reason)
    items = [reasoning_item(f"rs_{suffix}", parts.reasoning, status)] if parts.reasoning else []
    if parts.content or not parts.calls:
        items.append(message_item(f"msg_{suffix}", parts.content, status))
    for number, call in enumerate(parts.calls):
        function = call["function"]
        items.append(
            call_item(
                f"fc_{suffix}_{number}", call["id"], function["name"], function["arguments"], status
            )
        )
    return items


def item_status(finish_reason: str | None) -> str:
    return "completed" if finish_reason in ("stop", "tool_calls") else "incomplete"


def response_status(parts: ReplyParts) -> dict[str, Any]:
    """``status``, ``incomplete_details`` and ``error`` of a finished reply."""
    reason = parts.finish_reason
    if reason == "error":
        error = {"code": "server_error", "message": parts.error or "the request failed"}
        return {"status": "failed", "incomplete_details": None, "error": error}
    if reason == "abort":
        return {"status": "cancelled", "incomplete_details": None, "error": None}
    if reason == "length":
        details = {"reason": "max_output_tokens"}
        return {"status": "incomplete", "incomplete_details": details, "error": None}
    return {"status": "completed", "incomplete_details": None, "error": None}


def usage(parts: ReplyParts) -> dict[str, Any]:
    """OpenAI's usage: the prompt tokens computed now are the ones written to the cache (their full blocks stay
    in the prefix cache); reasoning tokens are not counted apart (0)."""
    written = parts.prompt_tokens - parts.cached_tokens
    return {
        "input_tokens": parts.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": parts.cached_tokens,
            "cache_write_tokens": written,
        },
        "output_tokens": parts.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": parts.prompt_tokens + parts.completion_tokens,
    }


def response_object(
    response_id: str,
    created_at: float,
    model: str,
    settings: dict[str, Any],
    previous_response_id: str | None,
) -> dict[str, Any]:
    """A response in progress: no output yet (``finished`` completes it)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        "previous_response_id": previous_response_id,
        **settings,
        "reasoning": {**settings["reasoning"], "summary": None},
        "truncation": "disabled",
        "usage": None,
    }


def finished(
    response: dict[str, Any], output: list[dict[str, Any]], parts: ReplyParts
) -> dict[str, Any]:
    return {**response, **response_status(parts), "output": output, "usage": usage(parts)}


def stored_response(
    session_messages: list[dict[str, Any]], ref: ResponseRef, model: str
) -> dict[str, Any] | None:
    """Turn ``ref.turn`` of a session as a response object; None if the session has no such turn (yet)."""
    span = _turn_span(session_messages, ref.turn)
    if span is None:
        return None
    start, reply = span
    return _turn_response(session_messages[start:reply], session_messages[reply], ref, model)


def stored_input_items(
    session_messages: list[dict[str, Any]], ref: ResponseRef
) -> list[dict[str, Any]] | None:
    """The input items of turn ``ref.turn`` in order (its instructions are the conversation's, not items); None if
    the session has no such turn."""
    span = _turn_span(session_messages, ref.turn)
    if span is None:
        return None
    items: list[dict[str, Any]] = []
    for number, message in enumerate(session_messages[span[0] : span[1]]):
        items += _input_items(message, f"{ref.suffix}_in{number}")
    return items


def _input_items(message: dict[str, Any], suffix: str) -> list[dict[str, Any]]:
    """A stored message as input items: a tool message is a function_call_output, an assistant message its text
    and each of its calls."""
    role, text = message["role"], message.get("content") or ""
    if role == "tool":
        output = {"type": "function_call_output", "id": f"fco_{suffix}", "output": text}
        return [{**output, "call_id": message["tool_call_id"], "status": "completed"}]
    if role != "assistant":
        content = [{"type": "input_text", "text": text}]
        return [
            {
                "type": "message",
                "id": f"msg_{suffix}",
                "role": role,
                "content": content,
                "status": "completed",
            }
        ]
    items = [message_item(f"msg_{suffix}", text, "completed")] if text else []
    for number, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        items.append(
            call_item(
                f"fc_{suffix}_{number}",
                call["id"],
                function["name"],
                function["arguments"],
                "completed",
            )
        )
    return items


def history_through(
    session_messages: list[dict[str, Any]], turn: int
) -> list[dict[str, Any]] | None:
    """The session's messages up to turn ``turn``'s reply, included; None if it has no such turn."""
    span = _turn_span(session_messages, turn)
    return session_messages[: span[1] + 1] if span is not None else None


def _turn_span(session_messages: list[dict[str, Any]], turn: int) -> tuple[int, int] | None:
    """Where turn ``turn`` (from 1) is: the index of its first input message and of its reply."""
    count, start = 0, 0
    for index, message in enumerate(session_messages):
        if message.get("role") != "assistant" or "usage" not in message:
            continue
        count += 1
        if count == turn:
            return start, index
        start = index + 1
    return None


def _turn_response(
    inputs: list[dict[str, Any]], reply: dict[str, Any], ref: ResponseRef, model: str
) -> dict[str, Any]:
    settings = next(
        (m["response_settings"] for m in reversed(inputs) if "response_settings" in m),
        _DEFAULT_SETTINGS,
    )
    count = reply["usage"]
    parts = ReplyParts(
        content=reply.get("content") or "",
        reasoning=reply.get("reasoning_content") or "",
        calls=reply.get("tool_calls") or [],
        finish_reason=reply.get("finish_reason"),
        prompt_tokens=count["prompt_tokens"],
        completion_tokens=count["completion_tokens"],
        cached_tokens=count["cached_tokens"],
    )
    previous = ResponseRef(ref.session_id, ref.turn - 1).id if ref.turn > 1 else None
    created_at = (
        inputs[-1].get("created_at", reply["created_at"]) if inputs else reply["created_at"]
    )
    response = response_object(ref.id, created_at, model, settings, previous)
    return finished(response, output_items(ref.suffix, parts), parts)


# a turn taken through the sessions API, shown as a response
_DEFAULT_SETTINGS = {
    "instructions": None,
    "tools": [],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "temperature": None,
    "top_p": None,
    "max_output_tokens": None,
    "metadata": {},
    "reasoning": {"effort": None},
    "store": True,
    "user": None,
    "text": {"format": {"type": "text"}},
}
