"""Gemma 3 (text): a Llama-shaped decoder with four norms per layer, q/k norms, a GeLU-tanh MLP, embeddings scaled
by sqrt(hidden), and interleaved attention: local layers attend a sliding window (``sliding_window`` tokens, their
own rotary base) and every ``N``-th layer is global (the whole context, its own rotary base and scaling).

Per layer (transformers' Gemma3DecoderLayer, in this order):
    x = input_layernorm(stream); stream += post_attention_layernorm(attention(x))
    x = pre_feedforward_layernorm(stream); stream += post_feedforward_layernorm(mlp(x))
Gemma's RMSNorm scales by ``1 + w``; the model keeps ``1 + w`` (computed in float32 at load, as transformers
computes it in every call) as the norm's weight, so every path (module, lean CPU, native) is a plain RMSNorm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from engine.layers.attention import PagedAttention
from engine.layers.linear import ColumnParallelLinear, VocabParallelEmbedding
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.cpu_decoder import GELU_TANH, CpuLayer, CpuLayout
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from engine.models.llama_args import LlamaArgs
from engine.distributed import parallel_state
from engine.weights.gguf_blocks import GGUFBlocks


@dataclass(slots=True, frozen=True)
class Gemma3Args(LlamaArgs):
    layer_windows: tuple[int, ...] = ()  # per layer: its window (0: global)
    local_rope: dict[str, Any] | None = None
    attention_scale: float = 1.0
    embed_scale: float = 1.0

    @classmethod
    def from_hf(cls, cfg: Any) -> "Gemma3Args":
        if getattr(cfg, "final_logit_softcapping", None) or getattr(
            cfg, "attn_logit_softcapping", None
        ):
            raise ValueError("model: Gemma with logit soft-capping (Gemma 2) is not supported")
        base = LlamaArgs.from_hf(cfg)
        kinds = list(getattr(cfg, "layer_types", None) or [])
        if not kinds:  # (older configs: a pattern, every N-th layer global)
            pattern = int(getattr(cfg, "sliding_window_pattern", 6))
            kinds = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(cfg.num_hidden_layers)
            ]
        window = int(cfg.sliding_window)
        params = getattr(cfg, "rope_parameters", None) or {}
        global_rope = dict(params.get("full_attention") or base.rope)
        local_rope = dict(
            params.get("sliding_attention")
            or {"rope_type": "default", "rope_theta": getattr(cfg, "rope_local_base_freq", 1e4)}
        )
        fields = {f: getattr(base, f) for f in LlamaArgs.__dataclass_fields__}
        fields.update(rope=global_rope, qk_norm=True)
        return cls(
            **fields,
            layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
            local_rope=local_rope,
            attention_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            embed_scale=float(cfg.hidden_size) ** 0.5,
        )


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, args: Gemma3Args, rotary: RotaryEmbedding, window: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, rotary, args.attention_scale, window)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, False, "gelu_tanh")
        eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps)

    def forward(self, positions: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(stream))
        stream = stream + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(stream))
        return stream + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, args: Gemma3Args) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        self.rotary_global = RotaryEmbedding(args.head_dim, args.max_position, args.rope)
        self.rotary_local = RotaryEmbedding(args.head_dim, args.max_position, args.local_rope)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(args, self.rotary_local if w else self.rotary_global, w)
            for w in args.layer_windows
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.embed_scale = args.embed_scale
        self.persistent = None  # (no persistent decode kernel for Gemma)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        stream = self.embed_tokens(input_ids)
        # transformers: the embeddings times sqrt(hidden) in their own dtype
        stream = stream * torch.tensor(self.embed_scale, dtype=stream.dtype)
        for layer in self.layers:
            stream = layer(positions, stream)
        return self.norm(stream)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model. Its tensors, weight loading, tensor-parallel shards and CPU weight modes are the
    Llama family's (llama.py); the layers are its own."""

    def __init__(self, hf_config: Any) -> None:
        nn.Module.__init__(self)
        self.args = Gemma3Args.from_hf(hf_config)
        self.tp = parallel_state.current()
        self.shard_args = self.args.sharded(self.tp.size)
        self.model = Gemma3Model(self.shard_args)
        if not self.args.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(
                self.args.hidden_size, self.model.embed_tokens.num_embeddings, bias=False
            )
        self.logits_weight = None
        self.logits_head = None
        self.cpu_decoder = None
        self.file_blocks: dict[str, GGUFBlocks] = {}
        self.num_parameters = sum(p.numel() for p in self.parameters())

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: global), for the KV cache's layer groups."""
        return self.args.layer_windows

    def bind_persistent_decode(self, paged: bool) -> None:
        self.model.persistent = None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """As the Llama family's, with each norm's ``w`` stored as the ``1 + w`` it scales by (float32)."""
        super().load_weights((name, _norm_scale(name, w)) for name, w in weights)

    def cpu_layout(self) -> CpuLayout:
        args, model = self.shard_args, self.model

        def layer(lay: Gemma3DecoderLayer, window: int) -> CpuLayer:
            attn = lay.self_attn
            return CpuLayer(
                lay.input_layernorm.weight,
                lay.pre_feedforward_layernorm.weight,
                attn.qkv_proj,
                attn.o_proj,
                lay.mlp.gate_up_proj,
                lay.mlp.down_proj,
                attn.attn.attend,
                rotary=1 if window else 0,
                window=window,
                q_norm=attn.q_norm.weight,
                k_norm=attn.k_norm.weight,
                attn_out_norm=lay.post_attention_layernorm.weight,
                mlp_out_norm=lay.post_feedforward_layernorm.weight,
            )

        rotary = [model.rotary_global, model.rotary_local]
        return CpuLayout(
            model.embed_tokens,
            model.embed_scale,
            model.norm.weight,
            args.rms_norm_eps,
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            args.intermediate_size,
            GELU_TANH,
            args.attention_scale,
            rotary,
            [layer(lay, w) for lay, w in zip(model.layers, args.layer_windows)],
        )

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]


def _norm_scale(name: str, weight: Any) -> Any:
    """A norm's ``w`` as the ``1 + w`` Gemma's RMSNorm scales by, in float32 (other tensors as they are)."""
    if not name.endswith("norm.weight") or isinstance(weight, GGUFBlocks):
        return weight
    tensor = weight if isinstance(weight, torch.Tensor) else weight[:]
    return 1.0 + tensor.float()
