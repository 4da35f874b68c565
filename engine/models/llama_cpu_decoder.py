"""The Llama-family forward pass on the CPU with weight-only quantized projections (``--cpu-weights``), lean.

A decode step of a small model on a CPU spends more time around the matmuls than in them: per layer the module
path makes ~12 ``nn.Module`` calls and ~40 tensor ops, each a few microseconds of Python and dispatch
(profile: docs/BENCHMARKS.md, issue 15). This pass walks the same layers' tensors directly and keeps the
projections' outputs in their kernel's type instead of converting each to float32 first: a bfloat16 value
promotes exactly, so adding it to the float32 residual, rotating it by float32 cos/sin or taking float32 SiLU
of it gives the very numbers the module path computes. ``tests/kernels/test_cpu_native.py`` holds it bit-equal to the
module path, and the native decode step (kernels/cpu_decode.cpp) to it.

The residual stream, norms, rotary embedding, attention and KV cache stay float32; a projection's input is what
its kernel takes (``input_dtype``: bfloat16 for torch's weight-only kernels, float32 for the native Q4_1 x Q8
kernel, which quantizes it to 8 bits per 32 inputs itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import AttentionMetadata, get_attention_metadata
from engine.layers.quantized_linear import Q4Linear
from kernels import cpu as cpu_kernels
from kernels.cpu_native import CpuKernels


@dataclass(slots=True)
class _Layer:
    """One decoder layer's tensors and bound calls, looked up once (not per step through nn.Module)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: nn.Module
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: nn.Module
    o_bias: torch.Tensor | None
    gate_up: nn.Module
    gate_up_bias: torch.Tensor | None
    down: nn.Module
    down_bias: torch.Tensor | None
    attend: object  # PagedAttention.attend of the layer (its own KV cache, its backend's kernels)


def _bias(layer: nn.Module) -> torch.Tensor | None:
    return getattr(layer, "bias", None)


class LlamaCpuDecoder:
    """``forward(input_ids, positions) -> hidden`` for a LlamaForCausalLM whose projections have a ``matmul``
    taking their ``input_dtype`` (engine/layers/quantized_linear.py). With ``native`` kernels (of the configured
    instruction-set level, kernels/cpu_native.py), every step of a model whose projections are all 4-bit
    without biases (the default model) runs as one native call (kernels/cpu_decode.cpp), prompts too; other
    models take the Python path below."""

    def __init__(self, model: nn.Module, native: CpuKernels | None = None) -> None:
        args = model.args
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.eps = args.rms_norm_eps
        self.hidden = (args.hidden_size,)
        self.head_shape = (args.head_dim,)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        self.q_size, self.kv_size = (
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        )
        self.intermediate = args.intermediate_size
        rotary = model.model.layers[0].self_attn.rotary
        self.cos_cache, self.sin_cache = rotary.cos_cache, rotary.sin_cache
        self.layers = [self._layer(layer) for layer in model.model.layers]
        # the projections' input type: float32 for the native Q4_1 x Q8 kernel, else bfloat16
        self.act_dtype = model.model.layers[0].self_attn.qkv_proj.input_dtype
        self.attention = [layer.self_attn.attn for layer in model.model.layers]
        # (None: Python path)
        self.native_weights = self._native_weights(model) if native is not None else None
        # the step for the weights' layout: norms + 4 lists of Q4_1 x Q8 triples, or + 8 int4 pack/scale lists
        self.native_step = (
            None
            if native is None or self.native_weights is None
            else (
                native.ops.decode_layers_q8
                if len(self.native_weights) == 6
                else native.ops.decode_layers
            )
        )
        self.scale = args.head_dim**-0.5
        self._kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @staticmethod
    def _native_weights(model: nn.Module) -> list[list[torch.Tensor]] | None:
        """The native step's weight lists, or None where it does not apply (biases, q/k norms, 8-bit layers):
        the norms, then per projection the Q4_1 x Q8 layout (3 tensors per layer) where every layer has it, else
        torch's int4 pack and its scales (two lists)."""
        layers = model.model.layers
        projections = [
            (lay.self_attn.qkv_proj, lay.self_attn.o_proj, lay.mlp.gate_up_proj, lay.mlp.down_proj)
            for lay in layers
        ]
        linears = [p for group in projections for p in group]
        if any(lay.self_attn.qk_norm for lay in layers) or not all(
            isinstance(p, Q4Linear) and p.bias is None for p in linears
        ):
            return None
        weights = [
            [lay.input_layernorm.weight for lay in layers],
            [lay.post_attention_layernorm.weight for lay in layers],
        ]
        if all(p.q4q8 is not None for p in linears):
            return weights + [[t for group in projections for t in group[i].q4q8] for i in range(4)]
        for i in range(4):
            weights += [
                [group[i].packed for group in projections],
                [group[i].scales_and_zeros for group in projections],
            ]
        return weights

    def _kv_caches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V cache, listed once (again only if the KV cache is allocated anew)."""
        if self._kv is None or self._kv[0][0] is not self.attention[0].k_cache:
            self._kv = [a.k_cache for a in self.attention], [a.v_cache for a in self.attention]
        return self._kv

    @staticmethod
    def _layer(layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            attn.qkv_proj,
            _bias(attn.qkv_proj),
            attn.q_norm.weight if attn.qk_norm else None,
            attn.k_norm.weight if attn.qk_norm else None,
            attn.o_proj,
            _bias(attn.o_proj),
            mlp.gate_up_proj,
            _bias(mlp.gate_up_proj),
            mlp.down_proj,
            _bias(mlp.down_proj),
            attn.attn.attend,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        cos, signed_sin = cpu_kernels.rotary_plan(positions, self.cos_cache, self.sin_cache)
        residual = F.embedding(input_ids, self.embed)
        # (the native step reads and writes float32 caches: an FP8 cache takes the layers' path, whose attention
        # goes through the torch references)
        if self.native_step is None or meta.slot_ids is not None or self.attention[0].kv_fp8:
            return self._layers(residual, cos, signed_sin, meta)
        return self._native(residual, cos, signed_sin, positions, meta)

    def _native(
        self,
        residual: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Every row through the native step, a prompt's tokens too: a token is a row with its sequence's block
        table and its own context (its position + 1; the step writes every row's K and V before any row attends).
        So a token's numbers are the same in a decode step, a prefill of any chunk size, a recompute after
        preemption and a step of any other rows: greedy output does not depend on load."""
        tables, context_lens = meta.block_tables, meta.context_lens
        if meta.num_decodes != residual.shape[0]:
            per_seq = torch.cat(
                (
                    torch.ones(meta.num_decodes, dtype=torch.int64),
                    meta.prefill_cu_seqlens_q.diff().long(),
                )
            )
            tables = tables.index_select(0, torch.repeat_interleave(per_seq))
            context_lens = (positions + 1).int()
        x = self.native_step(
            residual,
            cos,
            signed_sin,
            meta.slot_mapping.long(),
            tables.contiguous(),
            context_lens,
            *self.native_weights,
            *self._kv_caches(),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate,
            self.eps,
            self.scale,
        )
        torch.add(residual, x, out=residual)
        return F.rms_norm(residual, self.hidden, self.final_norm, self.eps)

    def _layers(
        self,
        residual: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x: torch.Tensor | None = None
        for layer in self.layers:
            if x is not None:
                torch.add(residual, x, out=residual)
            x = self._attention(
                layer, self._normed(residual, layer.input_norm), cos, signed_sin, meta
            )
            torch.add(residual, x, out=residual)
            x = self._mlp(layer, self._normed(residual, layer.post_norm))
        torch.add(residual, x, out=residual)
        return F.rms_norm(residual, self.hidden, self.final_norm, self.eps)

    def _normed(self, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(residual, self.hidden, weight, self.eps).to(self.act_dtype)

    def _attention(
        self,
        layer: _Layer,
        xb: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        meta: object,
    ) -> torch.Tensor:
        qkv = _project(layer.qkv, xb, layer.qkv_bias)
        rows, heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(rows, heads, self.head_dim)
        v = (
            qkv[:, self.q_size + self.kv_size :]
            .view(rows, self.num_kv_heads, self.head_dim)
            .float()
        )
        if layer.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before the rotation
            qk = torch.cat(
                (
                    F.rms_norm(
                        qk[:, : self.num_heads].float(), self.head_shape, layer.q_norm, self.eps
                    ),
                    F.rms_norm(
                        qk[:, self.num_heads :].float(), self.head_shape, layer.k_norm, self.eps
                    ),
                ),
                dim=1,
            )
        qk = cpu_kernels.rotated(qk, cos, signed_sin)  # float32, new tensor
        out = layer.attend(qk[:, : self.num_heads], qk[:, self.num_heads :], v, meta)
        return _project(layer.o, out.to(self.act_dtype), layer.o_bias)

    def _mlp(self, layer: _Layer, xb: torch.Tensor) -> torch.Tensor:
        gate_up = _project(layer.gate_up, xb, layer.gate_up_bias)
        hidden = F.silu(gate_up[:, : self.intermediate].float())
        hidden.mul_(gate_up[:, self.intermediate :])
        return _project(layer.down, hidden.to(self.act_dtype), layer.down_bias)


def _project(layer: nn.Module, xb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Rows (the layer's ``input_dtype``) through its weight-only matmul; its output type (bfloat16 or float32),
    or float32 with the bias added."""
    out = layer.matmul(xb.to(layer.input_dtype))
    return out if bias is None else torch.add(bias, out)
