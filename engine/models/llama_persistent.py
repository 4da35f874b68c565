"""The Llama-family decode step on a GPU through the persistent kernel (kernels/persistent_decode.py): every
decoder layer in one launch, where it measured faster than the layer path (issue 26).

A pass takes it when all of these hold, else the module path runs unchanged:
- the model: no q/k/v, o or MLP bias, no q/k norm (Llama, Mistral), head dim 64, one rank, no quantized CPU pass;
- the device and cache: CUDA of compute capability 9.0 (H100, H200: where it was measured), bfloat16 or float16
  weights, the paged KV backend with a cache of the model's dtype (not FP8, not vAttention's slots), and the
  kernel's tiling dividing the model's sizes;
- the pass: decode tokens only, at most ``MAX_ROWS`` of them, the kernel's limit (benchmarks/persistent_decode.py
  on an H100, llama-3.2-1b at context 700: 1.05x the layer path at one sequence, 1.06x at two, 1.05x at four,
  1.06x at eight, 1.03x at sixteen; docs/BENCHMARKS.md, ninth session);
- ``PAGEDCHAT_PERSISTENT_DECODE`` is not ``off`` (``auto``, the default: where the above hold).

The kernel reads the layers' weights and caches where they lie (a table of their offsets), so the stack is
rebuilt whenever the cache is allocated again (``LlamaForCausalLM.bind_persistent_decode``). It replaces the
decoder layers only: the model embeds the tokens before it and applies the final norm after it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.forward_context import AttentionMetadata
from kernels import ops as kernel_ops
from kernels.decoder_stack import DecoderStack, LayerTensors

from engine.models.llama_args import LlamaArgs

if TYPE_CHECKING:
    from kernels.persistent_decode import PersistentConfig

# decode rows up to which the persistent kernel measured faster (see the module docstring)
MAX_ROWS = 16
_DTYPES = (torch.bfloat16, torch.float16)


def switched_on() -> bool:
    """``PAGEDCHAT_PERSISTENT_DECODE``: ``auto`` (default) or ``off``; anything else is a ValueError."""
    value = os.environ.get("PAGEDCHAT_PERSISTENT_DECODE", "auto")
    if value not in ("auto", "off"):
        raise ValueError(f"PAGEDCHAT_PERSISTENT_DECODE: must be auto or off, not {value!r}")
    return value == "auto"


class LlamaPersistentDecoder:
    """A LlamaModel's decoder layers bound for the persistent kernel: ``takes`` says whether a pass is one it
    runs, ``forward`` runs every layer over the embedded tokens (what the layer loop gives before the final
    norm)."""

    def __init__(
        self, layers: Sequence[nn.Module], stack: DecoderStack, config: PersistentConfig | None
    ) -> None:
        self.stack, self.config = stack, config
        first = layers[0].self_attn
        self.cos_cache, self.sin_cache = first.rotary.cos_cache, first.rotary.sin_cache
        self.scale = first.attn.scale

    def takes(self, num_tokens: int, meta: AttentionMetadata | None) -> bool:
        return (
            meta is not None
            and meta.slot_ids is None
            and meta.num_decodes == num_tokens
            and not meta.rows_share_sequences
            and 1 <= num_tokens <= MAX_ROWS
        )

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``h``: the embedded tokens, updated in place through every layer (and returned)."""
        kernel_ops.persistent_decode(
            h,
            self.stack,
            positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.context_lens,
            self.cos_cache,
            self.sin_cache,
            self.scale,
            self.config,
        )
        return h


def persistent_decoder(
    layers: Sequence[nn.Module], args: LlamaArgs, tp_size: int
) -> LlamaPersistentDecoder | None:
    """The decoder for a LlamaModel's ``layers`` (their attention bound to their paged caches) where the model,
    device and cache qualify (module docstring), else None."""
    if not _qualifies(layers, args, tp_size):
        return None
    from kernels.persistent_decode import PersistentConfig, fits  # (imports Triton: GPU only)

    config = PersistentConfig()
    sizes = (
        args.hidden_size,
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        args.intermediate_size,
    )
    if not fits(*sizes, config):
        return None
    try:
        stack = DecoderStack(
            [_tensors(layer) for layer in layers],
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            args.rms_norm_eps,
        )
    except ValueError:  # a layout the kernel does not read (a strided or misaligned tensor)
        return None
    return LlamaPersistentDecoder(layers, stack, config)


def _qualifies(layers: Sequence[nn.Module], args: LlamaArgs, tp_size: int) -> bool:
    first = layers[0].self_attn
    weight, cache = first.qkv_proj.weight, first.attn.k_cache
    return (
        switched_on()
        and tp_size == 1
        and not (args.qkv_bias or args.o_bias or args.mlp_bias or args.qk_norm or args.window)
        and args.head_dim == 64
        and weight.device.type == "cuda"
        and torch.cuda.get_device_capability(weight.device) == (9, 0)
        and weight.dtype in _DTYPES
        and cache.dtype == weight.dtype
        and cache.dim() == 4  # [blocks, block_size, kv_heads, head_dim]
        and cache.numel() > 0
    )


def _tensors(layer: nn.Module) -> LayerTensors:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerTensors(
        qkv=attn.qkv_proj.weight,
        o=attn.o_proj.weight,
        gate_up=mlp.gate_up_proj.weight,
        down=mlp.down_proj.weight,
        norm_in=layer.input_layernorm.weight,
        norm_post=layer.post_attention_layernorm.weight,
        k_cache=attn.attn.k_cache,
        v_cache=attn.attn.v_cache,
    )
