"""A decoder model's forward pass on the CPU with weight-only quantized projections (``--cpu-weights``), lean.

A decode step of a small model on a CPU spends more time around the matmuls than in them: per layer the module
path makes ~12 ``nn.Module`` calls and ~40 tensor ops, each a few microseconds of Python and dispatch
(docs/benchmarks/cpu.md, issue 15). This pass walks the layers' tensors directly, as a model's ``CpuLayout`` lists
them (Llama, Qwen, Gemma 3: q/k norms, Gemma's norms of the attention and MLP outputs, its GeLU, per-layer rotary
tables and sliding windows), and with native kernels runs every layer of a step in one native call
(kernels/cpu_decode.cpp), prompts too. ``tests/kernels/test_cpu_native.py`` holds the Python path bit-equal to the
model's modules and the native step to the Python path.

The residual stream, norms, rotary embedding, attention and KV cache stay float32; a projection's input is what its
kernel takes (``input_dtype``: float32 for the native GGUF kernel, which quantizes it to 8 bits per 32 inputs
itself; bfloat16 for torch's weight-only kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import AttentionMetadata, get_attention_metadata
from engine.layers.gguf_linear import GGUFLinear
from engine.layers.rotary import RotaryEmbedding
from kernels import cpu as cpu_kernels
from kernels.cpu_native import CpuKernels

SILU, GELU_TANH = 0, 1  # the native step's activation codes


@dataclass(slots=True)
class CpuLayer:
    """One decoder layer's tensors and bound calls, looked up once (not per step through nn.Module)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor  # the norm before the MLP
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    attend: object  # PagedAttention.attend of the layer (its own KV cache, its backend's kernels)
    rotary: int = 0  # index of the layer's rotary table in CpuLayout.rotary
    window: int = 0  # sliding window (0: the whole context)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = (
        None  # Gemma: the attention's output normed before the residual add
    )
    mlp_out_norm: torch.Tensor | None = None  # Gemma: the MLP's output too
    moe: nn.Module | None = (
        None  # a mixture of experts in place of gate_up / down (float32 rows in and out)
    )


@dataclass(slots=True)
class CpuLayout:
    """What the CPU pass needs of a model (its ``cpu_layout()``)."""

    embed: nn.Module  # input ids -> float32 rows
    embed_scale: float | None  # Gemma multiplies the embeddings by sqrt(hidden), in float32
    final_norm: torch.Tensor
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    activation: int  # SILU or GELU_TANH
    scale: float  # the attention's
    rotary: list[RotaryEmbedding]  # one per rotary kind (Gemma: the global and the local layers')
    layers: list[CpuLayer]


def _bias(layer: nn.Module) -> torch.Tensor | None:
    return getattr(layer, "bias", None)


class CpuDecoder:
    """``forward(input_ids, positions) -> hidden`` over a model's ``CpuLayout``. With ``native`` kernels and every
    projection a bias-free GGUF layer of whole tiles, every step runs as one native call; otherwise the Python
    path below."""

    def __init__(self, layout: CpuLayout, native: CpuKernels | None = None) -> None:
        self.layout = layout
        self.hidden = (layout.final_norm.shape[0],)
        self.head_shape = (layout.head_dim,)
        self.q_size = layout.num_heads * layout.head_dim
        self.kv_size = layout.num_kv_heads * layout.head_dim
        self.layers = layout.layers
        # the projections' input type: float32 for the native GGUF kernel, else bfloat16
        self.act_dtype = layout.layers[0].qkv.input_dtype
        self.attention = [layer.attend.__self__ for layer in layout.layers]
        self.native_args = self._native_args() if native is not None else None
        self.native_step = native.ops.decode_layers if self.native_args is not None else None
        self._kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def _native_args(self) -> tuple | None:
        """The native step's per-layer lists, or None where it does not apply (biases, layers other than GGUF
        ones, a part whose outputs are not whole tiles)."""
        layers = self.layers
        if any(lay.moe is not None for lay in layers):
            return None
        projections = [p for lay in layers for p in (lay.qkv, lay.o, lay.gate_up, lay.down)]
        if not all(
            isinstance(p, GGUFLinear) and p.bias is None and p.columns is None for p in projections
        ):
            return None

        def each(field: str) -> list[torch.Tensor]:
            values = [getattr(lay, field) for lay in layers]
            return [] if values[0] is None else values

        tiles = [t for p in projections for t in p.tiles]
        formats = [f for p in projections for f in p.formats]
        parts = [len(p.tiles) for p in projections]
        norms = [each(f) for f in ("input_norm", "post_norm", "q_norm", "k_norm")]
        norms += [each("attn_out_norm"), each("mlp_out_norm")]
        windows = [lay.window for lay in layers]
        return [lay.rotary for lay in layers], windows, *norms, tiles, formats, parts

    def _kv_caches(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's K and V cache, listed once (again only if the KV cache is allocated anew)."""
        if self._kv is None or self._kv[0][0] is not self.attention[0].k_cache:
            self._kv = [a.k_cache for a in self.attention], [a.v_cache for a in self.attention]
        return self._kv

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        layout = self.layout
        for rotary in layout.rotary:
            rotary.cover(positions)
        rotations = [
            cpu_kernels.rotary_plan(positions, r.cos_cache, r.sin_cache) for r in layout.rotary
        ]
        residual = layout.embed(input_ids).float()
        if layout.embed_scale is not None:
            residual = residual * torch.tensor(layout.embed_scale, dtype=torch.float32)
        # (the native step reads and writes float32 caches: an FP8 cache takes the layers' path, whose attention
        # goes through the torch references)
        if self.native_step is None or meta.slot_ids is not None or self.attention[0].kv_fp8:
            return self._layers(residual, rotations, meta)
        return self._native(residual, rotations, positions, meta)

    def _native(
        self,
        residual: torch.Tensor,
        rotations: list[tuple[torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Every row through the native step, a prompt's tokens too: a token is a row with its sequence's block
        table and its own context (its position + 1; the step writes every row's K and V before any row attends).
        So a token's numbers are the same in a decode step, a prefill of any chunk size, a recompute after
        preemption and a step of any other rows: greedy output does not depend on load."""
        tables, window_tables, context_lens = _per_row(meta, positions, residual.shape[0])
        slots = meta.slot_mapping.long()
        window_slots = (
            slots if meta.window_slot_mapping is None else meta.window_slot_mapping.long()
        )
        layout = self.layout
        x = self.native_step(
            residual,
            slots,
            tables,
            window_slots,
            tables if window_tables is None else window_tables,
            context_lens,
            [cos for cos, _ in rotations],
            [sin for _, sin in rotations],
            *self.native_args,
            *self._kv_caches(),
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
            layout.intermediate,
            layout.activation,
            layout.eps,
            layout.scale,
        )
        torch.add(residual, x, out=residual)
        return F.rms_norm(residual, self.hidden, layout.final_norm, layout.eps)

    def _layers(
        self,
        residual: torch.Tensor,
        rotations: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x: torch.Tensor | None = None
        for layer in self.layers:
            if x is not None:
                torch.add(residual, x, out=residual)
            x = self._attention(
                layer, self._normed(residual, layer.input_norm), rotations[layer.rotary], meta
            )
            if layer.attn_out_norm is not None:
                x = F.rms_norm(x, self.hidden, layer.attn_out_norm, self.layout.eps)
            torch.add(residual, x, out=residual)
            x = self._mlp(layer, self._normed(residual, layer.post_norm))
            if layer.mlp_out_norm is not None:
                x = F.rms_norm(x, self.hidden, layer.mlp_out_norm, self.layout.eps)
        torch.add(residual, x, out=residual)
        return F.rms_norm(residual, self.hidden, self.layout.final_norm, self.layout.eps)

    def _normed(self, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(residual, self.hidden, weight, self.layout.eps).to(self.act_dtype)

    def _attention(
        self,
        layer: CpuLayer,
        xb: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor],
        meta: object,
    ) -> torch.Tensor:
        layout = self.layout
        heads, kv_heads, dim = layout.num_heads, layout.num_kv_heads, layout.head_dim
        qkv = _project(layer.qkv, xb, _bias(layer.qkv))
        rows = qkv.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].view(rows, heads + kv_heads, dim)
        v = qkv[:, self.q_size + self.kv_size :].view(rows, kv_heads, dim).float()
        if (
            layer.q_norm is not None
        ):  # Qwen3, Gemma 3: per-head RMSNorm of q and k before the rotation
            qk = torch.cat(
                (
                    F.rms_norm(qk[:, :heads].float(), self.head_shape, layer.q_norm, layout.eps),
                    F.rms_norm(qk[:, heads:].float(), self.head_shape, layer.k_norm, layout.eps),
                ),
                dim=1,
            )
        qk = cpu_kernels.rotated(qk, *rotation)  # float32, new tensor
        out = layer.attend(qk[:, :heads], qk[:, heads:], v, meta)
        return _project(layer.o, out.to(self.act_dtype), _bias(layer.o))

    def _mlp(self, layer: CpuLayer, xb: torch.Tensor) -> torch.Tensor:
        if layer.moe is not None:
            return layer.moe(xb.float())
        gate_up = _project(layer.gate_up, xb, _bias(layer.gate_up))
        gate = gate_up[:, : self.layout.intermediate].float()
        if self.layout.activation == SILU:
            hidden = F.silu(gate)
        else:
            hidden = F.gelu(gate, approximate="tanh")
        hidden.mul_(gate_up[:, self.layout.intermediate :])
        return _project(layer.down, hidden.to(self.act_dtype), _bias(layer.down))


def _per_row(
    meta: AttentionMetadata, positions: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Block tables (and window tables) and context lengths per row: a prompt token takes its sequence's table
    and its own context, its position + 1."""
    tables, window_tables, context_lens = (
        meta.block_tables,
        meta.window_block_tables,
        meta.context_lens,
    )
    if meta.num_decodes != rows:
        per_seq = torch.cat(
            (
                torch.ones(meta.num_decodes, dtype=torch.int64),
                meta.prefill_cu_seqlens_q.diff().long(),
            )
        )
        rows_of = torch.repeat_interleave(per_seq)
        tables = tables.index_select(0, rows_of)
        if window_tables is not None:
            window_tables = window_tables.index_select(0, rows_of)
        context_lens = (positions + 1).int()
    return (
        tables.contiguous(),
        None if window_tables is None else window_tables.contiguous(),
        context_lens,
    )


def _project(layer: nn.Module, xb: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Rows (the layer's ``input_dtype``) through its weight-only matmul; its output type (bfloat16 or float32),
    or float32 with the bias added."""
    out = layer.matmul(xb.to(layer.input_dtype))
    return out if bias is None else torch.add(bias, out)
