"""A two-layer Llama's HF config, the draft model of the speculative decoding tests: written as a directory for
dummy weights (``load_format=dummy`` reads its shapes) or given to transformers for random real weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA3_VOCAB = 128256  # (llama-3.2-1b's, the GPU tests' model: the same tokenizer)


def two_layer_llama_config(**overrides: Any) -> dict[str, Any]:
    """The config (llama-3's vocabulary and ids by default); ``overrides`` replace any field."""
    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=LLAMA3_VOCAB,
        intermediate_size=512,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
    )
    return {**config, **overrides}


def two_layer_llama_dir(path: Path, **overrides: Any) -> Path:
    """A directory holding only that config (dummy weights of its shapes)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(two_layer_llama_config(**overrides)))
    return path
