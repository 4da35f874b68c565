"""Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm), chosen by flags.

Weights use the Hugging Face names, except that q/k/v and gate/up are fused into one matmul each;
``load_weights`` places each HF tensor into its shard of the fused parameter.

Under tensor parallelism (engine/distributed/parallel_state.py) each rank builds the layers of its shard: its heads of
q/k/v (kv heads replicated where the ranks outnumber them), its columns of gate/up, the matching inputs of
o/down (row-parallel), its rows of the vocabulary; ``load_weights`` reads only that slice of each tensor.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from engine.distributed import parallel_state
from engine.layers.linear import (
    ATTENTION_EXCHANGE,
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    VocabParallelEmbedding,
    matmul,
    project_then_norm,
)
from engine.layers.quantized_linear import cpu_linear, cpu_logits_head
from engine.models.llama_args import LlamaArgs
from engine.models.hf_weights import copy_checked, fused_name, hf_names, read_part
from engine.models.cpu_decoder import SILU, CpuDecoder, CpuLayer, CpuLayout
from engine.models.llama_persistent import LlamaPersistentDecoder, persistent_decoder
from engine.forward_context import current_attention_metadata
from kernels import lean_cpu
from kernels.cpu_native import CpuKernels
from engine.weights.gguf_blocks import GGUFBlocks

from engine.layers.attention import PagedAttention
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.kv_backend.base import QKNorm
from engine.layers.rotary import RotaryEmbedding


# the tensors a GGUF model keeps in its file's blocks on the CPU (``file``): the projections, embedding and head
_KEPT_AS_BLOCKS = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


class LlamaAttention(nn.Module):
    def __init__(
        self, args: LlamaArgs, rotary: RotaryEmbedding, scale: float | None = None, window: int = 0
    ) -> None:
        """``args``: this rank's shard (LlamaArgs.sharded); ``scale``: the softmax's (default head_dim^-0.5);
        ``window`` > 0: a sliding-window layer."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        self.q_size, self.kv_size = (
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        )
        self.qkv_proj = ColumnParallelLinear(
            args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            self.q_size, args.hidden_size, bias=args.o_bias, exchange=ATTENTION_EXCHANGE
        )
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rotary = rotary
        self.attn = PagedAttention(
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            args.head_dim**-0.5 if scale is None else scale,
            window,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, x))

    def attend(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention's output before ``o_proj``."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        lean = lean_cpu(q)
        # Qwen3's q/k norm: in the launch that rotates and stores, where its weights are in q's dtype (Gemma's
        # are float32 and so are its normed q and k: two launches of their own)
        fused_norm = self.qk_norm and not lean and self.q_norm.weight.dtype == q.dtype
        if self.qk_norm and not fused_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if lean:
            q, k = self.rotary(positions, q, k)
            return self.attn(q, k, v)
        norm = (
            QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if fused_norm else None
        )
        # rotated in the launch that stores K and V (one kernel boundary less per layer)
        return self.attn(q, k, v, self.rotary.rotation(positions, norm))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, rotary, window=args.window)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the residual stream ``residual`` already normed by this layer's ``input_layernorm`` ->
        ``(next_norm(stream), stream)``, the stream after this layer normed for the next layer (or the model's
        final norm): each norm follows its row-parallel projection (``project_then_norm``)."""
        attn = self.self_attn
        x, residual = project_then_norm(
            attn.o_proj, attn.attend(positions, x), self.post_attention_layernorm, residual
        )
        return project_then_norm(self.mlp.down_proj, self.mlp.activate(x), next_norm, residual)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, layer_class: type[nn.Module] | None = None) -> None:
        """``args``: this rank's shard (LlamaArgs.sharded); ``layer_class``: the decoder layer (a family's own,
        e.g. Qwen3-MoE's), LlamaDecoderLayer by default."""
        super().__init__()
        rotary = RotaryEmbedding(args.head_dim, args.max_position, args.rope)
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        layer_class = layer_class or LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_class(args, rotary) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # every layer of a small decode pass in one launch, where bound (engine/models/llama_persistent.py)
        self.persistent: LlamaPersistentDecoder | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.persistent is not None:
            meta = current_attention_metadata()
            if self.persistent.takes(input_ids.shape[0], meta):
                return self.norm(
                    self.persistent.forward(self.embed_tokens(input_ids), positions, meta)
                )
        residual = self.embed_tokens(input_ids)
        x = self.layers[0].input_layernorm(residual)
        for i, layer in enumerate(self.layers):
            next_norm = (
                self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            )
            x, residual = layer(positions, x, residual, next_norm)
        return x


class LlamaForCausalLM(nn.Module):
    args_class: type[LlamaArgs] = LlamaArgs
    layer_class: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.args = self.args_class.from_hf(hf_config)
        self.tp = parallel_state.current()
        # this rank's heads, kv heads, columns (its KV cache's)
        self.shard_args = self.args.sharded(self.tp.size)
        self.model = LlamaModel(self.shard_args, self.layer_class)
        if not self.args.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(
                self.args.hidden_size, self.model.embed_tokens.num_embeddings, bias=False
            )
        # a CPU-friendly layout of the output layer, if set
        self.logits_weight: torch.Tensor | None = None
        # a quantized output layer (--cpu-weights), if set
        self.logits_head: nn.Module | None = None
        # the lean pass over quantized layers, if set
        self.cpu_decoder: CpuDecoder | None = None
        # a GGUF file's blocks by HF name, from load_weights until quantize_cpu_weights takes them
        self.file_blocks: dict[str, GGUFBlocks] = {}
        # weights of the model as defined (quantized layers keep theirs in buffers of other sizes)
        self.num_parameters = sum(p.numel() for p in self.parameters())

    @property
    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def bind_persistent_decode(self, paged: bool) -> None:
        """After the attention layers are bound to a (new) cache: the persistent decode pass over it where the
        model, device and cache qualify (``paged``: the paged KV backend); without a cache (``paged`` False,
        at release), none."""
        self.model.persistent = (
            persistent_decoder(self.model.layers, self.shard_args, self.tp.size)
            if paged and self.cpu_decoder is None
            else None
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.cpu_decoder is not None:
            return self.cpu_decoder.forward(input_ids, positions)
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of each row of ``hidden``, into ``out`` when given (a CUDA graph's static output)."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden)
            return logits if out is None else out.copy_(logits)
        weight = self.logits_weight
        if weight is None:
            weight = (
                self.model.embed_tokens.weight
                if self.args.tie_word_embeddings
                else self.lm_head.weight
            )
        if self.tp.size == 1:
            return matmul(hidden, weight, out)
        # each rank's vocabulary slice, whole where rank 0 samples; the padding columns dropped
        return parallel_state.compute_logits(hidden, weight, self.args.vocab_size, out)

    def store_weights_column_major(self) -> None:
        """CPU: every linear weight in [in, out] memory order (see Linear.store_weight_column_major); a tied
        embedding keeps its row-major table for lookups and gets a column-major copy for the logits."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.store_weight_column_major()
        if self.args.tie_word_embeddings and self.logits_head is None:
            self.logits_weight = self.model.embed_tokens.weight.t().contiguous().t()

    def quantize_cpu_weights(
        self,
        mode: str,
        native: CpuKernels | None,
        embedding: nn.Module | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        """Swap every projection for its ``mode`` layer (engine/layers/quantized_linear.py): ``file`` from the
        blocks ``load_weights`` kept (HF names; a fused projection from its shards' blocks side by side), the
        others from the float weights. The output layer too (a tied one from the embedding's blocks or table);
        ``embedding``: a lookup that replaces the float table (a GGUF's, read in place). ``native``: the native
        CPU kernels of the configured level (kernels/cpu_native.py), None where they are off or not built.
        ``release``: called after each layer is built (a GGUF map drops the pages it read: the load's peak
        memory holds one layer of the file beside the built layers, not the whole file)."""
        blocks = self.file_blocks
        for name, module in list(self.named_modules()):
            if not isinstance(module, Linear) or name == "lm_head":
                continue
            shards = (
                [f"{name}.weight"] if f"{name}.weight" in blocks else hf_names(f"{name}.weight")
            )
            parts = [blocks[h] for h in shards] if all(h in blocks for h in shards) else None
            parent, attr = name.rsplit(".", 1)
            setattr(
                self.get_submodule(parent),
                attr,
                cpu_linear(mode, module.weight, module.bias, parts, native),
            )
            if release is not None:
                release()
        tied = self.args.tie_word_embeddings
        head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        head_blocks = blocks.get(head_name)
        head = None if head_blocks else (self.model.embed_tokens if tied else self.lm_head).weight
        self.logits_head = cpu_logits_head(mode, head, head_blocks, native, release)
        if embedding is not None:
            self.model.embed_tokens = embedding
        if not tied:
            del self.lm_head
        self.logits_weight = None
        self.file_blocks = {}
        self.cpu_decoder = CpuDecoder(self.cpu_layout(), native)

    def cpu_layout(self) -> CpuLayout:
        """The model's tensors as the lean CPU pass walks them (engine/models/cpu_decoder.py)."""
        args, model = self.args, self.model
        rotary = model.layers[0].self_attn.rotary

        def layer(lay: LlamaDecoderLayer) -> CpuLayer:
            attn = lay.self_attn
            return CpuLayer(
                lay.input_layernorm.weight,
                lay.post_attention_layernorm.weight,
                attn.qkv_proj,
                attn.o_proj,
                getattr(
                    lay.mlp, "gate_up_proj", None
                ),  # (None: a mixture of experts, its own call)
                getattr(lay.mlp, "down_proj", None),
                attn.attn.attend,
                window=attn.attn.window,
                q_norm=attn.q_norm.weight if attn.qk_norm else None,
                k_norm=attn.k_norm.weight if attn.qk_norm else None,
            )

        return CpuLayout(
            model.embed_tokens,
            None,
            model.norm.weight,
            args.rms_norm_eps,
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            args.intermediate_size,
            SILU,
            args.head_dim**-0.5,
            [rotary],
            [layer(lay) for lay in model.layers],
        )

    def load_weights(
        self, weights: Iterable[tuple[str, Any]], placed: set[str] | frozenset[str] = frozenset()
    ) -> None:
        """Copy HF-named tensors in, each a tensor or a lazy safetensors slice (of which only this rank's part is
        read), or a GGUF tensor's blocks (GGUFBlocks: kept for ``quantize_cpu_weights``); raises ValueError naming
        any parameter left unset or tensor unknown. ``placed``: parameters a family's own loading filled."""
        params = dict(self.named_parameters())
        shard_sizes = self._shard_sizes()
        loaded: set[tuple[str, int | None]] = set()
        for name, source in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.args.tie_word_embeddings):
                continue
            target, shard = fused_name(name)
            if target not in params:
                raise ValueError(f"weights: unexpected tensor {name!r} for this architecture")
            if isinstance(source, GGUFBlocks) and not name.endswith(_KEPT_AS_BLOCKS):
                source = source.dequantize()  # (a router or norm stored in blocks: plain floats)
            if isinstance(source, GGUFBlocks):  # kept for quantize_cpu_weights ("file")
                self.file_blocks[name] = source
                loaded.update([(target, shard)] if shard is not None else self._loaded_as(target))
                continue
            dst = params[target].data
            if shard is not None:
                sizes = shard_sizes[target.rsplit(".", 2)[-2]]
                dst = dst[sum(sizes[:shard]) : sum(sizes[: shard + 1])]
            tensor = read_part(source, self._rank_slice(name))
            if name.endswith(("embed_tokens.weight", "lm_head.weight")) and self.tp.size > 1:
                dst[tensor.shape[0] :].zero_()  # (rows padding the last rank's vocabulary slice)
                dst = dst[: tensor.shape[0]]
            copy_checked(dst, tensor, name)
            # (a checkpoint that ships q/k/v or gate/up fused, as Phi-3's, fills every shard at once)
            loaded.update([(target, shard)] if shard is not None else self._loaded_as(target))
        expected = {
            (name, shard)
            for name in params
            if name not in placed
            for shard in self._shards_of(name)
        }
        if missing := sorted(str(item) for item in expected - loaded):
            raise ValueError(f"weights: missing tensors for {missing[:5]} ({len(missing)} in all)")

    def _rank_slice(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, end) of HF tensor ``name`` that this rank holds; None: all of it (norms, row-parallel
        biases, a single rank)."""
        tp, args = self.tp, self.args
        if tp.size == 1:
            return None
        heads = args.num_heads * args.head_dim
        if ".q_proj." in name:
            return (0, *tp.shard(heads))
        if ".k_proj." in name or ".v_proj." in name:
            local = self.shard_args.num_kv_heads
            first = (
                tp.rank * local
                if args.num_kv_heads % tp.size == 0
                else tp.rank * args.num_kv_heads // tp.size
            )
            return 0, first * args.head_dim, (first + local) * args.head_dim
        if ".gate_proj." in name or ".up_proj." in name:
            return (0, *tp.shard(args.intermediate_size))
        if name.endswith(".o_proj.weight"):
            return (1, *tp.shard(heads))
        if name.endswith(".down_proj.weight"):
            return (1, *tp.shard(args.intermediate_size))
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            embed = self.model.embed_tokens
            return 0, embed.start, min(embed.start + embed.num_embeddings, args.vocab_size)
        return None

    def _loaded_as(self, param_name: str) -> list[tuple[str, int | None]]:
        """What one whole tensor for ``param_name`` fills: every shard of a fused parameter."""
        if self.tp.size > 1 and len(self._shards_of(param_name)) > 1:
            raise ValueError(
                f"tensor_parallel_size: {param_name} comes fused in the checkpoint (Phi-3); "
                "tensor parallelism takes checkpoints with separate q/k/v and gate/up"
            )
        return [(param_name, shard) for shard in self._shards_of(param_name)]

    def _shards_of(self, param_name: str) -> list[int | None]:
        fused = param_name.rsplit(".", 2)[-2]
        return (
            list(range(len(self._shard_sizes()[fused]))) if fused in self._shard_sizes() else [None]
        )

    def _shard_sizes(self) -> dict[str, list[int]]:
        attn = self.model.layers[0].self_attn
        return {
            "qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size],
            "gate_up_proj": [self.shard_args.intermediate_size] * 2,
        }
