"""Runs one scheduled batch: builds input tensors (token ids, positions, slot mapping, block tables, context
lengths), runs the model under the forward context, samples the sequences whose chunk reached their end.
Also owns the KV cache tensors and sizes them."""
from __future__ import annotations

import logging

import torch
from torch import nn

from kernels import ops as kernel_ops
from engine.config import EngineConfig
from engine.forward_context import AttentionMetadata, forward_context
from engine.layers.sampler import Sampler, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module) -> None:
        self.config = config
        self.model = model
        self.device = config.torch_device
        self.block_size = config.block_size
        self.sampler = Sampler()
        self.k_caches = torch.empty(0)
        self.v_caches = torch.empty(0)
        if self.device.type == "cpu":
            model.store_weights_column_major()

    @property
    def bytes_per_block(self) -> int:
        args = self.model.args
        elem = torch.empty((), dtype=self.config.torch_dtype).element_size()
        return 2 * args.num_layers * self.block_size * args.num_kv_heads * args.head_dim * elem

    def num_blocks_for_budget(self) -> int:
        """KV blocks that fit: the configured CPU budget, or on CUDA the memory left under
        ``gpu_memory_utilization`` after the weights and a warm-up pass of the largest batch."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            return int(self.config.kv_cache_memory_gib * 2**30) // self.bytes_per_block
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self._warm_up_peak_memory()
        budget = total * self.config.gpu_memory_utilization - (total - free) - peak
        return max(0, int(budget)) // self.bytes_per_block

    def _warm_up_peak_memory(self) -> int:
        """Activation memory of a forward pass over ``max_num_batched_tokens`` tokens (a scratch KV)."""
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        self.allocate_kv_cache(-(-num_tokens // self.block_size))
        seq = Sequence(seq_id=-1, request_id="warm-up", token_ids=[0] * num_tokens, params=SamplingParams(temperature=0.0))
        seq.block_table = list(range(len(self.k_caches[0])))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.execute(ScheduledBatch(seqs=[seq], num_new_tokens=[num_tokens]))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.k_caches = self.v_caches = torch.empty(0)
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One K and one V tensor ``[layers, blocks, block_size, kv_heads, head_dim]``; each attention layer
        gets its layer's view. Zeroed so that masked-out stale slots never carry NaN into a softmax."""
        args = self.model.args
        shape = (args.num_layers, num_blocks, self.block_size, args.num_kv_heads, args.head_dim)
        self.k_caches = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        self.v_caches = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache, attn.v_cache = self.k_caches[i], self.v_caches[i]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SamplerOutput:
        """Forward pass over ``batch``; samples one token for each entry whose chunk ends its tokens."""
        if batch.block_copies:
            mapping = torch.tensor(batch.block_copies, dtype=torch.int64, device=self.device)
            kernel_ops.copy_blocks(self.k_caches, self.v_caches, mapping)
        input_ids, positions, metadata, sample_rows = self._prepare(batch)
        with forward_context(metadata):
            hidden = self.model(input_ids, positions)
        if not sample_rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[rows]).float()
        return self.sampler(logits, batch.sampling_seqs, self.config.eos_token_ids)

    def _prepare(self, batch: ScheduledBatch
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end, table = seq.num_computed_tokens, seq.num_computed_tokens + n, seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            context_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
        num_decodes = batch.num_decodes
        prefill_cu = [0]
        for n in batch.num_new_tokens[num_decodes:]:
            prefill_cu.append(prefill_cu[-1] + n)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
        metadata = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            num_decodes=num_decodes,
            prefill_cu_seqlens_q=self._tensor(prefill_cu, torch.int32),
        )
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), metadata, sample_rows

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)
