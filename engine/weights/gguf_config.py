"""A GGUF file's metadata as the Hugging Face config of the same model (the attributes our model classes read),
per architecture, with what llama.cpp keeps in code rather than in the file (Gemma 3's layer pattern and local
rotary base, its attention scale).

llama.cpp's keys: ``{arch}.block_count``, ``.embedding_length``, ``.feed_forward_length``, ``.context_length``,
``.attention.head_count`` / ``head_count_kv`` / ``key_length`` / ``layer_norm_rms_epsilon`` /
``sliding_window``, ``.rope.freq_base`` / ``dimension_count`` / ``scaling.*``, ``.expert_count``,
``.expert_used_count``, ``.expert_feed_forward_length``; ``tokenizer.ggml.*`` for the special tokens.
"""

from __future__ import annotations

from typing import Any

from engine.weights.gguf_file import GGUFFile

# GGUF architecture -> (HF model_type, HF architecture)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# Gemma 3 in llama.cpp (src/llama-model.cpp): every sixth layer global, the others sliding with rotary base 1e4
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_BASE = 10000.0


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json of the model in ``gguf``; ValueError naming ``model`` for an architecture we do not run."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model: {gguf.path.name} is a {arch!r} GGUF; pagedchat runs {', '.join(ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = gguf.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"model: {gguf.path.name} has no {arch}.{name}")
        return value

    model_type, architecture = ARCHITECTURES[arch]
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = gguf.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": int(gguf.get(f"{arch}.vocab_size") or len(tokens or [])),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", 0)),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "rope_parameters": _rope(gguf, arch),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "gemma3":
        config.update(_gemma3(gguf, config))
    if arch == "qwen3moe":
        config.update(
            num_local_experts=int(key("expert_count")),
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=int(key("expert_feed_forward_length")),
            norm_topk_prob=True,  # (llama.cpp's qwen3moe graph normalizes the top-k weights)
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return config


def _rope(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    scaling = gguf.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(gguf.get(f"{arch}.rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise ValueError(f"model: rope scaling {scaling!r} of {gguf.path.name} is not supported")
    if "rope_freqs.weight" in gguf.tensors:  # Llama 3.1's scaled frequencies, stored as divisors
        factors = gguf.tensors["rope_freqs.weight"].data.view("<f4")
        params.update(rope_type="factors", factors=[float(f) for f in factors])
    return params


def _gemma3(gguf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    kinds = [
        "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention"
        for i in range(layers)
    ]
    rope = config["rope_parameters"]
    # llama.cpp scales attention by 1 / sqrt(head_dim), except the 27B model's hidden / heads
    scalar = config["head_dim"]
    if layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "layer_types": kinds,
        "sliding_window": int(gguf.get("gemma3.attention.sliding_window")),
        "rope_parameters": {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_BASE},
        },
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
