"""Server-kept conversations and presets: the stores (store.py, redis_store.py, sqlite_store.py), the token-exact
prompt of each turn (conversation.py, turns.py), where each message ends in the token ids (token_marks.py), turns
kept while the store is away (outbox.py), the service the routes are written against (service.py), and the HTTP
routes (api.py, turn_api.py, presets.py; fork.py: branches, find.py: listing and search, transfer.py: export and
import)."""

from app.sessions.redis_store import RedisSessionStore
from app.sessions.sqlite_store import SQLiteSessionStore
from app.sessions.store import (
    InMemorySessionStore,
    Preset,
    Session,
    SessionPage,
    SessionQuotaExceeded,
    SessionStore,
    SessionStoreUnavailable,
    UnknownCursor,
    is_preset_name,
    is_session_id,
    new_session_id,
)

__all__ = [
    "InMemorySessionStore",
    "Preset",
    "RedisSessionStore",
    "SQLiteSessionStore",
    "Session",
    "SessionPage",
    "SessionQuotaExceeded",
    "SessionStore",
    "SessionStoreUnavailable",
    "UnknownCursor",
    "is_preset_name",
    "is_session_id",
    "new_session_id",
]
