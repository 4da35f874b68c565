"""GGUF files of tiny random models, written as llama.cpp's converter writes them (the tests' stand-in for a
download): llama.cpp's tensor names and metadata keys, the Llama query/key rows in its interleaved rotary order,
Gemma's norms stored as 1 + w, experts stacked per projection; matrices in a block format the gguf package can
quantize (Q8_0, Q4_0, Q4_1, Q5_0), norms in F32; and a small byte-level tokenizer (256 byte tokens and a few
control tokens) unless the caller gives a real one (``GGUFTokenizer``). Also random raw blocks of every format the engine reads (K-quants included), for kernel
tests and benchmarks. Nothing here reads pagedchat's own GGUF code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from kernels.quant_blocks import FORMATS

# transformers model_type -> GGUF architecture
ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "qwen3_moe": "qwen3moe",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
_GEMMA = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's query/key rows -> llama.cpp's (per head, the two halves interleaved)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@dataclass(frozen=True)
class GGUFTokenizer:
    """A byte-level BPE tokenizer as ``tokenizer.ggml.*`` metadata (token types are llama.cpp's: 1 normal,
    3 control, 4 user-defined, 5 unused), and the chat template."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int
    eos_token_id: int
    padding_token_id: int | None = None
    pre: str = "default"
    add_bos_token: bool | None = None
    chat_template: str | None = None


def byte_tokenizer(vocab_size: int) -> GGUFTokenizer:
    """256 byte tokens, one merge ("a b") and control tokens up to ``vocab_size``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = list(bytes_to_unicode().values()) + ["ab"]
    tokens = spelled + [f"<ctl{i}>" for i in range(vocab_size - len(spelled))]
    kinds = [1] * len(spelled) + [3] * (vocab_size - len(spelled))
    return GGUFTokenizer(tokens, kinds, ["a b"], bos_token_id=257, eos_token_id=258)


def write_gguf(
    model: torch.nn.Module,
    path: Path,
    block_type: str = "Q8_0",
    tokenizer: GGUFTokenizer | None = None,
) -> Path:
    """``model`` (a transformers CausalLM of a family above, vocab >= 259) as a GGUF file at ``path``, with
    ``tokenizer`` (default: ``byte_tokenizer``)."""
    cfg = model.config
    arch = ARCH[cfg.model_type]
    writer = GGUFWriter(str(path), arch)
    _metadata(writer, cfg, arch)
    _tokenizer_metadata(writer, tokenizer or byte_tokenizer(cfg.vocab_size))
    qtype = GGMLQuantizationType[block_type]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        for gguf_name, value in _tensors(name, tensor.detach().float(), cfg, arch):
            _add(writer, gguf_name, value.numpy(), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: GGUFWriter, name: str, value: np.ndarray, qtype: GGMLQuantizationType) -> None:
    if value.ndim == 1 or value.shape[-1] % 32:
        writer.add_tensor(name, value.astype(np.float32))
        return
    writer.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)


def _tensors(name: str, value: torch.Tensor, cfg, arch: str):
    if name == "model.embed_tokens.weight":
        yield "token_embd.weight", value
        return
    if name == "model.norm.weight":
        yield "output_norm.weight", value + 1 if arch == "gemma3" else value
        return
    if name == "lm_head.weight":
        yield "output.weight", value
        return
    _, _, layer, rest = name.split(".", 3)
    part = rest.removesuffix(".weight").removesuffix(".bias")
    if part.startswith("mlp.experts."):  # transformers' fused experts: gate/up stacked, then down
        if part.endswith("gate_up_proj"):
            half = value.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", value[:, :half]
            yield f"blk.{layer}.ffn_up_exps.weight", value[:, half:]
        else:
            yield f"blk.{layer}.ffn_down_exps.weight", value
        return
    table = {**_LAYER, **(_GEMMA if arch == "gemma3" else {})}
    kind = table[part]
    if arch == "llama" and kind in ("attn_q", "attn_k"):
        heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
        value = _permute(value, heads)
    if arch == "gemma3" and part.endswith("norm"):
        value = value + 1
    yield f"blk.{layer}.{kind}.{'bias' if name.endswith('.bias') else 'weight'}", value


def _metadata(writer: GGUFWriter, cfg, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    params = cfg.rope_parameters
    writer.add_rope_freq_base(float((params.get("full_attention") or params)["rope_theta"]))
    if arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _tokenizer_metadata(writer: GGUFWriter, tokenizer: GGUFTokenizer) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer.pre)
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.token_types)
    writer.add_token_merges(tokenizer.merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.padding_token_id is not None:
        writer.add_pad_token_id(tokenizer.padding_token_id)
    if tokenizer.add_bos_token is not None:
        writer.add_add_bos_token(tokenizer.add_bos_token)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


BLOCK_BYTES = {  # ggml's bytes per block
    "q4_0": 18,
    "q4_1": 20,
    "q5_0": 22,
    "q8_0": 34,
    "q4_k": 144,
    "q5_k": 176,
    "q6_k": 210,
}


def random_file_bytes(fmt: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw blocks of a ``[rows, cols]`` tensor: random bytes everywhere (codes, packed scales, high bits), with the
    float16 scales set to finite values of a realistic size."""
    rng = np.random.default_rng(seed)
    block = FORMATS[fmt][1]
    raw = rng.integers(0, 256, (rows, cols // block, BLOCK_BYTES[fmt]), dtype=np.uint8)
    scales = {"q6_k": [208]}.get(fmt, [0, 2] if fmt in ("q4_1", "q4_k", "q5_k") else [0])
    for at in scales:
        value = (rng.random((rows, cols // block)) * 0.02 + 1e-4).astype(np.float16)
        raw[..., at : at + 2] = value.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)
