"""One turn of a session: its prompt (an exact token extension of the stored conversation, app/conversation.py),
and storing it once the reply ends — finished, or cut by the client (kept with what was generated, finish_reason
``abort``). The session is locked for the turn, so two turns never interleave."""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from app import conversation
from app.serving import Serving, TimedStream
from app.sessions import Session, SessionStore, SessionStoreUnavailable

logger = logging.getLogger(__name__)

_SAVE_ATTEMPTS = 6  # a turn that ends while Redis is down is retried for ~1 minute before it is given up


@dataclass(slots=True)
class TurnPlan:
    prompt_ids: list[int]
    messages: list[dict[str, Any]]  # the session's messages before the reply (new user input included)


def template_history(session: Session) -> list[dict[str, str]]:
    head = [{"role": "system", "content": session.system}] if session.system is not None else []
    return head + [{"role": m["role"], "content": m["content"]} for m in session.messages]


async def plan_turn(server: Serving, session: Session, new: list[dict[str, Any]]) -> TurnPlan:
    """The prompt for ``new`` messages (ending with a user message) after the session's history."""
    new_template = [{"role": m["role"], "content": m["content"]} for m in new]
    eos = server.engine.config.eos_token_ids
    history = template_history(session)
    try:
        if not session.token_ids:
            ids = await server.prompts.in_thread(conversation.first_turn_ids, session.system, new_template)
        else:
            ids = await server.prompts.in_thread(conversation.next_turn_ids, session.token_ids, history,
                                                 new_template, eos)
    except conversation.NotAnExtension as exc:
        logger.warning("session %s: %s; re-rendering the whole conversation (fewer prefix-cache hits)",
                       session.id, exc)
        ids = await server.prompts.in_thread(conversation.full_render_ids, history + new_template)
    now = time.time()
    return TurnPlan(ids, session.messages + [{**m, "created_at": now} for m in new])


def plan_regeneration(session: Session) -> TurnPlan:
    """Answer the last user message again: the last turn's prompt, exactly as it was."""
    last = session.messages[-1] if session.messages else None
    if last is None or last.get("role") != "assistant" or "usage" not in last:
        raise ValueError("regenerate: the session has no reply to regenerate")
    return TurnPlan(session.token_ids[: last["usage"]["prompt_tokens"]], session.messages[:-1])


@dataclass(slots=True, eq=False)
class TurnRecorder:
    """Stores the turn when the stream ends (TimedStream.on_end), and keeps the session's lock alive meanwhile."""

    store: SessionStore
    session: Session
    plan: TurnPlan
    lock_token: str
    lock_ttl_s: float
    tasks: set[asyncio.Task] = field(default_factory=set)  # the server's background tasks (kept referenced)
    _refresher: asyncio.Task | None = None

    def start(self, stream: TimedStream) -> None:
        stream.on_end = self._ended
        self._refresher = self._spawn(self._keep_lock(weakref.ref(stream)))

    def _ended(self, stream: TimedStream) -> asyncio.Task:
        if self._refresher is not None:
            self._refresher.cancel()
        return self._spawn(self._store(stream))

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _keep_lock(self, stream: weakref.ref[TimedStream]) -> None:
        while True:
            await asyncio.sleep(self.lock_ttl_s / 3)
            if stream() is None:  # dropped unread (client gone before the response started): free the session
                await self.store.unlock(self.session.id, self.lock_token)
                return
            try:
                await self.store.refresh_lock(self.session.id, self.lock_token, self.lock_ttl_s)
            except SessionStoreUnavailable:
                pass  # the save retries; the lock expires by itself if Redis stays away

    async def _store(self, stream: TimedStream) -> None:
        session = self._finished_session(stream)
        try:
            for attempt in range(_SAVE_ATTEMPTS):
                try:
                    if not await self.store.save_turn(session, self.lock_token):
                        logger.warning("session %s was deleted, or its turn outlived its lock; the turn is dropped",
                                       session.id)
                    return
                except SessionStoreUnavailable as exc:
                    logger.warning("session %s: storing the turn failed (%s); retrying", session.id, exc)
                    await asyncio.sleep(2 ** attempt)
            logger.error("session %s: turn lost, the session store stayed unreachable", session.id)
        finally:
            try:
                await self.store.unlock(session.id, self.lock_token)
            except SessionStoreUnavailable:
                pass  # expires by itself

    def _finished_session(self, stream: TimedStream) -> Session:
        out, now = stream.last_output, time.time()
        finished = out is not None and out.finished
        completion = out.token_ids if out is not None else []
        reply = {"role": "assistant", "content": out.text if out is not None else "", "created_at": now,
                 "finish_reason": out.finish_reason if finished else "abort",
                 "usage": {"prompt_tokens": len(self.plan.prompt_ids), "completion_tokens": len(completion),
                           "cached_tokens": out.num_cached_tokens if out is not None else 0},
                 "timing": _timing(stream, len(completion))}
        session = self.session
        session.messages = self.plan.messages + [reply]
        session.token_ids = self.plan.prompt_ids + completion
        if finished and out.block_hashes is not None:
            session.block_hashes = out.block_hashes
        session.stats = _stats(session.messages)
        session.updated_at = now
        return session


def _timing(stream: TimedStream, num_tokens: int) -> dict[str, float | None]:
    first = stream.first_token_time
    if first is None:
        return {"ttft_s": None, "decode_tokens_per_s": None}
    elapsed = (stream.last_token_time or first) - first
    rate = (num_tokens - 1) / elapsed if num_tokens > 1 and elapsed > 0 else None
    return {"ttft_s": round(first - stream.arrival, 4), "decode_tokens_per_s": round(rate, 2) if rate else None}


def _stats(messages: list[dict[str, Any]]) -> dict[str, int]:
    replies = [m for m in messages if m.get("role") == "assistant" and "usage" in m]
    usage = [m["usage"] for m in replies]
    last = usage[-1] if usage else {"prompt_tokens": 0, "completion_tokens": 0}
    return {"num_turns": len(replies), "num_tokens": last["prompt_tokens"] + last["completion_tokens"],
            "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
            "cached_tokens": sum(u["cached_tokens"] for u in usage),
            "completion_tokens": sum(u["completion_tokens"] for u in usage)}
