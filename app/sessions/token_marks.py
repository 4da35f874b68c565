"""Where each stored message ends in the session's token ids: a message's ``token_end`` is the length of the stored
ids up to and including it (the ids as they were when that message was the last one), or None where unknown.

Forks cut the ids at the end of a turn (app/sessions/fork.py) and exports count each message's tokens
(app/sessions/transfer.py), so a mark is kept only while it still holds: a turn whose prompt re-rendered the
conversation (a template that rewrites earlier replies) shares only a common prefix ``L`` with the ids before it,
and marks past ``L`` are forgotten. Sessions stored before marks existed have none: their earlier turns cannot be
forked (never a wrong prefix).

A turn is one user message and every message after it up to the next user message."""

from __future__ import annotations

from typing import Any

from app.sessions.store import TOKEN_END


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share (list comparisons run in C: a bisection of slices)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def marked_turn(
    before: list[dict[str, Any]],
    old_ids: list[int],
    prompt_ids: list[int],
    reply: dict[str, Any],
    completion_len: int,
) -> list[dict[str, Any]]:
    """The messages after a turn: ``before`` (the turn's prompt's messages, the new ones last) with the marks that
    still hold against the new ids ``prompt_ids + completion``, the last of them ending where the prompt ends, then
    ``reply`` ending where the completion ends. ``old_ids``: the ids stored before the turn."""
    kept = common_prefix_len(old_ids, prompt_ids)
    out = []
    for i, message in enumerate(before):
        end = message.get(TOKEN_END)
        if i == len(before) - 1:
            end = len(prompt_ids)
        elif end is not None and end > kept:
            end = None
        out.append({**message, TOKEN_END: end})
    return out + [{**reply, TOKEN_END: len(prompt_ids) + completion_len}]


def turn_starts(messages: list[dict[str, Any]]) -> list[int]:
    """The index of each turn's user message."""
    return [i for i, m in enumerate(messages) if m.get("role") == "user"]


def message_tokens(messages: list[dict[str, Any]]) -> list[int | None]:
    """Each message's share of the stored ids (its end less the previous message's end; the first message's share
    holds the system prompt's tokens too), None where a mark is unknown."""
    shares: list[int | None] = []
    previous: int | None = 0
    for message in messages:
        end = message.get(TOKEN_END)
        shares.append(end - previous if end is not None and previous is not None else None)
        previous = end
    return shares
