"""LlamaArgs: the shape of a Llama-family model (Llama, Mistral, Qwen2, Qwen3), read from its Hugging Face config,
and one tensor-parallel rank's shard of it; the model code (llama.py) and its persistent decode path
(llama_persistent.py) read it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.layers.rotary import rope_parameters


@dataclass(slots=True, frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: dict[str, Any]
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    window: int = 0  # every layer's sliding window (Mistral, Phi-3 configs that set one); 0: none

    @classmethod
    def from_hf(cls, cfg: Any) -> "LlamaArgs":
        model_type = cfg.model_type
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        rope = rope_parameters(cfg)
        if (
            float(
                rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
            )
            < 1
        ):
            raise ValueError(
                "model: a partial rotary embedding (partial_rotary_factor < 1, e.g. Phi-4-mini) is not "
                "supported"
            )
        window = getattr(cfg, "sliding_window", None) if model_type in ("mistral", "phi3") else None
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position=cfg.max_position_embeddings,
            rope=rope,
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            window=int(window or 0),
        )

    def sharded(self, size: int) -> "LlamaArgs":
        """One rank's shape of ``size``: its heads, kv heads (one each where the ranks outnumber them: then
        replicated) and intermediate columns; ValueError naming tensor_parallel_size where they do not divide."""
        if size == 1:
            return self
        problems = []
        if self.num_heads % size:
            problems.append(f"{self.num_heads} attention heads")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} kv heads (nor do they divide it)")
        if self.intermediate_size % size:
            problems.append(f"intermediate size {self.intermediate_size}")
        if problems:
            raise ValueError(
                f"tensor_parallel_size: {size} does not divide the model's " + ", ".join(problems)
            )
        return replace(
            self,
            num_heads=self.num_heads // size,
            num_kv_heads=max(1, self.num_kv_heads // size),
            intermediate_size=self.intermediate_size // size,
        )
