"""Turns that ended while the session store was unreachable, kept in this process and written when it is back.

A turn is written under the same rule as always (the session still exists, at the revision the turn started
from), so a late write can never overwrite a later turn. The outbox is bounded (turns and bytes): when full, the
oldest turn is dropped with an error in the log. Nothing here survives the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from app.sessions.store import Session, SessionStore, SessionStoreUnavailable

logger = logging.getLogger(__name__)

MAX_TURNS = 1024
MAX_BYTES = 64 * 2**20
RETRY_S = 1.0


@dataclass(slots=True)
class _Pending:
    session: Session  # the whole session after the turn, at the revision the turn started from
    lock_token: str  # released once written (the lock has usually expired by then)
    size: int
    # the flusher and a new turn may both try
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)


class TurnOutbox:
    def __init__(
        self,
        store: SessionStore,
        spawn: Callable[..., asyncio.Task],
        max_turns: int = MAX_TURNS,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self._store = store
        self._spawn = spawn
        self._max_turns = max_turns
        self._max_bytes = max_bytes
        self._pending: OrderedDict[str, _Pending] = OrderedDict()  # session id -> its unsaved turn
        self._bytes = 0
        self._flusher: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pending

    def put(self, session: Session, lock_token: str) -> None:
        self._drop(session.id)
        size = session.stored_bytes()
        self._pending[session.id] = _Pending(session, lock_token, size)
        self._bytes += size
        while len(self._pending) > self._max_turns or (
            self._bytes > self._max_bytes and len(self._pending) > 1
        ):
            lost = next(iter(self._pending))
            self._drop(lost)
            logger.error(
                "session %s: turn lost, the outbox of unsaved turns is full (%d turns)",
                lost,
                self._max_turns,
            )
        if self._flusher is None or self._flusher.done():
            self._flusher = self._spawn(self._flush_until_empty())

    def kept(self, session_id: str, owner: str) -> Session | None:
        """The session as its unsaved turn left it, if it has one and ``owner`` owns it."""
        pending = self._pending.get(session_id)
        return pending.session if pending is not None and pending.session.owner == owner else None

    def stop(self) -> None:
        """No more retries in the background (at shutdown)."""
        if self._flusher is not None:
            self._flusher.cancel()

    async def flush_session(self, session_id: str) -> None:
        """Write this session's unsaved turn now, if it has one (before anything reads or extends the session);
        SessionStoreUnavailable while the store is still away."""
        pending = self._pending.get(session_id)
        if pending is not None:
            await self._write(pending)

    async def flush(self) -> None:
        for pending in list(self._pending.values()):
            await self._write(pending)

    async def _flush_until_empty(self) -> None:
        while self._pending:
            await asyncio.sleep(RETRY_S)
            with contextlib.suppress(SessionStoreUnavailable):
                await self.flush()

    async def _write(self, pending: _Pending) -> None:
        session = pending.session
        async with pending.writing:
            if self._pending.get(session.id) is not pending:
                return  # written (or replaced) meanwhile
            saved = await self._store.save_turn(session)
            self._drop(session.id)
        if saved:
            logger.info(
                "session %s: the turn kept while the session store was away is now stored",
                session.id,
            )
        else:
            logger.warning(
                "session %s changed or was deleted while the store was away; its kept turn is dropped",
                session.id,
            )
        with contextlib.suppress(SessionStoreUnavailable):
            await self._store.unlock(session.id, pending.lock_token)

    def _drop(self, session_id: str) -> None:
        pending = self._pending.pop(session_id, None)
        if pending is not None:
            self._bytes -= pending.size
