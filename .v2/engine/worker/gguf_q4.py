"""The 4-bit blocks of a Q4_1 GGUF under Hugging Face tensor names, kept beside the converted model.

transformers de-quantizes a GGUF into float32 (what the converted safetensors hold); ``--cpu-weights q4`` computes
with the file's own 4-bit blocks instead. They are read once from the GGUF (no transformers, ~3 s) into
``model.q4_1.safetensors`` in the converted directory; later starts read that file. Rows of the query and key
projections are put in Hugging Face's order, as transformers' GGUF loader does for Llama (llama.cpp stores
them interleaved for its rotary layout); rows move whole, so every 32-weight block stays intact.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.layers.quantized_linear import Q4_GROUP, Q4Blocks

Q4_FILE = "model.q4_1.safetensors"
_BLOCK_BYTES = 4 + Q4_GROUP // 2  # float16 d, float16 m, 16 bytes of codes
_HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def blocks_from_gguf_bytes(data: np.ndarray, rows: int, cols: int) -> Q4Blocks:
    """Q4_1 tensor bytes ``[rows, cols / 32 * 20]`` -> blocks. Within a block, code j sits in byte j's low
    nibble and code j + 16 in its high nibble."""
    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).view(
        rows, cols // Q4_GROUP, _BLOCK_BYTES
    )
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = raw[..., 2:4].contiguous().view(torch.float16)[..., 0]
    codes = raw[..., 4:]
    q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).reshape(rows, cols)
    return Q4Blocks(q.contiguous(), d.contiguous(), m.contiguous())


def _hf_row_order(blocks: Q4Blocks, num_heads: int) -> Q4Blocks:
    """llama.cpp's rotary row order -> Hugging Face's (per head: the two halves' rows de-interleaved)."""

    def reorder(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        return (
            t.reshape(num_heads, n // num_heads // 2, 2, *t.shape[1:])
            .transpose(1, 2)
            .reshape(t.shape)
        )

    return Q4Blocks(
        reorder(blocks.q).contiguous(),
        reorder(blocks.d).contiguous(),
        reorder(blocks.m).contiguous(),
    )


def read_gguf_q4(gguf_file: Path) -> dict[str, Q4Blocks]:
    """Every Q4_1 tensor of a Llama-architecture GGUF, by its Hugging Face name."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(gguf_file)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    if arch != "llama":
        raise ValueError(
            f"cpu_weights: q4 blocks are read from Llama GGUF files only (this one: {arch})"
        )
    heads = int(reader.fields["llama.attention.head_count"].parts[-1][0])
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].parts[-1][0])
    found: dict[str, Q4Blocks] = {}
    for tensor in reader.tensors:
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor.name)
        if (
            tensor.tensor_type != GGMLQuantizationType.Q4_1
            or not match
            or match[2] not in _HF_NAMES
        ):
            continue
        cols, rows = (int(x) for x in tensor.shape)
        blocks = blocks_from_gguf_bytes(tensor.data, rows, cols)
        if match[2] in ("attn_q", "attn_k"):
            blocks = _hf_row_order(blocks, heads if match[2] == "attn_q" else kv_heads)
        found[f"model.layers.{match[1]}.{_HF_NAMES[match[2]]}.weight"] = blocks
    return found


def save_q4(blocks: dict[str, Q4Blocks], path: Path) -> None:
    """Two codes per byte (even column low nibble), with their scales and minimums."""
    tensors = {}
    for name, b in blocks.items():
        tensors[f"{name}.codes"] = (b.q[:, 0::2] | (b.q[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.d"], tensors[f"{name}.m"] = b.d, b.m
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pagedchat-q4_1"})
    tmp.rename(path)


def load_q4(path: Path) -> dict[str, Q4Blocks]:
    found: dict[str, Q4Blocks] = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for key in f.keys():
            if key.endswith(".codes"):
                name = key[: -len(".codes")]
                packed = f.get_tensor(key)
                q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
                found[name] = Q4Blocks(q, f.get_tensor(f"{name}.d"), f.get_tensor(f"{name}.m"))
    return found
