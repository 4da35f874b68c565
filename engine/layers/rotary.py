"""Rotary position embedding (rotate-half layout), with the Llama 3 and linear frequency scalings; the
rotation itself is kernels.ops.rotary_embedding, in place."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.kv_backend.base import QKNorm, Rotation
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


# A CPU model's tables grow by blocks of this many positions, as sequences reach further (a GPU model's hold all of
# its positions from the start: CUDA graphs and kernels keep their addresses)
CPU_POSITION_BLOCK = 2048


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's angles, as tables ``[positions, head_dim]``. On the CPU the tables cover the
    positions seen so far (a model of 32k or 128k positions served with a KV pool of a few thousand tokens would
    otherwise hold 32-128 MiB of rows it never reads); each block of rows is computed alone, so a row's floats
    are the same whenever its block was added."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.max_position = max_position
        self.inv_freq = inverse_frequencies(head_dim, params)
        self.scale = attention_factor(params, max_position)
        self.register_buffer("cos_cache", None, persistent=False)
        self.register_buffer("sin_cache", None, persistent=False)
        if torch.get_default_device().type == "cpu":
            self._grow(min(max_position, CPU_POSITION_BLOCK))
        else:
            self.cos_cache, self.sin_cache = self._rows(0, max_position)

    def _rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(start, end, dtype=torch.float32), self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos, sin

    def _grow(self, rows: int) -> None:
        have = 0 if self.cos_cache is None else self.cos_cache.shape[0]
        blocks = [
            self._rows(s, min(s + CPU_POSITION_BLOCK, rows))
            for s in range(have, rows, CPU_POSITION_BLOCK)
        ]
        if have:
            # (in the model's dtype and place, as ``model.to`` cast and moved the first tables)
            like = self.cos_cache
            blocks = [(self.cos_cache, self.sin_cache)] + [
                (c.to(like.device, like.dtype), s.to(like.device, like.dtype)) for c, s in blocks
            ]
        self.cos_cache = torch.cat([c for c, _ in blocks])
        self.sin_cache = torch.cat([s for _, s in blocks])

    def cover(self, positions: torch.Tensor) -> None:
        """Grow a CPU model's tables to hold ``positions`` (at least doubling, by whole blocks). A model built on
        the CPU and moved to a GPU gets all of its positions at its first pass (no read of ``positions`` there)."""
        rows = self.cos_cache.shape[0]
        if rows >= self.max_position or not positions.numel():
            return
        # (once per pass: every layer of a pass gets its positions)
        memo, key = pass_memo(), ("rotary-covered", id(self))
        if memo.get(key) is positions:
            return
        memo[key] = positions
        if positions.device.type != "cpu":
            self._grow(self.max_position)
            return
        needed = int(positions.max()) + 1
        if needed > rows:
            wanted = -(-max(needed, 2 * rows) // CPU_POSITION_BLOCK) * CPU_POSITION_BLOCK
            self._grow(min(self.max_position, wanted))

    def rotation(self, positions: torch.Tensor, qk_norm: QKNorm | None = None) -> Rotation:
        """This embedding at ``positions``, for the KV store to apply as it stores (``KVBackend.store``), after
        ``qk_norm`` if given."""
        self.cover(positions)
        return Rotation(positions, self.cos_cache, self.sin_cache, qk_norm)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[T, heads, head_dim]``, ``k`` ``[T, kv_heads, head_dim]`` (strided views allowed), rotated
        in place by their positions; returns the same two tensors."""
        self.cover(positions)
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
