"""Sessions and presets in a SQLite file (the standard library's ``sqlite3``): the durable default of a server
without Redis, so chats survive a restart. Same rules as the other stores (app/sessions/store.py).

Every call runs on one worker thread that owns the connection, so the event loop never waits on the disk. Each
multi-step change (create with the owner's quota, a turn against its revision, a lock) is one ``BEGIN IMMEDIATE``
transaction, and expiry times are wall-clock seconds: several front processes of one server
(``--api-server-count``) may share the file (WAL mode). Expired sessions and locks are treated as absent at once
and deleted by the next write that meets them.

The file is created private, refused at start when corrupt, and watched while serving (deleted, replaced, the disk
full): app/sessions/sqlite_file.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from app.sessions.sqlite_file import FileWatch, create_private, is_file_fault, open_database
from app.sessions.store import (
    JSON_FIELDS,
    Preset,
    Session,
    SessionPage,
    SessionQuotaExceeded,
    SessionStoreUnavailable,
    UnknownCursor,
    sorted_presets,
    visible_preset,
)

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT NOT NULL, system TEXT, preset TEXT, cache_salt TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, revision TEXT NOT NULL, num_messages INTEGER NOT NULL,
    messages TEXT NOT NULL, token_ids TEXT NOT NULL, block_hashes TEXT NOT NULL, stats TEXT NOT NULL,
    expires_at REAL NOT NULL, source TEXT NOT NULL DEFAULT 'api', pinned INTEGER NOT NULL DEFAULT 0,
    parent_id TEXT, forked_at_turn INTEGER);
CREATE INDEX IF NOT EXISTS sessions_by_owner ON sessions (owner, updated_at DESC, id DESC);
CREATE TABLE IF NOT EXISTS locks (session_id TEXT PRIMARY KEY, token TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS presets (
    key TEXT PRIMARY KEY, name TEXT NOT NULL, system TEXT NOT NULL, owner TEXT NOT NULL, created_at REAL NOT NULL);
"""
# added after the first files were written: a file without them gets them at open (ALTER TABLE)
_LATER_COLUMNS = {
    "source": "TEXT NOT NULL DEFAULT 'api'",
    "pinned": "INTEGER NOT NULL DEFAULT 0",
    "parent_id": "TEXT",
    "forked_at_turn": "INTEGER",
}
_COLUMNS = (
    "id",
    "owner",
    "title",
    "system",
    "preset",
    "cache_salt",
    "created_at",
    "updated_at",
    "revision",
    "num_messages",
    *JSON_FIELDS,
    *_LATER_COLUMNS,
)
_SUMMARY = "id, owner, title, preset, created_at, updated_at, num_messages, " + ", ".join(
    _LATER_COLUMNS
)


class SQLiteSessionStore:
    durable = True
    kind = "sqlite"

    def __init__(self, path: str | Path, ttl_s: float) -> None:
        self.path = Path(path)
        self._ttl_s = ttl_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedchat-sqlite")
        self._db: sqlite3.Connection | None = None
        self._watch = FileWatch(self.path)

    # plumbing ----------------------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, fn, args)

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        try:
            db = self._connection()
            if gone := self._watch.gone():
                raise SessionStoreUnavailable(gone)
            changes = db.total_changes
            result = fn(db, *args)
        # a locked or unreadable file: the store is away
        except (sqlite3.DatabaseError, OSError) as exc:
            if not isinstance(exc, (sqlite3.OperationalError, OSError)) and not is_file_fault(exc):
                raise  # (a bug of ours: a constraint, a statement)
            if is_file_fault(exc):
                self._watch.write_failed(exc)
            raise SessionStoreUnavailable(
                f"the session database {self.path} cannot be used: {exc}"
            ) from exc
        if db.total_changes != changes:
            self._watch.wrote()
        return result

    def _connection(self) -> sqlite3.Connection:
        """The open database; opened again when another file has taken its path (restored from a backup)."""
        if self._db is not None and self._watch.replaced():
            self._db.close()
            self._db = None
        if self._db is None:
            self._db = self._open()
            self._watch.opened_now()
        return self._db

    def _open(self) -> sqlite3.Connection:
        create_private(self.path)
        return open_database(self.path, self._prepare)

    @staticmethod
    def _prepare(db: sqlite3.Connection) -> None:
        db.execute("PRAGMA journal_mode=WAL")
        # with WAL: a power cut may lose the last turns, never corrupt
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        have = {row[1] for row in db.execute("PRAGMA table_info(sessions)")}
        for name, kind in _LATER_COLUMNS.items():
            if name not in have:
                # (another front may have added it first)
                with contextlib.suppress(sqlite3.OperationalError):
                    db.execute(f"ALTER TABLE sessions ADD COLUMN {name} {kind}")

    @staticmethod
    def _transaction(db: sqlite3.Connection, fn: Callable[[], T]) -> T:
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn()
        except BaseException:
            if db.in_transaction:  # (SQLite has rolled back itself after some errors: a full disk)
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    async def ping(self) -> None:
        """SessionStoreUnavailable when the file cannot be read, or has a problem (deleted, disk full, the last
        write failed): /health says so."""

        def ping(db: sqlite3.Connection) -> None:
            db.execute("SELECT 1").fetchone()
            if problem := self._watch.problem():
                raise SessionStoreUnavailable(problem)

        await self._run(ping)

    async def close(self) -> None:
        def close() -> None:  # (on the connection's thread; also once its file is gone)
            if self._db is not None:
                self._db.close()
                self._db = None

        await asyncio.get_running_loop().run_in_executor(self._executor, close)
        self._executor.shutdown(wait=False)

    # sessions ----------------------------------------------------------------------------------------

    async def create(self, session: Session, max_sessions: int = 0) -> bool:
        return await self._run(self._create, session, max_sessions, None) is not None

    async def create_locked(
        self, session: Session, lock_ttl_s: float, max_sessions: int = 0
    ) -> str | None:
        return await self._run(self._create, session, max_sessions, lock_ttl_s)

    def _create(
        self, db: sqlite3.Connection, session: Session, max_sessions: int, lock_ttl_s: float | None
    ) -> str | None:
        def create() -> str | None:
            now = time.time()
            db.execute("DELETE FROM sessions WHERE id = ? AND expires_at <= ?", (session.id, now))
            if db.execute("SELECT 1 FROM sessions WHERE id = ?", (session.id,)).fetchone():
                return None
            if max_sessions:
                (count,) = db.execute(
                    "SELECT COUNT(*) FROM sessions WHERE owner = ? AND expires_at > ?",
                    (session.owner, now),
                ).fetchone()
                if count >= max_sessions:
                    raise SessionQuotaExceeded(f"this API key already has {max_sessions} sessions")
            db.execute(
                f"INSERT INTO sessions ({', '.join(_COLUMNS)}, expires_at) "
                f"VALUES ({', '.join('?' * (len(_COLUMNS) + 1))})",
                (*_row(session), now + self._ttl_s),
            )
            if lock_ttl_s is None:
                return ""
            token = secrets.token_hex(8)
            db.execute(
                "INSERT OR REPLACE INTO locks VALUES (?, ?, ?)",
                (session.id, token, now + lock_ttl_s),
            )
            return token

        return self._transaction(db, create)

    async def get(self, session_id: str, owner: str) -> Session | None:
        return await self._run(self._get, session_id, owner)

    def _get(self, db: sqlite3.Connection, session_id: str, owner: str) -> Session | None:
        now = time.time()
        row = db.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM sessions WHERE id = ? AND owner = ? AND "
            "expires_at > ?",
            (session_id, owner, now),
        ).fetchone()
        if row is None:
            return None
        # on use
        db.execute(
            "UPDATE sessions SET expires_at = ? WHERE id = ?", (now + self._ttl_s, session_id)
        )
        return _session(row)

    async def list(self, owner: str, limit: int, after: str | None = None) -> SessionPage:
        return await self._run(self._list, owner, limit, after)

    def _list(
        self, db: sqlite3.Connection, owner: str, limit: int, after: str | None
    ) -> SessionPage:
        now = time.time()
        where, args = "owner = ? AND expires_at > ?", [owner, now]
        if after is not None:
            cursor = db.execute(
                "SELECT updated_at, id FROM sessions WHERE id = ? AND owner = ? AND expires_at > ?",
                (after, owner, now),
            ).fetchone()
            if cursor is None:
                raise UnknownCursor(f"after: no session {after!r} in this listing")
            where += " AND (updated_at < ? OR (updated_at = ? AND id < ?))"
            args += [cursor[0], cursor[0], cursor[1]]
        rows = db.execute(
            f"SELECT {_SUMMARY} FROM sessions WHERE {where} ORDER BY updated_at DESC, id DESC "
            "LIMIT ?",
            (*args, limit + 1),
        ).fetchall()
        summaries = []
        for row in rows[:limit]:
            summary = _session(row, _SUMMARY.split(", "))
            summary.messages = [{}] * row[6]  # the summary only counts them
            summaries.append(summary)
        return SessionPage(summaries, len(rows) > limit)

    async def set_title(self, session_id: str, owner: str, title: str) -> bool:
        return await self._set(session_id, owner, "title", title)

    async def set_pinned(self, session_id: str, owner: str, pinned: bool) -> bool:
        return await self._set(session_id, owner, "pinned", int(pinned))

    async def _set(self, session_id: str, owner: str, column: str, value: str | int) -> bool:
        return await self._run(
            lambda db: (
                db.execute(
                    f"UPDATE sessions SET {column} = ? WHERE id = ? AND owner = ? AND expires_at > ?",
                    (value, session_id, owner, time.time()),
                ).rowcount
                > 0
            )
        )

    async def delete(self, session_id: str, owner: str) -> bool:
        return await self._run(
            lambda db: (
                db.execute(
                    "DELETE FROM sessions WHERE id = ? AND owner = ? AND expires_at > ?",
                    (session_id, owner, time.time()),
                ).rowcount
                > 0
            )
        )

    async def save_turn(self, session: Session) -> bool:
        return await self._run(self._save_turn, session)

    def _save_turn(self, db: sqlite3.Connection, session: Session) -> bool:
        def save() -> bool:
            now = time.time()
            if (
                db.execute(
                    "SELECT 1 FROM sessions WHERE id = ? AND revision = ? AND expires_at > ?",
                    (session.id, session.revision, now),
                ).fetchone()
                is None
            ):
                # deleted (perhaps taken again) or a later turn was stored: nothing is written
                return False
            revision = secrets.token_hex(8)
            row = dict(zip(_COLUMNS, _row(session)))
            row["revision"] = revision
            # a rename (or pin) during the turn wins over the turn's stale copy
            del row["id"], row["title"], row["pinned"]
            db.execute(
                f"UPDATE sessions SET {', '.join(f'{k} = ?' for k in row)}, expires_at = ? WHERE id = ?",
                (*row.values(), now + self._ttl_s, session.id),
            )
            session.revision = revision
            return True

        return self._transaction(db, save)

    async def set_system(self, session: Session) -> bool:
        return await self.save_turn(
            session
        )  # (every column but the title and pin: the system prompt too)

    # locks -------------------------------------------------------------------------------------------

    async def lock(self, session_id: str, ttl_s: float) -> str | None:
        def lock(db: sqlite3.Connection) -> str | None:
            now, token = time.time(), secrets.token_hex(8)
            taken = db.execute(
                "INSERT INTO locks VALUES (?, ?, ?) ON CONFLICT (session_id) DO UPDATE SET "
                "token = excluded.token, expires_at = excluded.expires_at "
                "WHERE locks.expires_at <= ?",
                (session_id, token, now + ttl_s, now),
            ).rowcount
            return token if taken else None

        return await self._run(lock)

    async def refresh_lock(self, session_id: str, token: str, ttl_s: float) -> bool:
        return await self._run(
            lambda db: (
                db.execute(
                    "UPDATE locks SET expires_at = ? WHERE session_id = ? AND token = ? AND expires_at > ?",
                    (time.time() + ttl_s, session_id, token, time.time()),
                ).rowcount
                > 0
            )
        )

    async def unlock(self, session_id: str, token: str) -> None:
        await self._run(
            lambda db: db.execute(
                "DELETE FROM locks WHERE session_id = ? AND token = ?", (session_id, token)
            )
        )

    # presets -----------------------------------------------------------------------------------------

    async def save_preset(self, preset: Preset) -> bool:
        return await self._run(
            lambda db: (
                db.execute(
                    "INSERT OR IGNORE INTO presets VALUES (?, ?, ?, ?, ?)",
                    (preset.key, preset.name, preset.system, preset.owner, preset.created_at),
                ).rowcount
                > 0
            )
        )

    async def get_preset(self, name: str, owner: str) -> Preset | None:
        def get(db: sqlite3.Connection) -> Preset | None:
            rows = db.execute(
                "SELECT name, system, owner, created_at FROM presets WHERE name = ? AND owner IN "
                "('', ?)",
                (name, owner),
            ).fetchall()
            return visible_preset({p.key: p for p in (Preset(*row) for row in rows)}, name, owner)

        return await self._run(get)

    async def list_presets(self, owner: str | None) -> list[Preset]:
        rows = await self._run(
            lambda db: db.execute("SELECT name, system, owner, created_at FROM presets").fetchall()
        )
        return sorted_presets([Preset(*row) for row in rows], owner)

    async def delete_preset(self, preset: Preset) -> bool:
        return await self._run(
            lambda db: db.execute("DELETE FROM presets WHERE key = ?", (preset.key,)).rowcount > 0
        )


def _row(session: Session) -> tuple:
    return (
        session.id,
        session.owner,
        session.title,
        session.system,
        session.preset,
        session.cache_salt,
        session.created_at,
        session.updated_at,
        session.revision,
        len(session.messages),
        *(json.dumps(getattr(session, k)) for k in JSON_FIELDS),
        *(getattr(session, k) for k in _LATER_COLUMNS),
    )


def _session(row: tuple, columns: tuple[str, ...] | list[str] = _COLUMNS) -> Session:
    fields = dict(zip(columns, row))
    del fields["num_messages"]
    for key in JSON_FIELDS:
        if key in fields:
            fields[key] = json.loads(fields[key])
    fields["pinned"] = bool(fields["pinned"])
    return Session(**fields)
