"""The server's options, one per field of ServerSettings (app/settings.py): the flags of ``pagedchat serve`` for
listening, keys, queues, sessions and presets, request defaults and logging (an Option: app/options.py)."""

from __future__ import annotations

from app.options import Option

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SESSION_STORES = ("auto", "redis", "sqlite", "memory")

SERVER_OPTIONS = (
    Option("host", "Address to listen on (0.0.0.0: every interface)", "127.0.0.1"),
    Option("port", "Port to listen on", "8000", "int"),
    Option(
        "served_model_name",
        "The model's names in the API, comma-separated (at most 16): /v1/models lists each, a request "
        "may name any (its answer carries the name it asked for), the first is the primary (the name of "
        "an answer to a request that gives none, and of the metrics)",
        "the model directory's name",
        "names",
        env="PAGEDCHAT_SERVED_MODEL_NAME",
    ),
    Option(
        "api_key",
        "Keys that may call /v1/, comma-separated; unset: the API is open",
        "none",
        env="PAGEDCHAT_API_KEY",
    ),
    Option(
        "admin_api_key",
        "A key that may also create and delete shared presets",
        "none",
        env="PAGEDCHAT_ADMIN_API_KEY",
    ),
    Option(
        "forwarded_allow_ips",
        "Proxies whose X-Forwarded-For is believed, comma-separated (* for any): the "
        "client address behind them is the request's tenant when the server has no API keys",
        "127.0.0.1",
    ),
    Option(
        "allowed_origins",
        "Browser origins that may call the API, comma-separated (CORS; * for any)",
        "none",
    ),
    Option(
        "max_queue",
        "Requests waiting for their first token; beyond it new requests get 429",
        "256",
        "int",
    ),
    Option(
        "max_queue_per_tenant",
        "Requests of one tenant (an API key, or a client address without keys) waiting "
        "for their first token; beyond it that tenant's new requests get 429",
        "half of --max-queue",
        "int",
    ),
    Option(
        "max_request_bytes",
        "Largest request body (e.g. 4MiB); larger ones get 413",
        "4MiB",
        "bytes",
    ),
    Option(
        "redis_url",
        "Keep sessions and presets in this Redis (redis://host:port/db), shared by replicas",
        "none",
        env="REDIS_URL",
    ),
    Option(
        "session_store",
        "Where sessions and presets live: auto is Redis with --redis-url, else a SQLite file "
        "(durable across restarts, one host); memory is this process only (lost on restart)",
        "auto",
        choices=SESSION_STORES,
    ),
    Option(
        "session_db_path",
        "The SQLite file of the sqlite session store",
        "sessions.sqlite3 in --cache-dir",
    ),
    Option(
        "session_ttl_s",
        "An unused session is forgotten after this many seconds (refreshed on use)",
        "2592000 (30 days)",
        "int",
    ),
    Option(
        "session_lock_s",
        "A turn holds its session this many seconds without a sign of life",
        "30.0",
        "float",
    ),
    Option(
        "session_write_timeout_s",
        "A turn's write to the session store is retried this many seconds (at most "
        "5), then kept in memory and written when the store is back",
        "3.0",
        "float",
    ),
    Option("max_sessions_per_key", "Sessions one key may keep (0: no cap)", "10000", "int"),
    Option(
        "max_session_bytes",
        "A session this large (messages and token ids) takes no more turns (e.g. 8MiB)",
        "8MiB",
        "bytes",
    ),
    Option(
        "max_system_prompt_chars",
        "Longest system prompt of a session or preset, in characters",
        "32768",
        "int",
    ),
    Option(
        "default_max_tokens",
        "max_tokens of a request that gives none (capped by the room left in the context)",
        "1024",
        "int",
    ),
    Option(
        "max_request_tokens",
        "The most tokens one request may take, summed over its prompts: prompt tokens + "
        "sequences (best_of, else n, or beam_width) x max_tokens (or its default); more is refused with "
        "400 naming the field to lower (0: no limit)",
        "262144",
        "int",
    ),
    Option(
        "max_tokens_per_minute_per_key",
        "Tokens one API key (without keys: the whole server) may take a minute, a token bucket of this "
        "size refilled continuously: a request reserves its most possible tokens (as --max-request-tokens "
        "counts them) and gets back what it did not use when it ends; a request that does not fit gets 429 "
        "rate_limit_exceeded with Retry-After, one larger than the bucket 400 naming max_tokens. With "
        "several fronts (--api-server-count) each enforces its share, N / fronts rounded up (0: off)",
        "0",
        "int",
        env="PAGEDCHAT_MAX_TOKENS_PER_MINUTE_PER_KEY",
    ),
    Option(
        "max_concurrent_requests_per_key",
        "Generating requests one API key (without keys: the whole server) may have in flight; more get "
        "429 rate_limit_exceeded with Retry-After: 1. With several fronts each enforces its share, N / "
        "fronts rounded up (0: no cap)",
        "0",
        "int",
        env="PAGEDCHAT_MAX_CONCURRENT_REQUESTS_PER_KEY",
    ),
    Option(
        "generation_config",
        "auto: the sampling defaults of the model's generation_config.json (temperature, "
        "top_p, top_k, min_p, repetition_penalty) apply to requests that do not set them, as vLLM; none: "
        "OpenAI's defaults",
        "auto",
        choices=("auto", "none"),
    ),
    Option(
        "tool_call_format",
        "How the model writes tool calls: auto (read from its chat template), hermes (<tool_call> "
        "blocks: Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.x), mistral ([TOOL_CALLS])",
        "auto",
        choices=("auto", "hermes", "llama3_json", "mistral"),
    ),
    Option(
        "grammar_workers",
        "Processes that compile response_format schemas and tool-call grammars, started warm with the "
        "server (one compiles while the others stand by)",
        "2",
        "int",
    ),
    Option(
        "preset_pin_share",
        "At most this share of the KV pool is pinned for preset prompts",
        "0.25",
        "float",
    ),
    Option(
        "preset_pin_share_per_key",
        "One key's own presets pin at most this share of the KV pool (shared "
        "presets count only against --preset-pin-share)",
        "0.05",
        "float",
    ),
    Option(
        "max_presets_per_key",
        "Presets one key may keep (0: no cap; the admin key's shared presets are not counted)",
        "100",
        "int",
    ),
    Option(
        "tenant_salt_from_api_key",
        "Each API key's prefix blocks are its own (never hit by another key)",
        "off",
        "bool",
    ),
    Option(
        "exit_on_engine_death",
        "Once the engine failed, end open streams with an error and exit with status 3 "
        "so a supervisor restarts the server; off: stay up answering 503",
        "on",
        "bool",
    ),
    Option(
        "shutdown_timeout_s",
        "On SIGTERM or Ctrl-C, open streams may finish for this many seconds",
        "30.0",
        "float",
    ),
    Option("log_level", "How much the server logs", "info", choices=LOG_LEVELS),
    Option(
        "log_format",
        "Log lines as text, or as one JSON object per line (for log collectors); the access "
        "line of each request carries its numbers either way",
        "text",
        choices=("text", "json"),
    ),
    Option(
        "api_server_count",
        "Front processes (HTTP, tokenization, output processing, SSE) sharing one engine "
        "core and one port; more than one needs --redis-url",
        "1",
        "int",
    ),
    Option(
        "restart_core",
        "When the engine core process dies, end its open streams with an error and start a new core and "
        "new front processes on the same listening socket (connections made meanwhile wait), instead of "
        "exiting with status 3; needs a session store other than memory",
        "off",
        "bool",
    ),
    Option(
        "max_core_restarts",
        "With --restart-core: the restarts allowed within 10 minutes; the next core death exits with "
        "status 3",
        "3",
        "int",
    ),
)
