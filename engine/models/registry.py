"""HF architecture name -> our model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


MODEL_TYPES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "phi3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(hf_config: Any) -> type[nn.Module]:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    if getattr(hf_config, "model_type", None) in MODEL_TYPES:
        return MODEL_TYPES[hf_config.model_type]
    raise ValueError(
        f"model: architecture {getattr(hf_config, 'architectures', None)} "
        f"({getattr(hf_config, 'model_type', None)}) is not supported; supported: {sorted(MODEL_CLASSES)}"
    )
