"""The app in this process with the in-memory session store and two API keys, for the session tests that need a
real engine but no server process (tests/server/test_session_fork.py, test_session_find_export.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from starlette.testclient import TestClient

from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from tests.server_harness import SMALL_KV_GIB, one_torch_thread

KEYS = ("alice", "bob")


@contextlib.contextmanager
def session_app(**fields: Any) -> Iterator[TestClient]:
    """``fields``: more ServerSettings fields (e.g. served_model_name)."""
    settings = ServerSettings(
        api_key=",".join(KEYS),
        session_store="memory",
        engine=EngineConfig(kv_cache_memory_gib=float(SMALL_KV_GIB), max_model_len=1024),
        **fields,
    )
    with (
        one_torch_thread(),
        TestClient(create_app(settings), raise_server_exceptions=False) as client,
    ):
        yield client


def auth(key: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
