"""Session stores: a session's messages and the exact token ids (prompt + completion) of its conversation so far,
with the hashes of their full KV blocks; and named presets (system prompts, each owned by a tenant or shared).

``RedisSessionStore`` (app/sessions/redis_store.py) when a Redis URL is configured (several replicas);
``SQLiteSessionStore`` (app/sessions/sqlite_store.py), a file under the cache dir, as the durable default of one
server; ``InMemorySessionStore`` here when asked for (lost on restart). All keep the same rules:

- a session belongs to one owner (a tenant: a hash of its API key, "" without keys); any other owner gets None,
  exactly as for an id that does not exist;
- creation is atomic: an id already taken is refused (False / None), never overwritten, and a tenant at its
  ``max_sessions`` quota gets SessionQuotaExceeded;
- a turn is written whole, only if the session still exists and still has the ``revision`` the turn started from
  (so a turn finishing after a delete, even one after which the id was taken again, stores nothing, and a stale
  turn cannot overwrite a later one);
- a new system prompt (``set_system``) is written with the token ids rendered under the old one reset
  (Session.reset_system), under the same revision check as a turn, and gives a new revision (so a turn that began
  before it stores nothing);
- listing reads summaries only (never whole histories), newest first, a page at a time.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{22}$")  # 16 random bytes, URL-safe base64 without padding
_PRESET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
JSON_FIELDS = ("messages", "token_ids", "block_hashes", "stats")


class SessionStoreUnavailable(RuntimeError):
    """The store cannot be reached now (Redis down); session routes answer 503 until it is back."""


class SessionQuotaExceeded(RuntimeError):
    """The tenant already has ``max_sessions`` sessions."""


class UnknownCursor(ValueError):
    """A listing's ``after`` names no session of this owner."""


def new_session_id() -> str:
    return secrets.token_urlsafe(16)


def is_session_id(value: str) -> bool:
    return bool(_SESSION_ID.match(value))


def is_preset_name(value: str) -> bool:
    return bool(_PRESET_NAME.match(value))


@dataclass(slots=True)
class Session:
    id: str
    owner: str = ""  # the tenant (a hash of its API key) or "" without keys
    title: str = ""
    system: str | None = None
    preset: str | None = None
    cache_salt: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = 0.0
    revision: str = field(default_factory=lambda: secrets.token_hex(8))  # new on every stored turn
    messages: list[dict[str, Any]] = field(default_factory=list)
    # prompt + completion of the last turn, exactly
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    source: str = "api"  # who started it: "ui" (the chat UI) or "api"
    pinned: bool = False
    parent_id: str | None = None  # a fork's parent (app/sessions/fork.py)
    forked_at_turn: int | None = None

    def __post_init__(self) -> None:
        self.updated_at = self.updated_at or self.created_at

    def reset_system(self, system: str | None) -> None:
        """A new system prompt (None: none), in place of the preset's. Where its text changed, the stored ids were
        rendered with the old one: they go, with their block hashes and every message's mark into them (the next
        turn renders the whole conversation again)."""
        if system != self.system:
            self.token_ids, self.block_hashes = [], []
            self.messages = [public_message(m) for m in self.messages]
        self.system, self.preset = system, None

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "session",
            "title": self.title,
            "preset": self.preset,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "num_messages": len(self.messages),
            "source": self.source,
            "pinned": self.pinned,
            "parent_id": self.parent_id,
            "forked_at_turn": self.forked_at_turn,
        }

    def public(self) -> dict[str, Any]:
        return {
            **self.summary(),
            "system": self.system,
            "messages": [public_message(m) for m in self.messages],
            "stats": self.stats,
        }

    def stored_bytes(self) -> int:
        """About what the session takes in the store (its JSON fields and system prompt), for the size cap."""
        return (
            sum(len(json.dumps(getattr(self, k), ensure_ascii=False)) for k in JSON_FIELDS)
            + len((self.system or "").encode())
            + len(self.title.encode())
        )


# a message's private field: the length of the stored token ids at its end, where known (app/sessions/token_marks.py)
TOKEN_END = "token_end"


def public_message(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != TOKEN_END} if TOKEN_END in message else message


@dataclass(slots=True)
class Preset:
    name: str
    system: str
    # the tenant that made it; "" = shared (made by the admin key, or a server without keys)
    owner: str = ""
    created_at: float = field(default_factory=time.time)

    @property
    def key(self) -> str:
        """Unique among all presets: a tenant's own preset may have the name of another tenant's."""
        return f"{self.owner}/{self.name}" if self.owner else self.name

    @property
    def shared(self) -> bool:
        return not self.owner

    def public(
        self, num_tokens: int | None = None, pinned_blocks: int | None = None
    ) -> dict[str, Any]:
        return {
            "name": self.name,
            "object": "preset",
            "system": self.system,
            "created_at": self.created_at,
            "shared": self.shared,
            "num_tokens": num_tokens,
            "pinned_blocks": pinned_blocks,
        }


@dataclass(slots=True)
class SessionPage:
    # summaries: ``messages`` holds only as many empty dicts as the session has messages
    sessions: list[Session]
    has_more: bool


class SessionStore(Protocol):
    durable: bool  # survives a server restart
    kind: str  # redis | sqlite | memory (/health says it)

    async def ping(self) -> None: ...
    async def close(self) -> None: ...
    async def create(self, session: Session, max_sessions: int = 0) -> bool: ...
    async def create_locked(
        self, session: Session, lock_ttl_s: float, max_sessions: int = 0
    ) -> str | None: ...
    async def get(self, session_id: str, owner: str) -> Session | None: ...
    async def list(self, owner: str, limit: int, after: str | None = None) -> SessionPage: ...
    async def set_title(self, session_id: str, owner: str, title: str) -> bool: ...
    async def set_pinned(self, session_id: str, owner: str, pinned: bool) -> bool: ...
    async def delete(self, session_id: str, owner: str) -> bool: ...
    async def save_turn(self, session: Session) -> bool: ...
    async def set_system(self, session: Session) -> bool: ...
    async def lock(self, session_id: str, ttl_s: float) -> str | None: ...
    async def refresh_lock(self, session_id: str, token: str, ttl_s: float) -> bool: ...
    async def unlock(self, session_id: str, token: str) -> None: ...
    async def save_preset(self, preset: Preset) -> bool: ...
    async def get_preset(self, name: str, owner: str) -> Preset | None: ...
    async def list_presets(self, owner: str | None) -> list[Preset]: ...
    async def delete_preset(self, preset: Preset) -> bool: ...


def visible_preset(candidates: dict[str, Preset], name: str, owner: str) -> Preset | None:
    """The tenant's own preset of that name, else the shared one (``candidates`` maps Preset.key)."""
    own = candidates.get(Preset(name, "", owner).key) if owner else None
    return own or candidates.get(name)


def sorted_presets(presets: list[Preset], owner: str | None) -> list[Preset]:
    """What ``owner`` may see (its own and the shared ones; None: all), by name."""
    seen = [p for p in presets if owner is None or p.owner in ("", owner)]
    return sorted(seen, key=lambda p: (p.name, p.owner))


class InMemorySessionStore:
    """Everything in this process, gone on restart (tests, and ``--session-store memory``)."""

    durable = False
    kind = "memory"

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._sessions: dict[str, tuple[Session, float]] = {}  # id -> (session, expires at)
        self._locks: dict[str, tuple[str, float]] = {}
        self._presets: dict[str, Preset] = {}  # Preset.key -> preset

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def create(self, session: Session, max_sessions: int = 0) -> bool:
        self._forget_expired()
        if session.id in self._sessions:
            return False
        if (
            max_sessions
            and sum(s.owner == session.owner for s, _ in self._sessions.values()) >= max_sessions
        ):
            raise SessionQuotaExceeded(f"this API key already has {max_sessions} sessions")
        self._sessions[session.id] = (_copy(session), time.monotonic() + self._ttl_s)
        return True

    async def create_locked(
        self, session: Session, lock_ttl_s: float, max_sessions: int = 0
    ) -> str | None:
        if not await self.create(session, max_sessions):
            return None
        return await self.lock(session.id, lock_ttl_s)

    async def get(self, session_id: str, owner: str) -> Session | None:
        entry = self._sessions.get(session_id)
        if entry is None or entry[1] < time.monotonic() or entry[0].owner != owner:
            return None
        self._sessions[session_id] = (entry[0], time.monotonic() + self._ttl_s)
        return _copy(entry[0])

    async def list(self, owner: str, limit: int, after: str | None = None) -> SessionPage:
        self._forget_expired()
        mine = sorted(
            (s for s, _ in self._sessions.values() if s.owner == owner),
            key=lambda s: (s.updated_at, s.id),
            reverse=True,
        )
        start = 0
        if after is not None:
            ids = [s.id for s in mine]
            if after not in ids:
                raise UnknownCursor(f"after: no session {after!r} in this listing")
            start = ids.index(after) + 1
        page = mine[start : start + limit]
        summaries = [_summary_copy(s) for s in page]
        return SessionPage(summaries, start + limit < len(mine))

    async def set_title(self, session_id: str, owner: str, title: str) -> bool:
        session = await self.get(session_id, owner)
        if session is not None:
            self._sessions[session_id][0].title = title
        return session is not None

    async def set_pinned(self, session_id: str, owner: str, pinned: bool) -> bool:
        session = await self.get(session_id, owner)
        if session is not None:
            self._sessions[session_id][0].pinned = pinned
        return session is not None

    async def delete(self, session_id: str, owner: str) -> bool:
        if await self.get(session_id, owner) is None:
            return False
        del self._sessions[session_id]
        return True

    async def save_turn(self, session: Session) -> bool:
        stored = self._sessions.get(session.id)
        if stored is None or stored[1] < time.monotonic() or stored[0].revision != session.revision:
            return False
        turn = _copy(session)
        # a rename (or pin) during the turn wins over the turn's stale copy
        turn.title, turn.pinned = stored[0].title, stored[0].pinned
        turn.revision = session.revision = secrets.token_hex(8)
        self._sessions[session.id] = (turn, time.monotonic() + self._ttl_s)
        return True

    async def set_system(self, session: Session) -> bool:
        """A session changed by Session.reset_system, written as a turn is (the whole session, against its
        revision)."""
        return await self.save_turn(session)

    async def lock(self, session_id: str, ttl_s: float) -> str | None:
        held = self._locks.get(session_id)
        if held is not None and held[1] > time.monotonic():
            return None
        token = secrets.token_hex(8)
        self._locks[session_id] = (token, time.monotonic() + ttl_s)
        return token

    async def refresh_lock(self, session_id: str, token: str, ttl_s: float) -> bool:
        held = self._locks.get(session_id)
        if held is None or held[0] != token or held[1] < time.monotonic():
            return False
        self._locks[session_id] = (token, time.monotonic() + ttl_s)
        return True

    async def unlock(self, session_id: str, token: str) -> None:
        if self._locks.get(session_id, ("",))[0] == token:
            del self._locks[session_id]

    async def save_preset(self, preset: Preset) -> bool:
        if preset.key in self._presets:
            return False
        self._presets[preset.key] = preset
        return True

    async def get_preset(self, name: str, owner: str) -> Preset | None:
        return visible_preset(self._presets, name, owner)

    async def list_presets(self, owner: str | None) -> list[Preset]:
        return sorted_presets(list(self._presets.values()), owner)

    async def delete_preset(self, preset: Preset) -> bool:
        return self._presets.pop(preset.key, None) is not None

    def _forget_expired(self) -> None:
        now = time.monotonic()
        for session_id in [i for i, (_, expires) in self._sessions.items() if expires < now]:
            del self._sessions[session_id]


def _copy(session: Session) -> Session:
    """Stores hand out copies, as Redis would: a caller's edits reach the store only through its methods."""
    return Session(**json.loads(json.dumps(asdict(session))))


def _summary_copy(session: Session) -> Session:
    summary = Session(
        id=session.id,
        owner=session.owner,
        title=session.title,
        preset=session.preset,
        created_at=session.created_at,
        updated_at=session.updated_at,
        source=session.source,
        pinned=session.pinned,
        parent_id=session.parent_id,
        forked_at_turn=session.forked_at_turn,
    )
    summary.messages = [{}] * len(session.messages)  # the summary only counts them
    return summary


def session_to_fields(session: Session) -> dict[str, str]:
    data = asdict(session)
    fields = {k: json.dumps(data[k]) for k in JSON_FIELDS}
    for key in ("owner", "title", "created_at", "updated_at", "revision", "source"):
        fields[key] = str(data[key])
    fields["pinned"] = "1" if session.pinned else "0"
    # "" would be ambiguous: absent means None
    for key in ("system", "preset", "cache_salt", "parent_id", "forked_at_turn"):
        if data[key] is not None:
            fields[key] = str(data[key])
    fields["num_messages"] = str(len(session.messages))
    return fields


def session_from_fields(session_id: str, fields: dict[str, str]) -> Session:
    return Session(
        id=session_id,
        owner=fields.get("owner", ""),
        title=fields.get("title", ""),
        system=fields.get("system"),
        preset=fields.get("preset"),
        cache_salt=fields.get("cache_salt"),
        created_at=float(fields.get("created_at", 0)),
        updated_at=float(fields.get("updated_at", 0)),
        revision=fields.get("revision", ""),  # "": stored before revisions existed
        source=fields.get("source", "api"),
        pinned=fields.get("pinned") == "1",
        parent_id=fields.get("parent_id"),
        forked_at_turn=int(fields["forked_at_turn"]) if "forked_at_turn" in fields else None,
        **{k: json.loads(fields[k]) for k in JSON_FIELDS if k in fields},
    )
