"""Session stores: a session's messages and the exact token ids (prompt + completion) of its conversation so far,
with the hashes of their full KV blocks; and named presets (shared system prompts).

``RedisSessionStore`` (redis.asyncio) when a Redis URL is configured; ``InMemorySessionStore`` as the embedded
default (lost on restart). Redis layout, all keys under ``pagedchat:``:

    session:{id}          hash  owner title system preset cache_salt created_at updated_at num_messages
                                messages token_ids block_hashes stats   (the last four JSON)
    sessions:{owner}      zset  id -> updated_at     (listing, newest first)
    session:{id}:lock     str   the turn in progress (SET NX PX; released by compare-and-delete)
    preset:{name}         hash  name system created_at;   presets   set of names

A completed turn is one Lua script: it rewrites messages, token ids, block hashes, stats and updated_at together
(never half a turn), and only if the session still exists (a turn finishing after a delete stores nothing) and
the turn still holds the session's lock (a turn whose lock expired, e.g. while Redis was away, cannot overwrite
a later turn).
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
_JSON_FIELDS = ("messages", "token_ids", "block_hashes", "stats")


class SessionStoreUnavailable(RuntimeError):
    """The store cannot be reached now (Redis down); session routes answer 503 until it is back."""


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
    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + completion of the last turn, exactly
    block_hashes: list[str] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.updated_at = self.updated_at or self.created_at

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "object": "session", "title": self.title, "preset": self.preset,
                "created_at": self.created_at, "updated_at": self.updated_at, "num_messages": len(self.messages)}

    def public(self) -> dict[str, Any]:
        return {**self.summary(), "system": self.system, "messages": self.messages, "stats": self.stats}


@dataclass(slots=True)
class Preset:
    name: str
    system: str
    created_at: float = field(default_factory=time.time)

    def public(self, num_tokens: int | None = None, pinned_blocks: int | None = None) -> dict[str, Any]:
        return {"name": self.name, "object": "preset", "system": self.system, "created_at": self.created_at,
                "num_tokens": num_tokens, "pinned_blocks": pinned_blocks}


class SessionStore(Protocol):
    durable: bool  # survives a server restart

    async def ping(self) -> None: ...
    async def close(self) -> None: ...
    async def create(self, session: Session) -> None: ...
    async def get(self, session_id: str, owner: str) -> Session | None: ...
    async def list(self, owner: str, limit: int) -> list[Session]: ...
    async def set_title(self, session_id: str, owner: str, title: str) -> bool: ...
    async def delete(self, session_id: str, owner: str) -> bool: ...
    async def save_turn(self, session: Session, lock_token: str) -> bool: ...
    async def lock(self, session_id: str, ttl_s: float) -> str | None: ...
    async def refresh_lock(self, session_id: str, token: str, ttl_s: float) -> bool: ...
    async def unlock(self, session_id: str, token: str) -> None: ...
    async def save_preset(self, preset: Preset) -> None: ...
    async def get_preset(self, name: str) -> Preset | None: ...
    async def list_presets(self) -> list[Preset]: ...
    async def delete_preset(self, name: str) -> bool: ...


class InMemorySessionStore:
    """The embedded default: everything in this process, gone on restart."""

    durable = False

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._sessions: dict[str, tuple[Session, float]] = {}  # id -> (session, expires at)
        self._locks: dict[str, tuple[str, float]] = {}
        self._presets: dict[str, Preset] = {}

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def create(self, session: Session) -> None:
        self._sessions[session.id] = (_copy(session), time.monotonic() + self._ttl_s)

    async def get(self, session_id: str, owner: str) -> Session | None:
        entry = self._sessions.get(session_id)
        if entry is None or entry[1] < time.monotonic() or entry[0].owner != owner:
            return None
        self._sessions[session_id] = (entry[0], time.monotonic() + self._ttl_s)
        return _copy(entry[0])

    async def list(self, owner: str, limit: int) -> list[Session]:
        now = time.monotonic()
        live = [s for s, expires in self._sessions.values() if s.owner == owner and expires >= now]
        return [_copy(s) for s in sorted(live, key=lambda s: s.updated_at, reverse=True)[:limit]]

    async def set_title(self, session_id: str, owner: str, title: str) -> bool:
        session = await self.get(session_id, owner)
        if session is not None:
            self._sessions[session_id][0].title = title
        return session is not None

    async def delete(self, session_id: str, owner: str) -> bool:
        if await self.get(session_id, owner) is None:
            return False
        del self._sessions[session_id]
        return True

    async def save_turn(self, session: Session, lock_token: str) -> bool:
        stored = self._sessions.get(session.id)
        held = self._locks.get(session.id)
        if stored is None or held is None or held[0] != lock_token or held[1] < time.monotonic():
            return False
        title = stored[0].title  # a rename during the turn wins over the turn's stale copy
        self._sessions[session.id] = (_copy(session), time.monotonic() + self._ttl_s)
        self._sessions[session.id][0].title = title
        return True

    async def lock(self, session_id: str, ttl_s: float) -> str | None:
        held = self._locks.get(session_id)
        if held is not None and held[1] > time.monotonic():
            return None
        token = secrets.token_hex(8)
        self._locks[session_id] = (token, time.monotonic() + ttl_s)
        return token

    async def refresh_lock(self, session_id: str, token: str, ttl_s: float) -> bool:
        held = self._locks.get(session_id)
        if held is None or held[0] != token:
            return False
        self._locks[session_id] = (token, time.monotonic() + ttl_s)
        return True

    async def unlock(self, session_id: str, token: str) -> None:
        if self._locks.get(session_id, ("",))[0] == token:
            del self._locks[session_id]

    async def save_preset(self, preset: Preset) -> None:
        self._presets[preset.name] = preset

    async def get_preset(self, name: str) -> Preset | None:
        return self._presets.get(name)

    async def list_presets(self) -> list[Preset]:
        return sorted(self._presets.values(), key=lambda p: p.name)

    async def delete_preset(self, name: str) -> bool:
        return self._presets.pop(name, None) is not None


def _copy(session: Session) -> Session:
    """Stores hand out copies, as Redis would: a caller's edits reach the store only through its methods."""
    return Session(**json.loads(json.dumps(asdict(session))))


def session_to_fields(session: Session) -> dict[str, str]:
    data = asdict(session)
    fields = {k: json.dumps(data[k]) for k in _JSON_FIELDS}
    for key in ("owner", "title", "created_at", "updated_at"):
        fields[key] = str(data[key])
    for key in ("system", "preset", "cache_salt"):  # "" would be ambiguous: absent means None
        if data[key] is not None:
            fields[key] = data[key]
    fields["num_messages"] = str(len(session.messages))
    return fields


def session_from_fields(session_id: str, fields: dict[str, str]) -> Session:
    return Session(
        id=session_id, owner=fields.get("owner", ""), title=fields.get("title", ""), system=fields.get("system"),
        preset=fields.get("preset"), cache_salt=fields.get("cache_salt"),
        created_at=float(fields.get("created_at", 0)), updated_at=float(fields.get("updated_at", 0)),
        **{k: json.loads(fields[k]) for k in _JSON_FIELDS if k in fields},
    )


class RedisSessionStore:
    """Sessions and presets in Redis (shared by every replica of a deployment; durable with AOF)."""

    durable = True

    def __init__(self, url: str, ttl_s: float, prefix: str = "pagedchat:") -> None:
        from redis.asyncio import Redis

        self._redis = Redis.from_url(url, decode_responses=True, socket_connect_timeout=2, socket_timeout=5,
                                     health_check_interval=10)
        self._ttl_ms = int(ttl_s * 1000)
        self._p = prefix
        self._save_turn = self._redis.register_script(_SAVE_TURN)
        self._unlock = self._redis.register_script(_UNLOCK)
        self._refresh = self._redis.register_script(_REFRESH_LOCK)

    def _key(self, session_id: str) -> str:
        return f"{self._p}session:{session_id}"

    def _index(self, owner: str) -> str:
        return f"{self._p}sessions:{owner or '-'}"

    async def ping(self) -> None:
        await _unavailable_on_error(self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()

    async def create(self, session: Session) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(session.id), mapping=session_to_fields(session))
            pipe.pexpire(self._key(session.id), self._ttl_ms)
            pipe.zadd(self._index(session.owner), {session.id: session.updated_at})
            await _unavailable_on_error(pipe.execute())

    async def get(self, session_id: str, owner: str) -> Session | None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._key(session_id))
            pipe.pexpire(self._key(session_id), self._ttl_ms)  # refreshed on use
            fields, _ = await _unavailable_on_error(pipe.execute())
        if not fields or fields.get("owner", "") != owner:
            return None
        return session_from_fields(session_id, fields)

    async def list(self, owner: str, limit: int) -> list[Session]:
        ids = await _unavailable_on_error(self._redis.zrevrange(self._index(owner), 0, max(limit, 1) * 2))
        async with self._redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(self._key(session_id), _SUMMARY_FIELDS)
            rows = await _unavailable_on_error(pipe.execute())
        sessions, expired = [], []
        for session_id, row in zip(ids, rows):
            if row[0] is None:  # expired: its index entry goes too
                expired.append(session_id)
                continue
            fields = {k: v for k, v in zip(_SUMMARY_FIELDS, row) if v is not None}
            session = session_from_fields(session_id, fields)
            session.messages = [{}] * int(fields.get("num_messages", 0))  # the summary only counts them
            sessions.append(session)
        if expired:
            await _unavailable_on_error(self._redis.zrem(self._index(owner), *expired))
        return sessions[:limit]

    async def set_title(self, session_id: str, owner: str, title: str) -> bool:
        if await self.get(session_id, owner) is None:
            return False
        await _unavailable_on_error(self._redis.hset(self._key(session_id), "title", title))
        return True

    async def delete(self, session_id: str, owner: str) -> bool:
        if await self.get(session_id, owner) is None:
            return False
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(session_id))
            pipe.zrem(self._index(owner), session_id)
            await _unavailable_on_error(pipe.execute())
        return True

    async def save_turn(self, session: Session, lock_token: str) -> bool:
        fields = session_to_fields(session)
        keys = [self._key(session.id), self._index(session.owner), f"{self._key(session.id)}:lock"]
        args = [self._ttl_ms, session.id, session.updated_at, fields["num_messages"],
                *(fields[k] for k in ("updated_at", *_JSON_FIELDS)), lock_token]
        return bool(await _unavailable_on_error(self._save_turn(keys=keys, args=args)))

    async def lock(self, session_id: str, ttl_s: float) -> str | None:
        token = secrets.token_hex(8)
        ok = await _unavailable_on_error(self._redis.set(f"{self._key(session_id)}:lock", token, nx=True,
                                                         px=int(ttl_s * 1000)))
        return token if ok else None

    async def refresh_lock(self, session_id: str, token: str, ttl_s: float) -> bool:
        key = f"{self._key(session_id)}:lock"
        return bool(await _unavailable_on_error(self._refresh(keys=[key], args=[token, int(ttl_s * 1000)])))

    async def unlock(self, session_id: str, token: str) -> None:
        await _unavailable_on_error(self._unlock(keys=[f"{self._key(session_id)}:lock"], args=[token]))

    async def save_preset(self, preset: Preset) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(f"{self._p}preset:{preset.name}", mapping={
                "name": preset.name, "system": preset.system, "created_at": str(preset.created_at)})
            pipe.sadd(f"{self._p}presets", preset.name)
            await _unavailable_on_error(pipe.execute())

    async def get_preset(self, name: str) -> Preset | None:
        fields = await _unavailable_on_error(self._redis.hgetall(f"{self._p}preset:{name}"))
        return Preset(fields["name"], fields["system"], float(fields["created_at"])) if fields else None

    async def list_presets(self) -> list[Preset]:
        names = sorted(await _unavailable_on_error(self._redis.smembers(f"{self._p}presets")))
        presets = [await self.get_preset(name) for name in names]
        return [p for p in presets if p is not None]

    async def delete_preset(self, name: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(f"{self._p}preset:{name}")
            pipe.srem(f"{self._p}presets", name)
            deleted, _ = await _unavailable_on_error(pipe.execute())
        return bool(deleted)


_SUMMARY_FIELDS = ["owner", "title", "preset", "created_at", "updated_at", "num_messages"]

# KEYS: session hash, owner index, lock. ARGV: ttl ms, id, score, num_messages, updated_at, messages, token_ids,
# block_hashes, stats, lock token. Writes the turn only if the session exists and the turn holds its lock.
_SAVE_TURN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('GET', KEYS[3]) ~= ARGV[10] then return 0 end
redis.call('HSET', KEYS[1], 'num_messages', ARGV[4], 'updated_at', ARGV[5], 'messages', ARGV[6],
           'token_ids', ARGV[7], 'block_hashes', ARGV[8], 'stats', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return 1
"""
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_REFRESH_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


async def _unavailable_on_error(awaitable: Any) -> Any:
    from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

    try:
        return await awaitable
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise SessionStoreUnavailable(f"Redis is unreachable: {exc}") from exc
