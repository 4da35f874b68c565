"""Sessions and presets in Redis (redis.asyncio), shared by every replica of a deployment; durable with AOF.

Layout, all keys under ``pagedchat:``:

    session:{id}          hash  owner title system preset cache_salt created_at updated_at revision num_messages
                                source pinned parent_id forked_at_turn
                                messages token_ids block_hashes stats   (the last four JSON)
    sessions:{owner}      zset  id -> updated_at     (listing, newest first; "-" for the owner "")
    session:{id}:lock     str   the turn in progress (SET NX PX; released by compare-and-delete)
    preset:{key}          hash  name system owner created_at   (key: name if shared, owner/name if owned)
    presets               set   preset keys

Creating a session (with its lock, and the owner's quota checked) and storing a turn are each one Lua script, so
no other client ever sees half of either.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from app.sessions.store import (
    JSON_FIELDS,
    Preset,
    Session,
    SessionPage,
    SessionQuotaExceeded,
    SessionStoreUnavailable,
    UnknownCursor,
    session_from_fields,
    session_to_fields,
    sorted_presets,
)

logger = logging.getLogger(__name__)

_SUMMARY_FIELDS = [
    "owner",
    "title",
    "preset",
    "created_at",
    "updated_at",
    "num_messages",
    "source",
    "pinned",
    "parent_id",
    "forked_at_turn",
]
_PRESET_FIELDS = ["name", "system", "owner", "created_at"]


class RedisSessionStore:
    durable = True
    kind = "redis"

    def __init__(self, url: str, ttl_s: float, prefix: str = "pagedchat:") -> None:
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        # a connection Redis closed (it restarted) fails on its first use: one retry on a fresh connection, so
        # the first request after a restart does not get a 503 (only connection errors: a timeout may have run)
        self._redis = Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=2,
            socket_timeout=5,
            health_check_interval=10,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
        )
        self._reachable = True
        self._ttl_ms = int(ttl_s * 1000)
        self._p = prefix
        self._create = self._redis.register_script(_CREATE)
        self._save_turn = self._redis.register_script(_SAVE_TURN)
        self._unlock = self._redis.register_script(_UNLOCK)
        self._refresh = self._redis.register_script(_REFRESH_LOCK)
        self._save_preset = self._redis.register_script(_SAVE_PRESET)
        self._set_field = self._redis.register_script(_SET_FIELD)
        self._set_system = self._redis.register_script(_SET_SYSTEM)

    async def _guard(self, awaitable: Any) -> Any:
        """``awaitable``'s result, or SessionStoreUnavailable; Redis going away and coming back is logged once
        each (not once per request)."""
        try:
            result = await _unavailable_on_error(awaitable)
        except SessionStoreUnavailable as exc:
            if self._reachable:
                self._reachable = False
                logger.warning(
                    "session store: %s (session routes answer 503 until it is back)", exc
                )
            raise
        if not self._reachable:
            self._reachable = True
            logger.info("session store: Redis is reachable again")
        return result

    def _key(self, session_id: str) -> str:
        return f"{self._p}session:{session_id}"

    def _index(self, owner: str) -> str:
        return f"{self._p}sessions:{owner or '-'}"

    async def ping(self) -> None:
        await self._guard(self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()

    async def create(self, session: Session, max_sessions: int = 0) -> bool:
        return await self._create_session(session, "", 0, max_sessions) is not None

    async def create_locked(
        self, session: Session, lock_ttl_s: float, max_sessions: int = 0
    ) -> str | None:
        return await self._create_session(session, secrets.token_hex(8), lock_ttl_s, max_sessions)

    async def _create_session(
        self, session: Session, lock_token: str, lock_ttl_s: float, max_sessions: int
    ) -> str | None:
        fields = [part for item in session_to_fields(session).items() for part in item]
        keys = [self._key(session.id), self._index(session.owner), f"{self._key(session.id)}:lock"]
        args = [
            self._ttl_ms,
            session.id,
            session.updated_at,
            max_sessions,
            f"{self._p}session:",
            lock_token,
            max(int(lock_ttl_s * 1000), 1),
            *fields,
        ]
        created = await self._guard(self._create(keys=keys, args=args))
        if created == -1:
            raise SessionQuotaExceeded(f"this API key already has {max_sessions} sessions")
        return lock_token if created == 1 else None

    async def get(self, session_id: str, owner: str) -> Session | None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._key(session_id))
            pipe.pexpire(self._key(session_id), self._ttl_ms)  # refreshed on use
            fields, _ = await self._guard(pipe.execute())
        if not fields or fields.get("owner", "") != owner:
            return None
        return session_from_fields(session_id, fields)

    async def list(self, owner: str, limit: int, after: str | None = None) -> SessionPage:
        index, start = self._index(owner), 0
        if after is not None:
            rank = await self._guard(self._redis.zrevrank(index, after))
            if rank is None:
                raise UnknownCursor(f"after: no session {after!r} in this listing")
            start = rank + 1
        # one more: has_more
        ids = await self._guard(self._redis.zrevrange(index, start, start + limit))
        has_more, ids = len(ids) > limit, ids[:limit]
        async with self._redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(self._key(session_id), _SUMMARY_FIELDS)
            rows = await self._guard(pipe.execute())
        sessions, expired = [], []
        for session_id, row in zip(ids, rows):
            if row[0] is None:  # expired: its index entry goes too (the page is one shorter)
                expired.append(session_id)
                continue
            fields = {k: v for k, v in zip(_SUMMARY_FIELDS, row) if v is not None}
            session = session_from_fields(session_id, fields)
            # the summary only counts them
            session.messages = [{}] * int(fields.get("num_messages", 0))
            sessions.append(session)
        if expired:
            await self._guard(self._redis.zrem(index, *expired))
        return SessionPage(sessions, has_more)

    async def set_title(self, session_id: str, owner: str, title: str) -> bool:
        return await self._set(session_id, owner, "title", title)

    async def set_pinned(self, session_id: str, owner: str, pinned: bool) -> bool:
        return await self._set(session_id, owner, "pinned", "1" if pinned else "0")

    async def _set(self, session_id: str, owner: str, name: str, value: str) -> bool:
        args = [owner, name, value]
        return bool(await self._guard(self._set_field(keys=[self._key(session_id)], args=args)))

    async def delete(self, session_id: str, owner: str) -> bool:
        if await self.get(session_id, owner) is None:
            return False
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(session_id))
            pipe.zrem(self._index(owner), session_id)
            await self._guard(pipe.execute())
        return True

    async def save_turn(self, session: Session) -> bool:
        fields = session_to_fields(session)
        revision = secrets.token_hex(8)
        keys = [self._key(session.id), self._index(session.owner)]
        args = [
            self._ttl_ms,
            session.id,
            session.updated_at,
            fields["num_messages"],
            *(fields[k] for k in ("updated_at", *JSON_FIELDS)),
            session.revision,
            revision,
        ]
        saved = bool(await self._guard(self._save_turn(keys=keys, args=args)))
        if saved:
            session.revision = revision
        return saved

    async def set_system(self, session: Session) -> bool:
        fields = session_to_fields(session)
        revision = secrets.token_hex(8)
        reset = [fields[k] for k in ("messages", "token_ids", "block_hashes")]
        system = [] if session.system is None else [session.system]
        args = [session.owner, session.revision, revision, *reset, *system]
        saved = bool(await self._guard(self._set_system(keys=[self._key(session.id)], args=args)))
        if saved:
            session.revision = revision
        return saved

    async def lock(self, session_id: str, ttl_s: float) -> str | None:
        token = secrets.token_hex(8)
        ok = await self._guard(
            self._redis.set(f"{self._key(session_id)}:lock", token, nx=True, px=int(ttl_s * 1000))
        )
        return token if ok else None

    async def refresh_lock(self, session_id: str, token: str, ttl_s: float) -> bool:
        key = f"{self._key(session_id)}:lock"
        return bool(await self._guard(self._refresh(keys=[key], args=[token, int(ttl_s * 1000)])))

    async def unlock(self, session_id: str, token: str) -> None:
        await self._guard(self._unlock(keys=[f"{self._key(session_id)}:lock"], args=[token]))

    async def save_preset(self, preset: Preset) -> bool:
        keys = [f"{self._p}preset:{preset.key}", f"{self._p}presets"]
        args = [preset.key, preset.name, preset.system, preset.owner, str(preset.created_at)]
        return bool(await self._guard(self._save_preset(keys=keys, args=args)))

    async def get_preset(self, name: str, owner: str) -> Preset | None:
        keys = ([Preset(name, "", owner).key] if owner else []) + [name]
        found = await self._presets(keys)
        return found[0] if found else None

    async def list_presets(self, owner: str | None) -> list[Preset]:
        keys = await self._guard(self._redis.smembers(f"{self._p}presets"))
        if owner is not None:
            keys = [k for k in keys if "/" not in k or k.startswith(f"{owner}/")]
        return sorted_presets(await self._presets(keys), owner)

    async def delete_preset(self, preset: Preset) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(f"{self._p}preset:{preset.key}")
            pipe.srem(f"{self._p}presets", preset.key)
            deleted, _ = await self._guard(pipe.execute())
        return bool(deleted)

    async def _presets(self, keys: list[str]) -> list[Preset]:
        """The presets stored under ``keys``, in that order (missing ones left out)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hmget(f"{self._p}preset:{key}", _PRESET_FIELDS)
            rows = await self._guard(pipe.execute())
        return [
            Preset(name, system or "", owner or "", float(created or 0))
            for name, system, owner, created in rows
            if name is not None
        ]


# KEYS: session hash, owner index, lock. ARGV: ttl ms, id, score, max sessions (0: no cap), session key prefix,
# lock token ("": no lock), lock ttl ms, then the hash's field/value pairs. 1 created, 0 the id is taken, -1 the
# owner is at its cap (index entries of expired sessions are dropped before counting).
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local cap = tonumber(ARGV[4])
if cap > 0 and redis.call('ZCARD', KEYS[2]) >= cap then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if redis.call('EXISTS', ARGV[5] .. id) == 0 then redis.call('ZREM', KEYS[2], id) end
  end
  if redis.call('ZCARD', KEYS[2]) >= cap then return -1 end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
if ARGV[6] ~= '' then redis.call('SET', KEYS[3], ARGV[6], 'PX', ARGV[7]) end
return 1
"""
# KEYS: session hash, owner index. ARGV: ttl ms, id, score, num_messages, updated_at, messages, token_ids,
# block_hashes, stats, the revision the turn started from, the new revision.
_SAVE_TURN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if (redis.call('HGET', KEYS[1], 'revision') or '') ~= ARGV[10] then return 0 end
redis.call('HSET', KEYS[1], 'num_messages', ARGV[4], 'updated_at', ARGV[5], 'messages', ARGV[6],
           'token_ids', ARGV[7], 'block_hashes', ARGV[8], 'stats', ARGV[9], 'revision', ARGV[11])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return 1
"""
# KEYS: session hash. ARGV: owner, field (title, pinned), value. Only the owner's existing session (a rename never
# recreates a deleted one).
_SET_FIELD = """
if (redis.call('HGET', KEYS[1], 'owner') or false) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""
# KEYS: session hash. ARGV: owner, the revision read, the new revision, messages, token_ids, block_hashes, then the
# system prompt (none: no system prompt). The preset goes; 0 when the session is gone or changed.
_SET_SYSTEM = """
if (redis.call('HGET', KEYS[1], 'owner') or false) ~= ARGV[1] then return 0 end
if (redis.call('HGET', KEYS[1], 'revision') or '') ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], 'system', 'preset')
redis.call('HSET', KEYS[1], 'revision', ARGV[3], 'messages', ARGV[4], 'token_ids', ARGV[5],
           'block_hashes', ARGV[6])
if ARGV[7] then redis.call('HSET', KEYS[1], 'system', ARGV[7]) end
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
# KEYS: preset hash, the set of keys. ARGV: key, name, system, owner, created_at. 0 when the key is taken.
_SAVE_PRESET = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'name', ARGV[2], 'system', ARGV[3], 'owner', ARGV[4], 'created_at', ARGV[5])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""


async def _unavailable_on_error(awaitable: Any) -> Any:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    try:
        return await awaitable
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise SessionStoreUnavailable(f"Redis is unreachable: {exc}") from exc
