"""GET /v1/sessions: the caller's sessions a page at a time — pinned ones first, then the most recently updated —
optionally only those of one ``source`` (the chat UI's or an API client's), or only those whose title or any
message contains ``q`` (case-insensitive; newest first, each with a ``snippet`` around its first match).

Written once over the store contract (list summaries, get one session), so it behaves the same in every store.
It reads only the caller's own sessions, at most ``--max-sessions-per-key`` of them; a search reads each candidate's
messages (stopping once a page is full) and matches them on a worker thread, off the event loop."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from app.errors import APIError
from app.sessions.service import SessionService
from app.sessions.store import Session, SessionStore, UnknownCursor, is_session_id

LIST_LIMIT = (1, 1000)
MAX_QUERY_CHARS = 200
SOURCES = ("ui", "api")
_SNIPPET_BEFORE, _SNIPPET_AFTER = 40, 80
_PAGE = 1000  # summaries read from the store at a time


async def list_sessions(request: Request) -> JSONResponse:
    service: SessionService = request.app.state.server.sessions
    limit, after, source, query = _listing_params(request)
    owner = service.admission.tenant(request)
    mine = await all_summaries(service.store, owner, service.limits.max_sessions_per_key)
    if source is not None:
        mine = [s for s in mine if s.source == source]
    if not query:
        mine.sort(key=lambda s: not s.pinned)  # (stable: newest first within each)
    start = _start_after(mine, after)
    if query:
        found, has_more = await search(service.store, mine[start:], query, limit)
    else:
        page = mine[start : start + limit]
        found, has_more = [s.summary() for s in page], start + limit < len(mine)
    return JSONResponse(
        {
            "object": "list",
            "data": found,
            "has_more": has_more,
            "first_id": found[0]["id"] if found else None,
            "last_id": found[-1]["id"] if found else None,
        }
    )


def _listing_params(request: Request) -> tuple[int, str | None, str | None, str]:
    params = request.query_params
    limit, after = params.get("limit", "50"), params.get("after")
    source, query = params.get("source"), params.get("q", "")
    if not limit.isdigit() or not LIST_LIMIT[0] <= int(limit) <= LIST_LIMIT[1]:
        raise APIError.bad_request(
            f"limit: must be an integer in [{LIST_LIMIT[0]}, {LIST_LIMIT[1]}]", "limit"
        )
    if after is not None and not is_session_id(after):
        raise APIError.bad_request(
            "after: must be a session id (the last id of the previous page)", "after"
        )
    if source is not None and source not in SOURCES:
        raise APIError.bad_request(f"source: must be one of {', '.join(SOURCES)}", "source")
    if len(query) > MAX_QUERY_CHARS:
        raise APIError.bad_request(f"q: at most {MAX_QUERY_CHARS} characters", "q")
    return int(limit), after, source, query


def _start_after(sessions: list[Session], after: str | None) -> int:
    if after is None:
        return 0
    for i, session in enumerate(sessions):
        if session.id == after:
            return i + 1
    raise APIError.bad_request(f"after: no session {after!r} in this listing", "after")


async def all_summaries(store: SessionStore, owner: str, max_sessions: int) -> list[Session]:
    """The owner's session summaries, newest first (the store's listing, page after page; at most
    ``max_sessions`` when there is such a cap)."""
    out: list[Session] = []
    after = None
    while True:
        try:
            page = await store.list(owner, _PAGE, after)
        except UnknownCursor:  # (the last one read was deleted meanwhile)
            return out
        out += page.sessions
        if not page.has_more or not page.sessions or (max_sessions and len(out) >= max_sessions):
            return out
        after = page.sessions[-1].id


async def search(
    store: SessionStore, candidates: list[Session], query: str, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """The candidates whose title or a message's content holds ``query``, each summary with its ``snippet``; and
    whether candidates were left unread once ``limit`` were found."""
    pattern = re.compile(re.escape(query), re.IGNORECASE)
    found: list[dict[str, Any]] = []
    for summary in candidates:
        if len(found) == limit:
            return found, True
        snippet = snippet_of(pattern, summary.title)
        if snippet is None:
            session = await store.get(summary.id, summary.owner)
            if session is None:  # deleted meanwhile
                continue
            snippet = await asyncio.to_thread(first_snippet, pattern, session.messages)
        if snippet is not None:
            found.append({**summary.summary(), "snippet": snippet})
    return found, False


def first_snippet(pattern: re.Pattern[str], messages: list[dict[str, Any]]) -> str | None:
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and (snippet := snippet_of(pattern, content)) is not None:
            return snippet
    return None


def snippet_of(pattern: re.Pattern[str], text: str) -> str | None:
    """A short stretch of ``text`` around the first match, on one line ("…" where cut); None without a match."""
    match = pattern.search(text)
    if match is None:
        return None
    start = max(match.start() - _SNIPPET_BEFORE, 0)
    end = min(match.end() + _SNIPPET_AFTER, len(text))
    line = " ".join(text[start:end].split())
    return ("…" if start else "") + line + ("…" if end < len(text) else "")
