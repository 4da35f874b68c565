"""ServerSettings: the server's own options, beside the engine's (one flat dataclass, checked on creation)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.config import EngineConfig


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model directory's name
    api_key: str | None = field(default_factory=lambda: os.environ.get("PAGEDCHAT_API_KEY") or None)
    max_queue: int = 256  # requests waiting for their first token; beyond it new requests get 429
    max_request_bytes: int = 4 * 2**20  # request bodies above it get 413
    redis_url: str | None = field(default_factory=lambda: os.environ.get("REDIS_URL") or None)
    session_ttl_s: int = 30 * 24 * 3600  # a session unused this long is forgotten (refreshed on use)
    session_lock_s: float = 30.0  # a turn holds its session this long without a sign of life (refreshed meanwhile)
    preset_pin_share: float = 0.25  # at most this share of the KV pool is pinned for preset prompts
    tenant_salt_from_api_key: bool = False  # with several keys: each key's prefix blocks are its own
    log_level: str = "info"
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        _check(0 < self.port < 65536, "port", "must be in [1, 65535]")
        _check(self.max_queue >= 0, "max_queue", "must be >= 0")
        _check(self.max_request_bytes >= 1024, "max_request_bytes", "must be >= 1024")
        _check(self.session_ttl_s >= 60, "session_ttl_s", "must be >= 60")
        _check(self.session_lock_s > 0, "session_lock_s", "must be > 0")
        _check(0 <= self.preset_pin_share <= 0.9, "preset_pin_share", "must be in [0, 0.9]")
        _check(self.served_model_name is None or bool(self.served_model_name.strip()),
               "served_model_name", "must not be empty")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
