"""The earlier reply a turn replaces, as token ids, for speculative decoding: the new reply is likely to repeat it
in part, so the engine's n-gram drafts may come from it too (SamplingParams.speculative_context).

A regeneration (``"regenerate": true``) replaces the session's last reply (turns.plan_regeneration); the first turn
of a fork (the chat UI's edit and its regenerate: a fork before the turn, then the turn's user message, edited or
not) replaces the reply its parent gave at that turn. The ids are read at the token marks (token_marks.py); where a
mark is not known there is no earlier reply, only drafts from the request's own tokens."""

from __future__ import annotations

import contextlib

from app.sessions.service import SessionService
from app.sessions.store import TOKEN_END, Session, SessionStoreUnavailable
from app.sessions.token_marks import turn_starts
from engine.sampling_params import MAX_SPECULATIVE_CONTEXT


def turn_reply_ids(session: Session, turn: int) -> list[int]:
    """The ids after turn ``turn``'s prompt up to the end of the turn (its replies, and any tool results between
    them), at most MAX_SPECULATIVE_CONTEXT of them (the head: where a new reply starts); [] where unknown."""
    starts = turn_starts(session.messages)
    if not 0 <= turn < len(starts):
        return []
    last = starts[turn + 1] - 1 if turn + 1 < len(starts) else len(session.messages) - 1
    begin = session.messages[starts[turn]].get(TOKEN_END)
    end = session.messages[last].get(TOKEN_END)
    if begin is None or end is None or not begin < end <= len(session.token_ids):
        return []
    return session.token_ids[begin : min(end, begin + MAX_SPECULATIVE_CONTEXT)]


def last_reply_ids(session: Session) -> list[int]:
    """The ids of the session's last reply (its last message, an assistant's, with its usage), as a
    regeneration replaces it; [] where the stored ids no longer hold it."""
    usage = session.messages[-1].get("usage") if session.messages else None
    if (
        usage is None
        or len(session.token_ids) < usage["prompt_tokens"] + usage["completion_tokens"]
    ):
        return []
    begin = usage["prompt_tokens"]
    return session.token_ids[
        begin : begin + min(usage["completion_tokens"], MAX_SPECULATIVE_CONTEXT)
    ]


async def replaced_reply_ids(service: SessionService, session: Session) -> list[int]:
    """For a fork's first turn, the reply its parent gave at the fork's turn (read from the store); else []."""
    if session.parent_id is None or session.forked_at_turn != len(turn_starts(session.messages)):
        return []
    parent = None
    with contextlib.suppress(SessionStoreUnavailable):  # (drafts without it: the turn goes on)
        parent = await service.store.get(session.parent_id, session.owner)
    return turn_reply_ids(parent, session.forked_at_turn) if parent is not None else []
