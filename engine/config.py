"""EngineConfig: every engine option in one flat dataclass.

User-facing fields come first; the fields after ``# derived`` are filled by the engine at start
(model config, dtype, device, KV pool size) so that every part reads one resolved value.

Constructing one checks each option's value and imports no torch (the server's front builds and sends one without
loading torch); ``resolve()`` fills what depends on the device (engine/device_defaults.py), where the engine runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cache_dir import default_cache_dir

LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("float32", "bfloat16", "float16")
PREFIX_HASHES = ("sha256", "xxh128")
PREEMPTION_MODES = ("recompute", "swap", "auto")
KV_BACKENDS = ("paged", "vattention")
KV_CACHE_DTYPES = ("auto", "fp8")
# the native CPU kernels' levels (kernels/cpu_native.py CPU_ISA_CHOICES, which imports torch; a test keeps them equal)
CPU_ISA_CHOICES = ("auto", "generic", "avx2", "avx512", "avx512_vnni")
SPECULATIVE_METHODS = (None, "ngram", "draft")  # (engine/speculative/)
# the CPU linear layers' weights (engine/layers/quantized_linear.py)
CPU_WEIGHTS = ("file", "float32", "bfloat16", "int8", "q4")
# tensor parallelism's all-reduce paths (engine/distributed/parallel_state.py)
ALL_REDUCE_CHOICES = ("auto", "two_shot", "nccl")


@dataclass(slots=True)
class EngineConfig:
    # HF directory; None = the embedded SmolLM2-135M-Instruct ($PAGEDCHAT_MODEL when set and not empty)
    model: str | None = field(default_factory=lambda: os.environ.get("PAGEDCHAT_MODEL") or None)
    load_format: str = "auto"  # auto (safetensors / GGUF) | dummy (random weights, seeded)
    model_config: str | None = None  # named architecture for load_format=dummy (llama-3.2-1b, ...)
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto = cuda when available, else cpu
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None  # fixes the KV pool size, overriding the memory budget
    kv_cache_memory_gib: float = 1.0  # KV budget on the CPU
    gpu_memory_utilization: float = 0.9  # share of GPU memory the engine may hold (weights + KV)
    # sequences per step and token budget of one step (decode + prefill chunks); None = by device, as vLLM
    # does: 1024 and 8192 on a CUDA device of >= 70 GiB that is not an A100 (H100, H200), else 256 and 2048
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's max position embeddings
    # fairness among tenants (the front names each request's: an API key, a client address): running sequences
    # one tenant may hold (None: max_num_seqs; while several have work each holds at most its equal share), and
    # the time budget of a step they share, as a multiple of a one-row decode step measured as the engine runs
    # (a light tenant's stream stays near its unloaded pace beside a heavy one); 0 shares tokens instead; None =
    # 1.2 on CUDA (measured: the served stream sees ~0.3 more than the core's steps), 1.5 on the CPU
    max_seqs_per_tenant: int | None = None
    shared_step_time_factor: float | None = None
    # a step's prefill chunks are cut so that its measured time stays near this (decode rows always run): a
    # request arriving during another's long prompt waits one short step; None = 0.25 s on the CPU (a 2048-token
    # step takes seconds there), 0 (off) on CUDA
    step_time_target_s: float | None = None
    enable_prefix_caching: bool = True
    prefix_hash: str = "sha256"  # sha256 | xxh128
    prefix_cache_seed: str = field(
        default_factory=lambda: os.environ.get("PAGEDCHAT_PREFIX_CACHE_SEED", "")
    )
    cache_dir: str = field(default_factory=default_cache_dir)
    num_threads: int | None = None  # torch CPU threads; None: torch's, tuned (cpu_threads.py)
    # read each step's sampled ids one step late, so that the host schedules and prepares step N+1 while
    # the device runs step N (vLLM's name); None = on for CUDA, off on the CPU (where nothing runs async)
    async_scheduling: bool | None = None
    # speculative decoding (engine/speculative/): None (off) | ngram (drafts from the request's own tokens: its
    # prompt, which for a session turn holds the earlier turns, and its reply so far), verified k + 1 positions a
    # step; greedy output is unchanged, sampling keeps its distribution. A step with drafts runs in step with the
    # host (its tokens are read before the next step is scheduled); the others keep async scheduling
    speculative: str | None = None
    # speculative="draft"'s model (implies it): a smaller model with the target's tokenizer (a directory, .gguf
    # file or hub id; with load_format=dummy a named architecture), its KV in the target's blocks (draft_model.py)
    speculative_model: str | None = None
    num_speculative_tokens: int = (
        4  # the most drafts a sequence gets in a step (fewer where they miss)
    )
    # steps with more decode rows than this run without drafts (a large batch is not held back by a draft's rows)
    speculative_max_batch: int = 8
    enforce_eager: bool = False  # CUDA: run every step eagerly (no CUDA graphs for decode steps)
    # CUDA: after the graphs are captured, run one scratch step of each shape class the scheduler can produce
    # (engine/worker/warm_up.py), so that Triton compiles every kernel variant (or loads it from its on-disk cache)
    # at start-up, before the first request, not inside it; off: a faster start, slower first steps
    warm_up: bool = True
    # decode-only batches up to this size are padded to a ladder of sizes and, on CUDA, replayed as CUDA graphs
    # (padding is what lets eager and graph runs compute the same shapes); None = 256 on CUDA, 0 (off) on CPU
    max_graph_batch_size: int | None = None
    # how a sequence preempted for want of KV blocks comes back: recompute (its KV is dropped and computed
    # again), swap (its blocks are copied to a host pool of swap_space_gib and back), or auto: swap a sample
    # or beam of a request with n > 1 or beam search (the paper's rule: with all its request's running sequences)
    # and a sequence whose recompute costs more than its copy
    preemption_mode: str = "auto"
    swap_space_gib: float = 4.0  # host memory for swapped-out KV blocks (pinned on CUDA)
    # host memory for the host tier of the prefix cache: cached blocks evicted from the device pool are copied
    # there (LRU) and copied back on a later prefix hit instead of computed again; 0 = off
    host_cache_gib: float = 0.0
    # the disk tier of the prefix cache (engine/kv_tiers/): full blocks of session turns (and blocks leaving the host
    # tier) written as checksummed files keyed by chain hash and a fingerprint of what shapes their bytes, read back
    # on a later prefix hit (after a restart too); LRU within kv_disk_size bytes (0: off); the directory defaults
    # to <cache_dir>/kv
    kv_disk_path: str | None = field(
        default_factory=lambda: os.environ.get("PAGEDCHAT_KV_DISK_PATH") or None
    )
    kv_disk_size: int = field(
        default_factory=lambda: _env_bytes("PAGEDCHAT_KV_DISK_SIZE", 2 * 2**30)
    )
    # Redis as a shared KV tier (replicas and restarts share blocks): redis://host:port/db; None: off
    kv_redis_url: str | None = field(
        default_factory=lambda: os.environ.get("PAGEDCHAT_KV_REDIS_URL") or None
    )
    # who owns the KV memory: paged (block tables over a block pool) or vattention (CUDA only: each request's
    # KV contiguous in virtual memory, physical pages of the driver's granularity mapped on demand; the block
    # size becomes the tokens of one page, e.g. 2048 for llama-3.2-1b in bf16)
    kv_backend: str = "paged"
    # the KV cache's element type: auto (the model dtype) | fp8 (float8 e4m3, torch.float8_e4m3fn: one byte, so a
    # block takes half the memory of bfloat16 and the pool holds twice the blocks). Each attention layer stores
    # clamp(x / scale, -448, 448) rounded to e4m3 and reads it back times scale, with per-layer K and V scales of
    # 1.0 (vLLM's default without calibrated scales): values beyond +-448 are clipped, relative rounding error is
    # at most 2^-4 (3 mantissa bits), and below 2^-6 the step is an absolute 2^-9. CUDA: compute capability 8.9+
    kv_cache_dtype: str = "auto"
    # how the CPU stores linear weights (activations stay float32): float32 | bfloat16 | int8 (per channel) |
    # q4 (4-bit groups of 32, a Q4_1 GGUF's own blocks); auto = q4 for a model shipped as Q4_1 GGUF (the
    # default model: the file's own weights, fastest), float32 otherwise. CUDA: float32 (= the model dtype) only
    cpu_weights: str = "auto"
    # the instruction-set level of the native CPU kernels (kernels/cpu_native.py): auto (the highest this CPU
    # has) | avx2 | avx512 | avx512_vnni; a level the CPU lacks is refused ($PAGEDCHAT_CPU_ISA when set)
    cpu_isa: str = field(default_factory=lambda: os.environ.get("PAGEDCHAT_CPU_ISA") or "auto")
    # tensor parallelism: each layer split over this many devices, one process each (the engine core is rank 0 and
    # starts the others; engine/worker/worker_group.py): cuda:0 .. N-1 over NCCL, or N processes on the CPU over gloo
    tensor_parallel_size: int = 1
    # how the ranks' partial sums are added on CUDA: auto (small all-reduces, a decode step's, through PyTorch's
    # symmetric memory in one kernel with one barrier, and the logits written straight into rank 0's, when the
    # GPUs reach each other's memory; NCCL for the rest) | two_shot (auto with the earlier two-barrier kernel)
    # | nccl
    all_reduce: str = "auto"
    # the server's streams: a reader is woken once this many tokens are ready for it (or a sample's first or
    # last), for fewer, larger events; 1 = every step's tokens as soon as they come (a reader that is behind
    # still gets all that is ready in one event)
    stream_interval: int = 1
    # the engine core logs a line of its own numbers this often while it works (steps/s, step time, tokens/s,
    # running/waiting, KV usage, prefix hit rate; vLLM's periodic stats line); 0: never
    log_stats_interval_s: float = 10.0

    # derived
    hf_config: Any = field(default=None, repr=False)
    model_path: str | None = None
    model_id: str = ""
    # (resolve(): torch.dtype and torch.device; None until then)
    torch_dtype: Any = None
    torch_device: Any = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(self.load_format in LOAD_FORMATS, "load_format", f"must be one of {LOAD_FORMATS}")
        _check(
            self.dtype == "auto" or self.dtype in DTYPES,
            "dtype",
            f"must be auto or one of {tuple(DTYPES)}",
        )
        _check(self.prefix_hash in PREFIX_HASHES, "prefix_hash", f"must be one of {PREFIX_HASHES}")
        _check(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            "must be a positive power of two",
        )
        _check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1"
        )
        _check(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", "must be > 0")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            "must be >= 1",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2"
        )
        _check(
            self.max_seqs_per_tenant is None or self.max_seqs_per_tenant >= 1,
            "max_seqs_per_tenant",
            "must be >= 1",
        )
        _check(
            self.shared_step_time_factor in (None, 0) or 1 <= self.shared_step_time_factor <= 100,
            "shared_step_time_factor",
            "must be 0 (share tokens) or in [1, 100]",
        )
        _check(
            self.step_time_target_s is None or 0 <= self.step_time_target_s <= 60,
            "step_time_target_s",
            "must be in [0, 60] (0: off)",
        )
        _check(
            self.load_format != "dummy" or self.model_config is not None or self.model is not None,
            "model_config",
            "load_format=dummy needs a named architecture (model_config) or a model dir",
        )
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        _check(
            self.max_graph_batch_size is None or self.max_graph_batch_size >= 0,
            "max_graph_batch_size",
            "must be >= 0",
        )
        _check(
            self.preemption_mode in PREEMPTION_MODES,
            "preemption_mode",
            f"must be one of {PREEMPTION_MODES}",
        )
        _check(self.swap_space_gib >= 0, "swap_space_gib", "must be >= 0")
        _check(self.host_cache_gib >= 0, "host_cache_gib", "must be >= 0")
        _check(
            0 <= self.kv_disk_size <= 2**50, "kv_disk_size", "must be in [0, 1 PiB] bytes (0: off)"
        )
        _check(
            self.kv_redis_url is None
            or self.kv_redis_url.startswith(("redis://", "rediss://", "unix://")),
            "kv_redis_url",
            "must be a redis://, rediss:// or unix:// URL",
        )
        _check(self.stream_interval >= 1, "stream_interval", "must be >= 1")
        _check(
            0 <= self.log_stats_interval_s <= 86400, "log_stats_interval_s", "must be in [0, 86400]"
        )
        _check(self.kv_backend in KV_BACKENDS, "kv_backend", f"must be one of {KV_BACKENDS}")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {KV_CACHE_DTYPES}",
        )
        _check(
            self.cpu_weights == "auto" or self.cpu_weights in CPU_WEIGHTS,
            "cpu_weights",
            f"must be auto or one of {CPU_WEIGHTS}",
        )
        _check(
            isinstance(self.device, str)
            and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            "device",
            f"must be auto, cpu, cuda or cuda:N (got {self.device!r})",
        )
        _check(
            self.cpu_isa in CPU_ISA_CHOICES,
            "cpu_isa",
            f"must be one of {', '.join(CPU_ISA_CHOICES)} (got {self.cpu_isa!r})",
        )
        _check_tensor_parallel(self)
        _check_speculative(self)
        _check(
            self.cpu_weights in ("auto", "float32") or self.dtype in ("auto", "float32"),
            "cpu_weights",
            f"{self.cpu_weights} weights compute with float32 activations: use dtype float32 (or auto)",
        )

    def resolve(self) -> EngineConfig:
        """Fill the fields that depend on the device (the device itself, the dtype, the step limits left to it)
        and check the options it cannot run (ValueError naming the field); the engine calls it where it runs.
        Idempotent; returns the config."""
        # (a function-level import: the device's checks import torch, which the front does not load)
        from engine.device_defaults import resolve_device_fields

        if self.torch_device is None:
            resolve_device_fields(self)
        return self

    @property
    def kv_cache_torch_dtype(self) -> Any:
        """The KV cache's element type (a torch.dtype, once resolved): the model's (auto) or float8_e4m3fn
        (fp8)."""
        import torch

        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.torch_dtype

    @property
    def kv_disk_dir(self) -> Path:
        return Path(self.kv_disk_path) if self.kv_disk_path else Path(self.cache_dir) / "kv"

    @property
    def max_blocks_per_seq(self) -> int:
        assert self.max_model_len is not None
        return -(-self.max_model_len // self.block_size)


def _check_speculative(config: EngineConfig) -> None:
    if config.speculative_model is not None and config.speculative is None:
        config.speculative = "draft"
    _check(
        config.speculative in SPECULATIVE_METHODS,
        "speculative",
        f"must be one of {', '.join(map(str, SPECULATIVE_METHODS[1:]))} or unset (off)",
    )
    _check(
        (config.speculative == "draft") == bool(config.speculative_model),
        "speculative_model",
        "a draft model is given exactly when speculative is draft",
    )
    _check(
        _is_int(config.num_speculative_tokens) and 1 <= config.num_speculative_tokens <= 16,
        "num_speculative_tokens",
        "must be in [1, 16]",
    )
    _check(
        _is_int(config.speculative_max_batch) and 1 <= config.speculative_max_batch <= 4096,
        "speculative_max_batch",
        "must be in [1, 4096]",
    )
    if not config.speculative:
        return
    _check(config.kv_backend == "paged", "speculative", "needs the paged KV backend")
    _check(
        config.tensor_parallel_size == 1,
        "speculative",
        "is not supported with tensor parallelism yet",
    )


def _check_tensor_parallel(config: EngineConfig) -> None:
    size = config.tensor_parallel_size
    _check(1 <= size <= 64, "tensor_parallel_size", "must be in [1, 64]")
    _check(
        config.all_reduce in ALL_REDUCE_CHOICES,
        "all_reduce",
        f"must be one of {', '.join(ALL_REDUCE_CHOICES)}",
    )
    if size == 1:
        return
    _check(config.kv_backend == "paged", "kv_backend", "tensor parallelism needs the paged backend")
    _check(
        config.cpu_weights in ("auto", "float32"),
        "cpu_weights",
        "tensor parallelism on the CPU runs float32 weights (the quantized kernels are single-process)",
    )


def _env_bytes(name: str, default: int) -> int:
    """A size in bytes from the environment (the command line also reads units there: app/options.py)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    _check(
        text.isdigit(),
        name,
        f"{text!r} is not a number of bytes (units are read by the command line)",
    )
    return int(text)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
