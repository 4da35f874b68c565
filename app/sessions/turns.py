"""One turn of a session: its prompt (an exact token extension of the stored conversation, conversation.py),
and storing it once the reply ends — finished, cut by the client (kept with what was generated, finish_reason
``abort``) or failed (``error``). The session is locked for the turn, so two turns never interleave.

Storing is retried for ``--session-write-timeout-s``; a turn still unsaved then goes to the outbox (written when
the store is back) and the answer ends normally, saying so in an extension field (``"session_turn": "pending"``,
TimedStream.turn_pending), instead of waiting for the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from app.chat_format.formats import ChatFormat
from app.chat_format.plan import calls_as_text
from app.sessions import conversation
from app.sessions.earlier_reply import last_reply_ids
from app.sessions.service import SessionService
from app.sessions.store import Session, SessionStore, SessionStoreUnavailable
from app.sessions.token_marks import marked_turn
from app.timed_stream import TimedStream

logger = logging.getLogger(__name__)

_FIRST_RETRY_S = 0.1


@dataclass(slots=True)
class TurnPlan:
    prompt_ids: list[int]
    # the session's messages before the reply (new user input included)
    messages: list[dict[str, Any]]
    # the template's variables for this turn (tools, enable_thinking), stored with the reply
    template: dict[str, Any] = field(default_factory=dict)
    # the earlier reply this turn replaces (a regeneration's, a fork's first turn's: earlier_reply.py), for the
    # speculative decoding drafts
    speculative_context: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TurnTemplate:
    """How this turn renders: the template's variables and any tool instructions the system message carries
    (for a template that renders no tools)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    instructions: str | None = None
    # the model's format: calls written as text for a template that knows none (not part of the key)
    fmt: ChatFormat | None = None

    def messages(self, stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Stored messages as this turn's template takes them."""
        out = [template_message(m) for m in stored]
        return calls_as_text(self.fmt, out) if self.fmt is not None else out

    def key(self) -> dict[str, Any]:
        return {**self.kwargs, "instructions": self.instructions} if self else {}

    def __bool__(self) -> bool:
        return bool(self.kwargs or self.instructions)


_TEMPLATE_FIELDS = ("tool_calls", "tool_call_id", "reasoning_content")


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A stored message as the chat template takes it (a call's arguments as a mapping)."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    for name in _TEMPLATE_FIELDS:
        if message.get(name):
            out[name] = message[name]
    if "tool_calls" in out:
        out["tool_calls"] = [_template_call(call) for call in out["tool_calls"]]
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"] or "{}")
    except ValueError:  # (a call cut by max_tokens)
        arguments = {}
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


def template_history(
    session: Session, template: TurnTemplate | None = None
) -> list[dict[str, Any]]:
    system = session.system
    if template is not None and template.instructions:
        system = f"{system}\n\n{template.instructions}" if system else template.instructions
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + (template or TurnTemplate()).messages(session.messages)


async def plan_turn(
    service: SessionService,
    session: Session,
    new: list[dict[str, Any]],
    template: TurnTemplate | None = None,
) -> TurnPlan:
    """The prompt for ``new`` messages (ending with a user or tool message) after the session's history: an exact
    extension of the stored ids where the template allows, else of the last turn's prompt, else a new render."""
    template = template or TurnTemplate()
    new_template = template.messages(new)
    history = template_history(session, template)
    render = service.prompts.in_thread
    kwargs = template.kwargs
    system = history[0]["content"] if history and history[0]["role"] == "system" else None
    last = _last_reply(session)
    same = last is not None and last.get("template", {}) == template.key()
    ids = None
    try:
        if not session.messages:
            ids = await render(conversation.first_turn_ids, system, new_template, **kwargs)
        elif same and session.token_ids:
            eos = service.engine.info.eos_token_ids
            ids = await render(
                conversation.next_turn_ids, session.token_ids, history, new_template, eos, **kwargs
            )
    except conversation.NotAnExtension:
        pass
    # (no stored ids: they were reset with a new system prompt, Session.reset_system)
    if ids is None and same and "usage" in last and session.token_ids:
        prompt = session.token_ids[: last["usage"]["prompt_tokens"]]
        with contextlib.suppress(conversation.NotAnExtension):
            ids = await render(
                conversation.after_last_prompt, prompt, history, new_template, **kwargs
            )
    if ids is None:
        logger.info(
            "session %s: re-rendering the whole conversation (the template or its variables changed)",
            session.id,
        )
        ids = await render(conversation.full_render_ids, history + new_template, **kwargs)
    now = time.time()
    return TurnPlan(ids, session.messages + [{**m, "created_at": now} for m in new], template.key())


def _last_reply(session: Session) -> dict[str, Any] | None:
    for message in reversed(session.messages):
        if message.get("role") == "assistant":
            return message
    return None


def plan_regeneration(session: Session) -> TurnPlan:
    """Answer the last user message again: the last turn's prompt, exactly as it was (no ids when they were
    reset with a new system prompt: ``rendered_regeneration`` then)."""
    last = session.messages[-1] if session.messages else None
    if last is None or last.get("role") != "assistant" or "usage" not in last:
        raise ValueError("regenerate: the session has no reply to regenerate")
    return TurnPlan(
        session.token_ids[: last["usage"]["prompt_tokens"]],
        session.messages[:-1],
        last.get("template", {}),
        last_reply_ids(session),
    )


async def rendered_regeneration(
    service: SessionService, session: Session, plan: TurnPlan, fmt: ChatFormat | None
) -> TurnPlan:
    """``plan`` (a regeneration) with its prompt rendered whole from its messages, as the last turn's template
    variables render them, under the session's system prompt as it is now."""
    key = dict(plan.template)
    template = TurnTemplate(key, key.pop("instructions", None), fmt)
    before = Session(id=session.id, system=session.system, messages=plan.messages)
    history = template_history(before, template)
    ids = await service.prompts.in_thread(conversation.full_render_ids, history, **template.kwargs)
    return TurnPlan(ids, plan.messages, plan.template, plan.speculative_context)


@dataclass(slots=True, eq=False)
class TurnRecorder:
    """Stores the turn when the stream ends (TimedStream.on_end), and keeps the session's lock alive meanwhile."""

    service: SessionService
    session: Session  # as the turn found it (its revision is the one the turn is written over)
    plan: TurnPlan
    lock_token: str
    _refresher: asyncio.Task | None = None

    @property
    def _store(self) -> SessionStore:
        return self.service.store

    def start(self, stream: TimedStream) -> None:
        stream.on_end = self._ended
        self._refresher = self.service.spawn(self._keep_lock(weakref.ref(stream)))

    def _ended(self, stream: TimedStream) -> asyncio.Task:
        if self._refresher is not None:
            self._refresher.cancel()
        task = self.service.spawn(self._save(stream))
        # read by the answer, if it still waits
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _keep_lock(self, stream: weakref.ref[TimedStream]) -> None:
        lock_s = self.service.limits.session_lock_s
        while True:
            await asyncio.sleep(lock_s / 3)
            # dropped unread (client gone before the response started): free the session
            if stream() is None:
                with contextlib.suppress(SessionStoreUnavailable):
                    await self._store.unlock(self.session.id, self.lock_token)
                return
            # the lock expires by itself if Redis stays away
            with contextlib.suppress(SessionStoreUnavailable):
                await self._store.refresh_lock(self.session.id, self.lock_token, lock_s)

    async def _save(self, stream: TimedStream) -> None:
        session = self._finished_session(stream)
        saved = await self._save_within(session, self.service.limits.session_write_timeout_s)
        if saved is None:
            self.service.outbox.put(session, self.lock_token)
            logger.error(
                "session %s: the session store is unreachable; the turn is kept in memory until it is back",
                session.id,
            )
            stream.turn_pending = True
            return
        if not saved:
            logger.warning(
                "session %s was deleted, or changed since this turn began; the turn is dropped",
                session.id,
            )
        with contextlib.suppress(SessionStoreUnavailable, asyncio.TimeoutError):
            await asyncio.wait_for(self._store.unlock(session.id, self.lock_token), 1.0)

    async def _save_within(self, session: Session, timeout_s: float) -> bool | None:
        """save_turn's answer, or None if the store stayed unreachable for ``timeout_s``."""
        deadline, delay = time.monotonic() + timeout_s, _FIRST_RETRY_S
        while True:
            try:
                return await asyncio.wait_for(
                    self._store.save_turn(session), max(deadline - time.monotonic(), 0)
                )
            except (SessionStoreUnavailable, asyncio.TimeoutError) as exc:
                if time.monotonic() + delay >= deadline:
                    return None
                logger.warning(
                    "session %s: storing the turn failed (%s); retrying",
                    session.id,
                    exc or "timeout",
                )
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    def _finished_session(self, stream: TimedStream) -> Session:
        out, now = stream.last_output, time.time()
        finished = out is not None and out.finished
        completion = out.token_ids if out is not None else []
        cut = "error" if stream.failure is not None else "abort"
        parser = self.service.replies.reply_plan(stream).parser(f"{stream.request_id}:0")
        parser.feed(out.text if out is not None else "", final=True)
        reply = {
            "role": "assistant",
            "content": parser.content,
            "created_at": now,
            "finish_reason": out.finish_reason if finished else cut,
            "usage": {
                "prompt_tokens": len(self.plan.prompt_ids),
                "completion_tokens": len(completion),
                "cached_tokens": out.num_cached_tokens if out is not None else 0,
            },
            "timing": _timing(stream, len(completion)),
        }
        if parser.reasoning:
            reply["reasoning_content"] = parser.reasoning
        if parser.calls:
            reply["tool_calls"] = [call.message_call() for call in parser.calls]
            if reply["finish_reason"] == "stop":
                reply["finish_reason"] = "tool_calls"
        if self.plan.template:
            reply["template"] = self.plan.template
        session = self.session
        plan = self.plan
        session.messages = marked_turn(
            plan.messages, session.token_ids, plan.prompt_ids, reply, len(completion)
        )
        session.token_ids = plan.prompt_ids + completion
        if finished and out.block_hashes is not None:
            session.block_hashes = out.block_hashes
        session.stats = session_stats(session.messages)
        session.updated_at = now
        return session


def _timing(stream: TimedStream, num_tokens: int) -> dict[str, float | None]:
    first = stream.first_token_time
    if first is None:
        return {"ttft_s": None, "decode_tokens_per_s": None}
    elapsed = (stream.last_token_time or first) - first
    rate = (num_tokens - 1) / elapsed if num_tokens > 1 and elapsed > 0 else None
    return {
        "ttft_s": round(first - stream.arrival, 4),
        "decode_tokens_per_s": round(rate, 2) if rate else None,
    }


def session_stats(messages: list[dict[str, Any]]) -> dict[str, int]:
    replies = [m for m in messages if m.get("role") == "assistant" and "usage" in m]
    usage = [m["usage"] for m in replies]
    last = usage[-1] if usage else {"prompt_tokens": 0, "completion_tokens": 0}
    return {
        "num_turns": len(replies),
        "num_tokens": last["prompt_tokens"] + last["completion_tokens"],
        "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
        "cached_tokens": sum(u["cached_tokens"] for u in usage),
        "completion_tokens": sum(u["completion_tokens"] for u in usage),
    }
