"""Rotary position embedding (rotate-half layout), with the Llama 3 and linear frequency scalings; the
rotation itself is kernels.ops.rotary_embedding, in place."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.kv_backend.base import Rotation
from engine.forward_context import pass_memo
from kernels import cpu as cpu_kernels
from kernels import lean_cpu, ops as kernel_ops


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers 5 keeps theta and scaling in ``rope_parameters``; older configs in two attributes."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return dict(params)


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    if rope_type == "factors":  # per-frequency divisors (a GGUF's rope_freqs / rope_factors tensor)
        return inv_freq / torch.tensor(params["factors"], dtype=torch.float32)
    if (
        rope_type == "longrope"
    ):  # Phi-3's short factors (positions up to the original context), as transformers
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base**shape)
    raise ValueError(
        f"rope_parameters: rope_type {rope_type!r} is not supported "
        "(default, linear, llama3, longrope, factors)"
    )


def attention_factor(params: dict[str, Any], max_position: int) -> float:
    """LongRoPE's scale of cos and sin (transformers' default: sqrt(1 + ln(factor) / ln(original positions)) for a
    model extended ``factor`` times); 1 for every other rotary type."""
    if params.get("rope_type") not in ("longrope",) and "attention_factor" not in params:
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = float(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_position / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def position_limit(params: dict[str, Any], max_position: int) -> int:
    """The positions the rotary embedding serves: LongRoPE's short factors hold up to the original context (its
    long factors would change every earlier position's rotation, so a longer sequence is not served)."""
    if params.get("rope_type") == "longrope":
        return min(max_position, int(params["original_max_position_embeddings"]))
    return max_position


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a linear blend in between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    blend = (original_len / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        freqs = torch.outer(
            torch.arange(max_position, dtype=torch.float32), inverse_frequencies(head_dim, params)
        )
        angles = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(params, max_position)
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def rotation(self, positions: torch.Tensor) -> Rotation:
        """This embedding at ``positions``, for the KV store to apply as it stores (``KVBackend.store``)."""
        return Rotation(positions, self.cos_cache, self.sin_cache)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[T, heads, head_dim]``, ``k`` ``[T, kv_heads, head_dim]`` (strided views allowed), rotated
        in place by their positions; returns the same two tensors."""
        if lean_cpu(q):  # cos/sin rows gathered by the first layer of the pass only
            memo = pass_memo()  # (per embedding: Gemma's local and global layers have their own)
            if (plan := memo.get(("rotary", id(self)))) is None:
                plan = memo[("rotary", id(self))] = cpu_kernels.rotary_plan(
                    positions, self.cos_cache, self.sin_cache
                )
            cpu_kernels.rotary_embedding(q, k, plan)
        else:
            kernel_ops.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
        return q, k
