"""Every option of ``pagedchat serve`` and ``pagedchat chat``: its help sentence, choices, unit and environment
variable, for the command line (app/cli.py) and its ``--help``.

This module imports nothing heavy (no torch), so ``pagedchat --help`` answers at once. The values themselves are
checked where they are used, by EngineConfig and ServerSettings (whose defaults ``--help`` shows, as the
``default`` text here: tests/server/test_cli.py holds the two together, and checks that every field has an option).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kib|kb|mib|mb|gib|gb)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kib": 2**10, "kb": 10**3, "mib": 2**20, "mb": 10**6, "gib": 2**30, "gb": 10**9}

DUMMY_MODELS = ("llama-3.2-1b", "qwen3-0.6b", "llama-3-8b", "llama-3-70b")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
SESSION_STORES = ("auto", "redis", "sqlite", "memory")


def parse_bytes(text: str) -> int:
    """A size in bytes: a number with an optional unit (``4MiB``, ``512KiB``, ``1GB``, ``4096``)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (a number with an optional unit: B, KiB, MiB, GiB, KB, MB, GB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower() or None])


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # the field of EngineConfig or ServerSettings; the flag is --name-with-dashes
    help: str  # one sentence: what it does (units in the sentence where they are not in the name)
    default: str  # as --help shows it
    kind: str = "str"  # str | int | float | bool | bytes
    choices: tuple[str, ...] | None = None
    env: str | None = None  # the environment variable that sets it when the flag is not given

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def help_text(self) -> str:
        parts = [self.help.rstrip(".") + "."]
        if self.choices:
            parts.append(f"One of: {', '.join(self.choices)}.")
        parts.append(f"Default: {self.default}.")
        if self.env:
            parts.append(f"Env: {self.env}.")
        return " ".join(parts)


ENGINE_OPTIONS = (
    Option("model", "The model (Llama, Mistral, Qwen2, Qwen3): a local Hugging Face directory, a local .gguf file "
           "(converted once into --cache-dir), or a hub id such as Qwen/Qwen3-0.6B (downloaded once; the hub "
           "cache with HF_HUB_OFFLINE=1)",
           "the embedded SmolLM2-135M-Instruct", env="PAGEDCHAT_MODEL"),
    Option("load_format", "Where weights come from: the model's files, or seeded random weights of --model-config "
           "(for speed work; no tokenizer: token-id prompts only)", "auto", choices=("auto", "dummy")),
    Option("model_config", "The architecture of dummy weights (--load-format dummy)", "none", choices=DUMMY_MODELS),
    Option("dtype", "The model's dtype; auto is bfloat16 on a GPU and float32 on the CPU", "auto",
           choices=("auto", "float32", "bfloat16", "float16")),
    Option("device", "Where the model runs; auto is CUDA when there is a GPU", "auto", choices=("auto", "cpu", "cuda")),
    Option("seed", "Seed of the dummy weights and of sampling without a request seed", "0", "int"),
    Option("block_size", "Tokens per KV block (a power of two)", "16", "int"),
    Option("num_kv_blocks", "Fix the KV pool at this many blocks instead of sizing it from memory", "sized from "
           "memory", "int"),
    Option("kv_cache_memory_gib", "KV cache budget on the CPU, in GiB", "1.0", "float"),
    Option("gpu_memory_utilization", "Share of GPU memory the engine may hold, weights and KV together (0 to 1]",
           "0.9", "float"),
    Option("max_num_seqs", "Most sequences in one step", "1024 on a GPU of >= 70 GiB (not A100), else 256", "int"),
    Option("max_num_batched_tokens", "Token budget of one step (decodes plus prefill chunks)",
           "8192 on a GPU of >= 70 GiB (not A100), else 2048", "int"),
    Option("max_model_len", "Longest sequence, prompt plus output, in tokens", "the model's (capped by the KV pool)",
           "int"),
    Option("max_seqs_per_tenant", "Running sequences one tenant (an API key, or a client address without keys) may "
           "hold; while several have work, each holds at most its equal share of --max-num-seqs", "--max-num-seqs",
           "int"),
    Option("shared_step_time_factor", "While several tenants have work, a step takes at most this multiple of a "
           "one-row step's time (measured as the engine runs), shared fairly among them; 0: share the token "
           "budget instead", "1.5 on the CPU, 1.2 on CUDA", "float"),
    Option("step_time_target_s", "Prefill chunks are cut so that a step's measured time stays near this (decode "
           "rows always run), so a request arriving during a long prompt waits one short step; 0: off",
           "0.25 on the CPU, 0 on CUDA", "float"),
    Option("enable_prefix_caching", "Keep full KV blocks keyed by a hash of their tokens, so shared prefixes are "
           "computed once", "on", "bool"),
    Option("prefix_hash", "The prefix blocks' hash function", "sha256", choices=("sha256", "xxh128")),
    Option("prefix_cache_seed", "A secret mixed into the prefix hashes' root (the same on every replica)", "empty",
           env="PAGEDCHAT_PREFIX_CACHE_SEED"),
    Option("cache_dir", "Where converted models are kept", "~/.cache/pagedchat", env="PAGEDCHAT_CACHE_DIR"),
    Option("num_threads", "torch's CPU threads", "torch's choice", "int"),
    Option("async_scheduling", "Prepare and launch step N+1 while the device runs step N", "on with CUDA, off on "
           "the CPU", "bool"),
    Option("enforce_eager", "Run every step eagerly: no CUDA graphs", "off", "bool"),
    Option("max_graph_batch_size", "Decode-only batches up to this size are padded and replayed as CUDA graphs",
           "256 with CUDA, 0 (off) on the CPU", "int"),
    Option("preemption_mode", "How a sequence preempted for want of KV blocks comes back: computed again, or "
           "swapped to host memory and back (auto: swap where the copy is cheaper, and n > 1 or beam requests)",
           "auto", choices=("recompute", "swap", "auto")),
    Option("swap_space_gib", "Host memory for swapped-out KV blocks, in GiB", "4.0", "float"),
    Option("host_cache_gib", "Host tier of the prefix cache, in GiB: evicted cached blocks are kept in host "
           "memory and copied back on a hit (0: off)", "0.0", "float"),
    Option("kv_backend", "Who owns the KV memory: block tables over a block pool, or (CUDA) each request "
           "contiguous in virtual memory with pages mapped on demand", "paged", choices=("paged", "vattention")),
    Option("kv_cache_dtype", "The KV cache's element type: auto is the model's dtype; fp8 stores float8 e4m3 (half "
           "the bytes of bfloat16: twice the KV blocks), per-layer scales 1.0 (values clipped at +-448); CUDA needs "
           "compute capability 8.9+", "auto", choices=("auto", "fp8")),
    Option("cpu_weights", "How the CPU stores linear weights (activations stay float32); auto is q4 for a model "
           "shipped as Q4_1 GGUF (the default model), float32 otherwise", "auto",
           choices=("auto", "float32", "bfloat16", "int8", "q4")),
    Option("cpu_isa", "Instruction-set level of the native CPU kernels; a level this CPU lacks is refused", "auto "
           "(the highest this CPU has)", choices=("auto", "avx2", "avx512", "avx512_vnni"), env="PAGEDCHAT_CPU_ISA"),
    Option("tensor_parallel_size", "Split each layer of the model over this many devices, one process each "
           "(cuda:0 .. N-1 over NCCL; on the CPU, N processes over gloo)", "1", "int"),
    Option("all_reduce", "How tensor-parallel ranks add their partial sums on CUDA: auto sends a decode step's "
           "small all-reduces through symmetric memory (one kernel over NVLink), NCCL the rest", "auto",
           choices=("auto", "nccl")),
    Option("stream_interval", "A stream's reader is woken once this many tokens are ready (or its first, or its "
           "last): fewer, larger SSE events", "1", "int"),
    Option("log_stats_interval_s", "While it works, the engine core logs a line of its numbers this often, in "
           "seconds (0: never)", "10.0", "float"),
)

SERVER_OPTIONS = (
    Option("host", "Address to listen on (0.0.0.0: every interface)", "127.0.0.1"),
    Option("port", "Port to listen on", "8000", "int"),
    Option("served_model_name", "The model's name in the API", "the model directory's name"),
    Option("api_key", "Keys that may call /v1/, comma-separated; unset: the API is open", "none",
           env="PAGEDCHAT_API_KEY"),
    Option("admin_api_key", "A key that may also create and delete shared presets", "none",
           env="PAGEDCHAT_ADMIN_API_KEY"),
    Option("forwarded_allow_ips", "Proxies whose X-Forwarded-For is believed, comma-separated (* for any): the "
           "client address behind them is the request's tenant when the server has no API keys", "127.0.0.1"),
    Option("allowed_origins", "Browser origins that may call the API, comma-separated (CORS; * for any)", "none"),
    Option("max_queue", "Requests waiting for their first token; beyond it new requests get 429", "256", "int"),
    Option("max_queue_per_tenant", "Requests of one tenant (an API key, or a client address without keys) waiting "
           "for their first token; beyond it that tenant's new requests get 429", "half of --max-queue", "int"),
    Option("max_request_bytes", "Largest request body (e.g. 4MiB); larger ones get 413", "4MiB", "bytes"),
    Option("redis_url", "Keep sessions and presets in this Redis (redis://host:port/db), shared by replicas",
           "none", env="REDIS_URL"),
    Option("session_store", "Where sessions and presets live: auto is Redis with --redis-url, else a SQLite file "
           "(durable across restarts, one host); memory is this process only (lost on restart)", "auto",
           choices=SESSION_STORES),
    Option("session_db_path", "The SQLite file of the sqlite session store", "sessions.sqlite3 in --cache-dir"),
    Option("session_ttl_s", "An unused session is forgotten after this many seconds (refreshed on use)",
           "2592000 (30 days)", "int"),
    Option("session_lock_s", "A turn holds its session this many seconds without a sign of life", "30.0", "float"),
    Option("session_write_timeout_s", "A turn's write to the session store is retried this many seconds (at most "
           "5), then kept in memory and written when the store is back", "3.0", "float"),
    Option("max_sessions_per_key", "Sessions one key may keep (0: no cap)", "10000", "int"),
    Option("max_session_bytes", "A session this large (messages and token ids) takes no more turns (e.g. 8MiB)",
           "8MiB", "bytes"),
    Option("max_system_prompt_chars", "Longest system prompt of a session or preset, in characters", "32768", "int"),
    Option("default_max_tokens", "max_tokens of a request that gives none (capped by the room left in the "
           "context)", "1024", "int"),
    Option("generation_config", "auto: the sampling defaults of the model's generation_config.json (temperature, "
           "top_p, top_k, min_p, repetition_penalty) apply to requests that do not set them, as vLLM; none: "
           "OpenAI's defaults", "auto", choices=("auto", "none")),
    Option("preset_pin_share", "At most this share of the KV pool is pinned for preset prompts", "0.25", "float"),
    Option("preset_pin_share_per_key", "One key's own presets pin at most this share of the KV pool (shared "
           "presets count only against --preset-pin-share)", "0.05", "float"),
    Option("max_presets_per_key", "Presets one key may keep (0: no cap; the admin key's shared presets are not "
           "counted)", "100", "int"),
    Option("tenant_salt_from_api_key", "Each API key's prefix blocks are its own (never hit by another key)", "off",
           "bool"),
    Option("exit_on_engine_death", "Once the engine failed, end open streams with an error and exit with status 3 "
           "so a supervisor restarts the server; off: stay up answering 503", "on", "bool"),
    Option("shutdown_timeout_s", "On SIGTERM or Ctrl-C, open streams may finish for this many seconds", "30.0",
           "float"),
    Option("log_level", "How much the server logs", "info", choices=LOG_LEVELS),
    Option("log_format", "Log lines as text, or as one JSON object per line (for log collectors); the access "
           "line of each request carries its numbers either way", "text", choices=("text", "json")),
    Option("api_server_count", "Front processes (HTTP, tokenization, output processing, SSE) sharing one engine "
           "core and one port; more than one needs --redis-url", "1", "int"),
)
