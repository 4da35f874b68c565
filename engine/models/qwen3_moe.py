"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms) with a mixture-of-experts MLP in every layer
(engine/layers/moe.py): a router over E experts, the top k per token, their outputs weighed and summed.

Checkpoints name the experts two ways, both read here: transformers 5's fused ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` / ``mlp.experts.down_proj`` ``[E, H, I]``, and the hub's per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight``; a GGUF file has them stacked per projection
(``ffn_{gate,up,down}_exps``: ``mlp.experts.{gate,up,down}_proj.weight``, ``[E, I, H]`` / ``[E, H, I]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from engine.layers.linear import project_then_norm
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.layers.quantized_linear import cpu_linear
from engine.layers.rotary import RotaryEmbedding
from engine.models.cpu_decoder import CpuLayout
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from engine.models.llama_args import LlamaArgs
from engine.weights.gguf_blocks import GGUFBlocks
from kernels.cpu_native import CpuKernels

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate|up|down)_proj\.weight")


@dataclass(slots=True, frozen=True)
class Qwen3MoeArgs(LlamaArgs):
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, cfg: Any) -> "Qwen3MoeArgs":
        if (
            getattr(cfg, "mlp_only_layers", None)
            or int(getattr(cfg, "decoder_sparse_step", 1)) != 1
        ):
            raise ValueError(
                "model: Qwen3-MoE with dense layers among the sparse ones is not supported"
            )
        base = LlamaArgs.from_hf(cfg)
        fields = {f: getattr(base, f) for f in LlamaArgs.__dataclass_fields__}
        fields["qk_norm"] = True
        return cls(
            **fields,
            num_experts=int(getattr(cfg, "num_local_experts", None) or cfg.num_experts),
            top_k=int(cfg.num_experts_per_tok),
            moe_intermediate_size=int(cfg.moe_intermediate_size),
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
        )

    def sharded(self, size: int) -> "Qwen3MoeArgs":
        if size > 1:
            raise ValueError("tensor_parallel_size: mixture-of-experts models run on one rank")
        return self


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, args: Qwen3MoeArgs, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, rotary, window=args.window)
        self.mlp = MoE(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.top_k,
            args.norm_topk_prob,
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: ``(next_norm(stream), stream)`` after this layer."""
        attn = self.self_attn
        x, residual = project_then_norm(
            attn.o_proj, attn.attend(positions, x), self.post_attention_layernorm, residual
        )
        return next_norm(self.mlp(x), residual)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    args_class = Qwen3MoeArgs
    layer_class = Qwen3MoeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """As the Llama family's, with the experts' tensors placed in (or, as GGUF blocks, kept for) the fused
        expert parameters."""
        params = dict(self.named_parameters())
        covered: dict[
            tuple[str, str], int
        ] = {}  # (layer's experts, gate/up/down) -> experts placed
        rest = []
        for name, source in weights:
            if (placed := self._place_expert(name, source, params)) is None:
                rest.append((name, source))
                continue
            for key, count in placed.items():
                covered[key] = covered.get(key, 0) + count
        experts = self.args.num_experts
        missing = [
            f"model.layers.{i}.mlp.experts ({kind})"
            for i in range(self.args.num_layers)
            for kind in ("gate", "up", "down")
            if covered.get((f"model.layers.{i}.mlp.experts", kind), 0) < experts
        ]
        if missing:
            raise ValueError(
                f"weights: missing expert tensors for {missing[:3]} ({len(missing)} in all)"
            )
        super().load_weights(rest, placed={n for n in params if ".mlp.experts." in n})

    def _place_expert(
        self, name: str, source: Any, params: dict[str, nn.Parameter]
    ) -> dict[tuple[str, str], int] | None:
        """An expert tensor into its part of the fused parameters -> how many experts' (prefix, part) it gave
        (None: not an expert tensor)."""
        experts = self.args.num_experts
        inter = self.args.moe_intermediate_size
        rows = {"gate": slice(0, inter), "up": slice(inter, 2 * inter), "down": slice(None)}
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            params[name].data.copy_(source if isinstance(source, torch.Tensor) else source[:])
            prefix, kind = name.rsplit(".", 1)
            parts = ("gate", "up") if kind == "gate_up_proj" else ("down",)
            return {(prefix, p): experts for p in parts}
        if (match := _PER_EXPERT.fullmatch(name)) is not None:
            prefix, expert, kind = match[1], int(match[2]), match[3]
            target = params[f"{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}"]
            tensor = source if isinstance(source, torch.Tensor) else source[:]
            target.data[expert, rows[kind]].copy_(tensor)
            return {(prefix, kind): 1}
        if (match := _STACKED.fullmatch(name)) is not None:
            prefix, kind = match[1], match[2]
            if isinstance(source, GGUFBlocks):  # kept, for each expert's quantized layer
                self.file_blocks[name] = source
            else:
                target = params[f"{prefix}.{'down_proj' if kind == 'down' else 'gate_up_proj'}"]
                target.data[:, rows[kind]].copy_(source.view(target.shape[0], -1, source.shape[-1]))
            return {(prefix, kind): experts}
        return None

    def quantize_cpu_weights(
        self,
        mode: str,
        native: CpuKernels | None,
        embedding: nn.Module | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        """The Llama family's layers, and each expert's gate_up and down as ``mode`` layers (from the file's
        blocks in ``file`` mode), so that a step computes with the chosen experts' own weights."""
        for i, layer in enumerate(self.model.layers):
            layer.mlp.quantize(self._expert_layers(i, layer.mlp, mode, native))
            if release is not None:
                release()
        super().quantize_cpu_weights(mode, native, embedding, release)

    def _expert_layers(
        self, layer: int, moe: MoE, mode: str, native: CpuKernels | None
    ) -> list[tuple[nn.Module, nn.Module]]:
        prefix = f"model.layers.{layer}.mlp.experts"
        inter, hidden = self.args.moe_intermediate_size, self.args.hidden_size
        stacked = {
            k: self.file_blocks.get(f"{prefix}.{k}_proj.weight") for k in ("gate", "up", "down")
        }
        experts = []
        for e in range(moe.num_experts):
            if stacked["gate"] is not None and stacked["up"] is not None:
                parts = [stacked[k].rows(e * inter, (e + 1) * inter) for k in ("gate", "up")]
                gate_up = cpu_linear(mode, None, None, parts, native)
            else:
                gate_up = cpu_linear(mode, moe.experts.gate_up_proj[e], None, None, native)
            if stacked["down"] is not None:
                parts = [stacked["down"].rows(e * hidden, (e + 1) * hidden)]
                down = cpu_linear(mode, None, None, parts, native)
            else:
                down = cpu_linear(mode, moe.experts.down_proj[e], None, None, native)
            experts.append((gate_up, down))
        return experts

    def cpu_layout(self) -> CpuLayout:
        layout = super().cpu_layout()
        for cpu_layer, layer in zip(layout.layers, self.model.layers):
            cpu_layer.moe = layer.mlp
        return layout
