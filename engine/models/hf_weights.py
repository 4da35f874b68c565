"""Hugging Face tensor names and our fused parameters: q/k/v are one ``qkv_proj`` and gate/up one ``gate_up_proj``,
each HF tensor a shard of it; reading a tensor (or this rank's part of it) and copying it in with a shape check."""

from __future__ import annotations

from typing import Any

import torch

# HF tensor name fragment -> (fused parameter fragment, shard index)
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def fused_name(name: str) -> tuple[str, int | None]:
    for fragment, (fused, shard) in FUSED.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return name, None


def hf_names(weight_name: str) -> list[str]:
    """The HF tensors a (possibly fused) weight is made of, in shard order."""
    for fused in {fused for fused, _ in FUSED.values()}:
        if f".{fused}." in weight_name:
            shards = sorted(
                (shard, fragment) for fragment, (f, shard) in FUSED.items() if f == fused
            )
            return [weight_name.replace(f".{fused}.", f".{fragment}.") for _, fragment in shards]
    return [weight_name]


def read_part(source: Any, part: tuple[int, int, int] | None) -> torch.Tensor:
    """``source`` (a tensor or a safetensors slice, which reads only what is indexed), or its ``part``."""
    if part is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    dim, start, end = part
    return source[start:end] if dim == 0 else source[:, start:end]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"weights: {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)
