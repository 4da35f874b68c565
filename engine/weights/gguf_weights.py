"""A GGUF file's tensors under Hugging Face names, for a model's ``load_weights``: float tensors as they are, block
formats either unpacked (QuantBlocks: the CPU computes with them as they are) or de-quantized into the model's
dtype on its device (the GPU, and the CPU's float32 / bfloat16 modes). Nothing is written to disk.

What llama.cpp's converter changed is undone: the Llama query/key row order (gguf_names.py), and Gemma's norm
weights, which GGUF stores as 1 + w (Gemma's RMSNorm scales by 1 + w, as transformers' GGUF loader undoes it too).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from engine.weights.gguf_blocks import GGUFBlocks, read
from engine.weights.gguf_file import GGUFFile
from engine.weights.gguf_names import hf_name, needs_unpermute, unpermuted

# tensors kept in the file and looked up in place by the CPU's GGUF mode (embedding rows), never read whole
IN_PLACE = ("model.embed_tokens.weight",)


def gguf_weights(
    gguf: GGUFFile,
    hf_config: Any,
    dtype: torch.dtype | None,
    device: torch.device | str = "cpu",
    skip: tuple[str, ...] = (),
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Every tensor of ``gguf`` by its HF name (but ``skip``): block formats as they are (GGUFBlocks) when
    ``dtype`` is None, else de-quantized to ``dtype``; float tensors in ``dtype`` (float32 when None). On
    ``device``."""
    arch = gguf.architecture
    for name, tensor in gguf.tensors.items():
        target = hf_name(name, arch)
        if target is None or target in skip:
            continue
        weight = read(tensor, device)
        if needs_unpermute(arch, target):
            heads = (
                hf_config.num_attention_heads
                if ".q_proj." in target
                else hf_config.num_key_value_heads
            )
            weight = unpermuted(weight, heads)
        if isinstance(weight, GGUFBlocks):
            if dtype is None:
                yield target, weight
                continue
            weight = weight.dequantize()
        if arch == "gemma3" and target.endswith("norm.weight"):
            weight = weight.float() - 1
        yield target, weight.to(dtype or torch.float32)
