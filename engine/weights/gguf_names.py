"""GGUF tensor names (llama.cpp's) -> the Hugging Face names our model classes load, and the one layout change
llama.cpp's converter makes: for the ``llama`` architecture (Llama, Mistral) it interleaves the rows of the query
and key projections for its rotary layout; they are put back in Hugging Face's order here, whole rows at a time,
so every block stays intact (transformers' GGUF loader does the same).
"""

from __future__ import annotations

import re

import torch

from engine.weights.gguf_blocks import GGUFBlocks

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# per layer: llama.cpp's name -> the HF module path under model.layers.N
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma 3 has four norms per layer: llama.cpp's ffn_norm is its pre-feedforward norm
_GEMMA3 = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps gate and up as one tensor
_PHI3 = {"ffn_up": "mlp.gate_up_proj"}
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# tensors the model computes itself (rotary tables)
SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF name of a GGUF tensor; None for tensors our models do not load (rotary factors)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    if gguf_name in SKIPPED:
        return None
    match = _NAME.fullmatch(gguf_name)
    if match is None:
        raise ValueError(f"weights: unexpected GGUF tensor {gguf_name!r} for architecture {arch}")
    layer, kind, suffix = match.groups()
    table = {**_LAYER, **(_GEMMA3 if arch == "gemma3" else {}), **(_PHI3 if arch == "phi3" else {})}
    if kind not in table:
        raise ValueError(f"weights: unexpected GGUF tensor {gguf_name!r} for architecture {arch}")
    return f"model.layers.{layer}.{table[kind]}.{suffix}"


def needs_unpermute(arch: str, name: str) -> bool:
    return arch in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name)


def hf_row_order(rows: int, heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """llama.cpp's row order -> Hugging Face's, for a projection of ``heads`` heads: per head, the rows taken in
    pairs (2i, 2i + 1) are de-interleaved into the two halves (i, i + head_dim / 2)."""
    order = torch.arange(rows, device=device).view(heads, rows // heads // 2, 2)
    return order.transpose(1, 2).reshape(rows)


def unpermuted(weight: torch.Tensor | GGUFBlocks, heads: int) -> torch.Tensor | GGUFBlocks:
    if isinstance(weight, GGUFBlocks):
        return weight.reorder_rows(hf_row_order(weight.shape[0], heads, weight.data.device))
    return weight.index_select(0, hf_row_order(weight.shape[0], heads, weight.device))
