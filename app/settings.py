"""ServerSettings: the server's own options, beside the engine's (one flat dataclass, checked on creation)."""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from app.chat_format.formats import TOOL_CALL_FORMATS
from app.options import parse_names
from app.server_options import LOG_LEVELS, SESSION_STORES
from engine.config import EngineConfig


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # the model's names in the API, the first the primary (what a request without ``model`` is answered as);
    # None: the model directory's name
    served_model_name: list[str] | None = field(
        default_factory=lambda: _names_from_env("PAGEDCHAT_SERVED_MODEL_NAME")
    )
    api_key: str | None = field(default_factory=lambda: os.environ.get("PAGEDCHAT_API_KEY") or None)
    # a key that may also create (and delete) shared presets; it is a tenant of its own for everything else
    admin_api_key: str | None = field(
        default_factory=lambda: os.environ.get("PAGEDCHAT_ADMIN_API_KEY") or None
    )
    # proxies whose X-Forwarded-For / X-Forwarded-Proto are believed (uvicorn's option): the client address behind
    # them is the request's tenant when the server has no API keys; "*" believes any (only behind a proxy that
    # sets the header itself)
    forwarded_allow_ips: str = "127.0.0.1"
    # comma-separated origins whose browser pages may call the API; "*" any
    allowed_origins: str | None = None
    max_queue: int = 256  # requests waiting for their first token; beyond it new requests get 429
    # of which one tenant's (an API key's, or a client address's without keys); None: half of max_queue
    max_queue_per_tenant: int | None = None
    max_request_bytes: int = 4 * 2**20  # request bodies above it get 413
    redis_url: str | None = field(default_factory=lambda: os.environ.get("REDIS_URL") or None)
    # where sessions and presets live: auto = Redis with --redis-url, else a SQLite file (durable, one host);
    # memory = this process only (lost on restart)
    session_store: str = "auto"
    # the SQLite file; default: sessions.sqlite3 in the cache dir
    session_db_path: str | None = None
    # a session unused this long is forgotten (refreshed on use)
    session_ttl_s: int = 30 * 24 * 3600
    # a turn holds its session this long without a sign of life (refreshed meanwhile)
    session_lock_s: float = 30.0
    # a turn's write retries this long; then the answer says it is pending
    session_write_timeout_s: float = 3.0
    max_sessions_per_key: int = 10_000  # sessions one tenant may keep (0: no cap)
    # a session this large takes no more turns (messages + token ids)
    max_session_bytes: int = 8 * 2**20
    max_system_prompt_chars: int = 32_768  # system prompts of sessions and presets
    # for requests without max_tokens (capped by the room left in the context)
    default_max_tokens: int = 1024
    # the most tokens one request may buy, over its prompts: prompt + sequences x max_tokens
    # (app/request_budget.py); 0: no limit
    max_request_tokens: int = 262_144
    # per key (an API key's tenant; all requests of a server without keys are one): a token bucket of this many
    # tokens refilled at this many a minute, charged at admission with a request's most possible tokens (the
    # count above) and given back what it did not use (app/key_quota.py); 0: off
    max_tokens_per_minute_per_key: int = field(
        default_factory=lambda: _env_int("PAGEDCHAT_MAX_TOKENS_PER_MINUTE_PER_KEY")
    )
    # per key: generating requests in flight; 0: no cap
    max_concurrent_requests_per_key: int = field(
        default_factory=lambda: _env_int("PAGEDCHAT_MAX_CONCURRENT_REQUESTS_PER_KEY")
    )
    # auto: the model's generation_config.json sampling defaults; none: OpenAI's
    generation_config: str = "auto"
    # the tool-call syntax: auto (from the chat template), hermes, llama3_json or mistral
    tool_call_format: str = "auto"
    grammar_workers: int = 2  # processes that compile response_format schemas and tool grammars
    preset_pin_share: float = 0.25  # at most this share of the KV pool is pinned for preset prompts
    # of which one key's own presets pin at most this share of the pool
    preset_pin_share_per_key: float = 0.05
    # presets one key may keep (0: no cap); shared (admin) presets are not counted
    max_presets_per_key: int = 100
    # with several keys: each key's prefix blocks are its own
    tenant_salt_from_api_key: bool = False
    # exit non-zero once the engine failed, so a supervisor restarts us
    exit_on_engine_death: bool = True
    # on SIGTERM / Ctrl-C: open streams may finish this long, then the server stops
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    log_format: str = "text"  # text | json (one JSON object per line)
    # front processes sharing one engine core (HTTP, tokenization, detokenization, SSE spread over N CPUs);
    # more than one needs --redis-url, so that every front sees the same sessions and presets
    api_server_count: int = 1
    # a dead engine core is replaced (with new fronts, on the same socket: app/supervisor.py), at most
    # max_core_restarts times within 10 minutes; then, as without it, exit 3
    restart_core: bool = False
    max_core_restarts: int = 3
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def tenant_queue(self) -> int:
        return self.max_queue_per_tenant or max(1, self.max_queue // 2)

    def __post_init__(self) -> None:
        _check(0 < self.port < 65536, "port", "must be in [1, 65535]")
        _check(0 <= self.shutdown_timeout_s <= 3600, "shutdown_timeout_s", "must be in [0, 3600]")
        _check(self.max_queue >= 0, "max_queue", "must be >= 0")
        _check(
            self.max_queue_per_tenant is None or self.max_queue_per_tenant >= 1,
            "max_queue_per_tenant",
            "must be >= 1",
        )
        _check(self.max_request_bytes >= 1024, "max_request_bytes", "must be >= 1024")
        _check(self.session_ttl_s >= 60, "session_ttl_s", "must be >= 60")
        _check(self.session_lock_s > 0, "session_lock_s", "must be > 0")
        _check(0 <= self.preset_pin_share <= 0.9, "preset_pin_share", "must be in [0, 0.9]")
        _check(
            0 <= self.preset_pin_share_per_key <= self.preset_pin_share,
            "preset_pin_share_per_key",
            "must be in [0, preset_pin_share]",
        )
        _check(self.max_presets_per_key >= 0, "max_presets_per_key", "must be >= 0")
        _check(
            0 < self.session_write_timeout_s <= 5, "session_write_timeout_s", "must be in (0, 5]"
        )
        _check(self.max_sessions_per_key >= 0, "max_sessions_per_key", "must be >= 0")
        _check(self.max_session_bytes >= 4096, "max_session_bytes", "must be >= 4096")
        _check(self.max_system_prompt_chars >= 1, "max_system_prompt_chars", "must be >= 1")
        _check(self.default_max_tokens >= 1, "default_max_tokens", "must be >= 1")
        _check(self.max_request_tokens >= 0, "max_request_tokens", "must be >= 0 (0: no limit)")
        _check(
            self.max_tokens_per_minute_per_key >= 0,
            "max_tokens_per_minute_per_key",
            "must be >= 0 (0: off)",
        )
        _check(
            self.max_concurrent_requests_per_key >= 0,
            "max_concurrent_requests_per_key",
            "must be >= 0 (0: no cap)",
        )
        _check(
            self.admin_api_key is None
            or bool(self.admin_api_key.strip())
            and "," not in self.admin_api_key,
            "admin_api_key",
            "must be one non-empty key",
        )
        _check(
            self.log_level.lower() in LOG_LEVELS,
            "log_level",
            f"must be one of {', '.join(LOG_LEVELS)}",
        )
        _check(self.log_format in ("text", "json"), "log_format", "must be text or json")
        _check(
            self.generation_config in ("auto", "none"), "generation_config", "must be auto or none"
        )
        _check(
            self.tool_call_format in ("auto", *TOOL_CALL_FORMATS),
            "tool_call_format",
            f"must be auto or one of {', '.join(TOOL_CALL_FORMATS)}",
        )
        _check(1 <= self.api_server_count <= 64, "api_server_count", "must be in [1, 64]")
        _check(1 <= self.grammar_workers <= 16, "grammar_workers", "must be in [1, 16]")
        _check(
            self.session_store in SESSION_STORES,
            "session_store",
            f"must be one of {', '.join(SESSION_STORES)}",
        )
        _check(
            self.session_store != "redis" or self.redis_url is not None,
            "session_store",
            "redis needs --redis-url (or REDIS_URL)",
        )
        _check(
            self.session_store not in ("sqlite", "memory") or self.redis_url is None,
            "session_store",
            f"{self.session_store} and --redis-url contradict each other: give one",
        )
        _check(
            self.api_server_count == 1 or self.session_store != "memory",
            "api_server_count",
            "more than one front process needs a session store they share: Redis or SQLite, not memory",
        )
        _check(1 <= self.max_core_restarts <= 100, "max_core_restarts", "must be in [1, 100]")
        _check(
            not self.restart_core or self.session_store != "memory",
            "restart_core",
            "a restart replaces the front processes too: sessions in memory would be lost; use Redis or "
            "SQLite",
        )
        if self.served_model_name is not None:
            self.served_model_name = [name.strip() for name in self.served_model_name]
            _check_names(self.served_model_name, "served_model_name")

    @property
    def resolved_session_store(self) -> str:
        if self.session_store != "auto":
            return self.session_store
        return "redis" if self.redis_url else "sqlite"

    @property
    def sessions_path(self) -> str:
        return self.session_db_path or str(Path(self.engine.cache_dir) / "sessions.sqlite3")

    @property
    def api_keys(self) -> list[str]:
        """Every key that may call /v1/ (the admin key included); empty: the API is open."""
        keys = [k.strip() for k in (self.api_key or "").split(",") if k.strip()]
        return keys + ([self.admin_api_key.strip()] if self.admin_api_key else [])

    @property
    def origins(self) -> list[str]:
        return [o.strip().rstrip("/") for o in (self.allowed_origins or "").split(",") if o.strip()]


MAX_SERVED_NAMES = 16
MAX_NAME_CHARS = 256


def _names_from_env(variable: str) -> list[str] | None:
    text = os.environ.get(variable)
    return parse_names(text) if text else None


def _env_int(variable: str) -> int:
    """An integer option's environment variable (0 when unset); a bad value names the option."""
    text = os.environ.get(variable) or "0"
    try:
        return int(text)
    except ValueError:
        name = variable.removeprefix("PAGEDCHAT_").lower()
        raise ValueError(f"{name}: ${variable} must be an integer, not {text!r}") from None


def _check_names(names: list[str], field_name: str) -> None:
    """1 to 16 distinct names of 1 to 256 characters, none with whitespace or control characters (a name is
    matched exactly against a request's ``model``, and shown in logs and metrics labels)."""
    _check(
        1 <= len(names) <= MAX_SERVED_NAMES,
        field_name,
        f"give 1 to {MAX_SERVED_NAMES} names, comma-separated (got {len(names)})",
    )
    for i, name in enumerate(names, 1):
        _check(bool(name), field_name, f"name {i} is empty")
        _check(
            len(name) <= MAX_NAME_CHARS,
            field_name,
            f"name {i} has {len(name)} characters; at most {MAX_NAME_CHARS}",
        )
        _check(
            not any(c.isspace() or unicodedata.category(c)[0] == "C" for c in name),
            field_name,
            f"name {i} ({name!r}) holds whitespace or a control character",
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    _check(not repeated, field_name, f"{', '.join(map(repr, repeated))} given twice")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
