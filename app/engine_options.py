"""The engine's options, one per field of EngineConfig (engine/config.py): the flags of ``pagedchat serve`` and
``pagedchat chat`` that shape the model, the KV cache and the steps (an Option: app/options.py)."""

from __future__ import annotations

from app.options import Option

DUMMY_MODELS = (
    "llama-3.2-1b",
    "qwen3-0.6b",
    "llama-3-8b",
    "llama-3-70b",
    "qwen3-30b-a3b",
    "qwen3-30b-a3b-dense",
    "gemma-3-1b",
)

ENGINE_OPTIONS = (
    Option(
        "model",
        "The model (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3, Phi-3: docs/MODELS.md): a local Hugging "
        "Face directory, a local .gguf file (served from the file in its own block formats; its config and "
        "tokenizer described once into --cache-dir), or a hub id such as Qwen/Qwen3-0.6B (downloaded once; "
        "the hub cache with HF_HUB_OFFLINE=1)",
        "the embedded SmolLM2-135M-Instruct",
        env="PAGEDCHAT_MODEL",
    ),
    Option(
        "load_format",
        "Where weights come from: the model's files, or seeded random weights of --model-config "
        "(for speed work; no tokenizer: token-id prompts only)",
        "auto",
        choices=("auto", "dummy"),
    ),
    Option(
        "model_config",
        "The architecture of dummy weights (--load-format dummy)",
        "none",
        choices=DUMMY_MODELS,
    ),
    Option(
        "dtype",
        "The model's dtype; auto is bfloat16 on a GPU and float32 on the CPU",
        "auto",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Option(
        "device",
        "Where the model runs; auto is CUDA when there is a GPU",
        "auto",
        choices=("auto", "cpu", "cuda"),
    ),
    Option("seed", "Seed of the dummy weights and of sampling without a request seed", "0", "int"),
    Option("block_size", "Tokens per KV block (a power of two)", "16", "int"),
    Option(
        "num_kv_blocks",
        "Fix the KV pool at this many blocks instead of sizing it from memory",
        "sized from memory",
        "int",
    ),
    Option("kv_cache_memory_gib", "KV cache budget on the CPU, in GiB", "1.0", "float"),
    Option(
        "gpu_memory_utilization",
        "Share of GPU memory the engine may hold, weights and KV together (0 to 1]",
        "0.9",
        "float",
    ),
    Option(
        "max_num_seqs",
        "Most sequences in one step",
        "1024 on a GPU of >= 70 GiB (not A100), else 256",
        "int",
    ),
    Option(
        "max_num_batched_tokens",
        "Token budget of one step (decodes plus prefill chunks)",
        "8192 on a GPU of >= 70 GiB (not A100), else 2048",
        "int",
    ),
    Option(
        "max_model_len",
        "Longest sequence, prompt plus output, in tokens",
        "the model's (capped by the KV pool)",
        "int",
    ),
    Option(
        "max_seqs_per_tenant",
        "Running sequences one tenant (an API key, or a client address without keys) may "
        "hold; while several have work, each holds at most its equal share of --max-num-seqs",
        "--max-num-seqs",
        "int",
    ),
    Option(
        "shared_step_time_factor",
        "While several tenants have work, a step takes at most this multiple of a "
        "one-row step's time (measured as the engine runs), shared fairly among them; 0: share the token "
        "budget instead",
        "1.5 on the CPU, 1.2 on CUDA",
        "float",
    ),
    Option(
        "step_time_target_s",
        "While a stream decodes beside a prompt, the prompt's chunks are cut so that a step's measured "
        "time stays near this (decode rows always run; a chunk never below the size whose work equals a "
        "step's fixed cost), so the stream's next token waits one short step; a lone prompt takes the "
        "step's whole token budget; 0: off",
        "0.25 on the CPU, 0 on CUDA",
        "float",
    ),
    Option(
        "enable_prefix_caching",
        "Keep full KV blocks keyed by a hash of their tokens, so shared prefixes are computed once",
        "on",
        "bool",
    ),
    Option(
        "prefix_hash", "The prefix blocks' hash function", "sha256", choices=("sha256", "xxh128")
    ),
    Option(
        "prefix_cache_seed",
        "A secret mixed into the prefix hashes' root (the same on every replica)",
        "empty",
        env="PAGEDCHAT_PREFIX_CACHE_SEED",
    ),
    Option(
        "cache_dir",
        "Where GGUF models' described directories (config, tokenizer), the native CPU kernels and the "
        "default sessions file are kept",
        "~/.cache/pagedchat",
        env="PAGEDCHAT_CACHE_DIR",
    ),
    Option(
        "num_threads",
        "torch's CPU threads (fixed). Unset, the engine starts at torch's choice and measures steps as it runs: "
        "while another process takes a core, half the threads are faster (a thread sharing a core stalls "
        "every barrier), so it keeps whichever count its trials find faster",
        "torch's choice, tuned",
        "int",
    ),
    Option(
        "async_scheduling",
        "Prepare and launch step N+1 while the device runs step N",
        "on with CUDA, off on the CPU",
        "bool",
    ),
    Option(
        "speculative",
        "Speculative decoding: ngram drafts a sequence's next tokens from its own tokens (the prompt, which "
        "in a session holds the earlier turns, the reply so far, and a regenerated or edited turn's earlier "
        "reply) and verifies them in one step; greedy output is unchanged and sampling keeps its "
        'distribution; a request may turn it off with "speculative": false; draft: a smaller model with the '
        "same tokenizer drafts them (--speculative-model)",
        "off",
        choices=("ngram", "draft"),
    ),
    Option(
        "speculative_model",
        "The draft model of --speculative draft (given alone, it implies it): an HF directory, a .gguf file or "
        "a hub id with this model's tokenizer, e.g. a 1B draft for an 8B model; with --load-format dummy a "
        "named architecture. Its KV cache takes a share of the KV budget",
        "none",
    ),
    Option(
        "num_speculative_tokens",
        "With --speculative: the most draft tokens a sequence gets in one step, 1 to 16 (fewer where its "
        "drafts have been missing)",
        "4",
        "int",
    ),
    Option(
        "speculative_max_batch",
        "With --speculative: a step of more decode rows than this runs without drafts, 1 to 4096 (at a "
        "large batch the draft rows cost more than they save)",
        "8",
        "int",
    ),
    Option("enforce_eager", "Run every step eagerly: no CUDA graphs", "off", "bool"),
    Option(
        "warm_up",
        "CUDA: at start-up, run a scratch step of each shape the scheduler can produce, so Triton compiles its "
        "kernels (or loads them from TRITON_CACHE_DIR) before the first request rather than during it",
        "on",
        "bool",
    ),
    Option(
        "max_graph_batch_size",
        "Decode-only batches up to this size are padded and replayed as CUDA graphs",
        "256 with CUDA, 0 (off) on the CPU",
        "int",
    ),
    Option(
        "preemption_mode",
        "How a sequence preempted for want of KV blocks comes back: computed again, or "
        "swapped to host memory and back (auto: swap where the copy is cheaper, and n > 1 or beam requests)",
        "auto",
        choices=("recompute", "swap", "auto"),
    ),
    Option("swap_space_gib", "Host memory for swapped-out KV blocks, in GiB", "4.0", "float"),
    Option(
        "host_cache_gib",
        "Host tier of the prefix cache, in GiB: evicted cached blocks are kept in host "
        "memory and copied back on a hit (0: off)",
        "0.0",
        "float",
    ),
    Option(
        "kv_disk_path",
        "The directory of the disk tier of the prefix cache: full KV blocks as checksummed files, "
        "read back on a later prefix hit (after a restart too)",
        "kv in --cache-dir",
        env="PAGEDCHAT_KV_DISK_PATH",
    ),
    Option(
        "kv_disk_size",
        "Most bytes the disk tier keeps (least recently used blocks go first; 0: the tier is off)",
        "2GiB",
        "bytes",
        env="PAGEDCHAT_KV_DISK_SIZE",
    ),
    Option(
        "kv_redis_url",
        "Keep KV blocks in this Redis too (redis://, rediss:// or unix://), shared by replicas and "
        "restarts; bound it with the Redis's own maxmemory and an LRU policy",
        "none",
        env="PAGEDCHAT_KV_REDIS_URL",
    ),
    Option(
        "kv_backend",
        "Who owns the KV memory: block tables over a block pool, or (CUDA) each request "
        "contiguous in virtual memory with pages mapped on demand",
        "paged",
        choices=("paged", "vattention"),
    ),
    Option(
        "kv_cache_dtype",
        "The KV cache's element type: auto is the model's dtype; fp8 stores float8 e4m3 (half "
        "the bytes of bfloat16: twice the KV blocks), per-layer scales 1.0 (values clipped at +-448); CUDA needs "
        "compute capability 8.9+",
        "auto",
        choices=("auto", "fp8"),
    ),
    Option(
        "cpu_weights",
        "How the CPU stores linear weights (activations stay float32): file keeps a GGUF model's own "
        "block formats (Q4_K, Q6_K, Q8_0, ...: the default for .gguf models, the default model "
        "included), float32 de-quantizes them, q4 and int8 round float weights; auto is file for a "
        "GGUF model and float32 for others",
        "auto",
        choices=("auto", "file", "float32", "bfloat16", "int8", "q4"),
    ),
    Option(
        "cpu_isa",
        "Instruction-set level of the native CPU kernels (generic: plain C++ for any x86-64 or ARM CPU); "
        "a level this CPU lacks is refused",
        "auto (the highest this CPU has)",
        choices=("auto", "generic", "avx2", "avx512", "avx512_vnni"),
        env="PAGEDCHAT_CPU_ISA",
    ),
    Option(
        "tensor_parallel_size",
        "Split each layer of the model over this many devices, one process each "
        "(cuda:0 .. N-1 over NCCL; on the CPU, N processes over gloo)",
        "1",
        "int",
    ),
    Option(
        "all_reduce",
        "How tensor-parallel ranks add their partial sums on CUDA: auto sends a decode step's "
        "small all-reduces through symmetric memory (one kernel over NVLink, one barrier each) and "
        "writes the logits straight into rank 0's, NCCL the rest; two_shot is auto with the earlier "
        "two-barrier kernel (for comparison); nccl sends all through NCCL",
        "auto",
        choices=("auto", "two_shot", "nccl"),
    ),
    Option(
        "stream_interval",
        "A stream's reader is woken once this many tokens are ready (or its first, or its "
        "last): fewer, larger SSE events",
        "1",
        "int",
    ),
    Option(
        "log_stats_interval_s",
        "While it works, the engine core logs a line of its numbers this often, in "
        "seconds (0: never)",
        "10.0",
        "float",
    ),
)
