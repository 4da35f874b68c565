"""Dummy models (load_format=dummy): named architectures with the shapes of published models, and seeded random
weights under the HF names and shapes of any config. The weights are a pure function of (config, seed): tensor
``name`` draws from a generator seeded with seed * 1_000_003 + crc32(name).
"""

from __future__ import annotations

import zlib
from typing import Any, Iterator

import torch

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Named architectures for load_format=dummy (shapes of the published models; see WORKLOADS.md).
DUMMY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        intermediate_size=8192,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        intermediate_size=3072,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        intermediate_size=14336,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=[128001, 128009],
    ),
    # Qwen3-30B-A3B: 128 experts, 8 per token (3.3B parameters active of 30.5B), and its dense twin of the same
    # active size (the experts' 8 x 768 intermediate columns as one dense MLP)
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen3-30b-a3b-dense": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        intermediate_size=6144,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # Gemma 3 1B: five sliding-window layers (512 tokens) for each global one
    "gemma-3-1b": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_size=1152,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        intermediate_size=6912,
        sliding_window=512,
        query_pre_attn_scalar=256,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=2,
        eos_token_id=[1, 106],
    ),
    # 70.6B parameters, 141 GB in bf16: more than one GPU holds (tensor parallelism)
    "llama-3-70b": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        intermediate_size=28672,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=[128001, 128009],
    ),
}


def dummy_hf_config(name: str) -> Any:
    from transformers import AutoConfig

    if name not in DUMMY_ARCHITECTURES:
        raise ValueError(
            f"model_config: unknown architecture {name!r}; known: {sorted(DUMMY_ARCHITECTURES)}"
        )
    spec = dict(DUMMY_ARCHITECTURES[name])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def dummy_weights(
    hf_config: Any, seed: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded random weights under the HF names and shapes of ``hf_config``: N(0, 0.02) matrices and
    embeddings, norms near 1, small biases. The same (config, seed) gives the same tensors, so the
    transformers implementation can be loaded with them for comparison."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    # a model directory's config.json, read as a namespace
    if not isinstance(hf_config, PretrainedConfig):
        fields = dict(vars(hf_config))
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        shapes = {
            name: t.shape
            for name, t in AutoModelForCausalLM.from_config(hf_config).state_dict().items()
        }
    if getattr(hf_config, "tie_word_embeddings", False):
        # the embedding itself; a second tensor would overwrite it
        shapes.pop("lm_head.weight", None)
    for name, shape in shapes.items():
        gen = torch.Generator(device=device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            tensor.uniform_(0.8, 1.2, generator=gen)
        elif name.endswith(".bias"):
            tensor.normal_(0.0, 0.01, generator=gen)
        else:
            tensor.normal_(0.0, 0.02, generator=gen)
        yield name, tensor
