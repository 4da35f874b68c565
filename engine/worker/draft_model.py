"""The draft model of speculative decoding (``speculative_model``): a second, smaller model with the target's
tokenizer that proposes the tokens the target then verifies (engine/speculative/).

Its KV cache is addressed by the target's block ids: it has the target's block count and block size, so one
block table serves both models and the block manager allocates, shares, caches and frees a block once (a block
costs the target's bytes plus the draft's: the pool is sized for both, ModelRunner.bytes_per_block). Every forward
pass of the target also runs the draft over the same tokens, slots and tables (``mirror``; on CUDA inside the
target's decode graphs), so the draft's KV holds every token the target's holds: prompt chunks, decode rows, a
cached prefix's blocks (computed with the draft beside them) and the verify rows, whose draft KV past the tokens
kept is overwritten by the next pass as the target's is. ``propose`` then runs ``k`` decode passes of the draft
for the sequences that speculate in a step, each from its last token, each pass's input the previous pass's
argmax (chained on the device, read once), writing the draft's KV of positions the verify pass rewrites.

A draft is the draft model's greedy token, a one-hot draft distribution: the verification of
engine/speculative/__init__.py is rejection sampling for it, so output keeps the target's distribution.

Where the draft's KV is not the target's tokens' own, drafts are worse, never the output: blocks brought back
from a swap or a lower KV tier hold the target's KV only (the draft's is not swapped or stored), so a sequence
swapped back, or a prefix read from the disk tier, gets poorer drafts for those positions (its acceptance rate
then lowers its drafts, engine/speculative/draft_length.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig
from engine.forward_context import AttentionMetadata, forward_context
from engine.kv_backend import make_kv_backend
from engine.sequence import Sequence
from engine.worker.cuda_graphs import DecodeGraphs, graph_sizes, padded_size
from engine.worker.dummy_model import DUMMY_ARCHITECTURES
from engine.worker.loader import load_model
from kernels import ops as kernel_ops

logger = logging.getLogger(__name__)

PASS_COST_DECAY = 0.8  # the weight of earlier proposals in ``pass_seconds``


class DraftModel:
    def __init__(self, config: EngineConfig, target: nn.Module) -> None:
        """Load ``config.speculative_model`` beside the loaded ``target`` (its config's derived fields filled)."""
        self.device = config.torch_device
        self.block_size = config.block_size
        self.model = _load(config)
        target_vocab, vocab = target.args.vocab_size, self.model.args.vocab_size
        if (
            abs(vocab - target_vocab) > 1024
        ):  # (a padded vocabulary differs by a few hundred at most)
            raise ValueError(
                f"speculative_model: its vocabulary has {vocab} tokens, the model's {target_vocab}: "
                "a draft model needs the model's tokenizer"
            )
        self.width = min(vocab, target_vocab)  # (drafts are ids the target has)
        self.kv = make_kv_backend(
            "paged",
            self.model.shard_args,
            config.kv_cache_torch_dtype,
            self.device,
            config.block_size,
            config.max_model_len,
            1,
        )
        if self.device.type == "cpu":
            self.model.store_weights_column_major()
        self.pass_seconds = 0.0  # a propose pass's measured seconds (0: none run yet)
        # a pass's static inputs and outputs: per row its first position, drafts wanted, input id and block
        # table; the pass index; the drafts
        self.max_model_len = config.max_model_len
        self.sizes = graph_sizes(config.speculative_max_batch)
        rows, device = self.sizes[-1], self.device
        self.first, self.lens, self.ids = (
            torch.zeros(rows, dtype=torch.int32, device=device) for _ in range(3)
        )
        self.step = torch.zeros(1, dtype=torch.int32, device=device)
        self.tables = torch.zeros(rows, config.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.drafts = torch.zeros(
            rows, config.num_speculative_tokens, dtype=torch.int64, device=device
        )
        self.no_prefill = torch.zeros(1, dtype=torch.int32, device=device)
        self.use_graphs = device.type == "cuda" and not config.enforce_eager
        self.graphs: DecodeGraphs | None = None

    @property
    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV for the target's ``num_blocks`` blocks, each attention layer bound to its view, and on
        CUDA the graphs of a propose pass recorded over it."""
        self.kv.allocate(num_blocks, 0)
        for i, attn in enumerate(self.model.attention_layers):
            attn.bind(self.kv, i)
        if self.use_graphs:
            self.graphs = DecodeGraphs(self._pass, self.sizes, self.device, self._idle)

    def free(self) -> None:
        self.graphs = None
        self.kv.free()

    def _idle(self, size: int) -> None:
        """Static inputs of a harmless pass (no drafts: no KV written) for capture."""
        for buffer in (self.first, self.lens, self.ids, self.step, self.tables):
            buffer.zero_()

    def copy_blocks(self, mapping: torch.Tensor) -> None:
        """The target's copy-on-write copies (``[n, 2]`` source, destination), on the draft's KV."""
        kernel_ops.copy_blocks(self.kv.k_caches, self.kv.v_caches, mapping)

    def mirror(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """The draft over a target pass's tokens (their ids fed): its KV written where the target's is."""
        with forward_context(dataclasses.replace(metadata, memo={})):
            self.model(input_ids, positions)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """``lengths[i]`` greedy draft tokens for ``seqs[i]``, which has blocks for its last token and as many
        more (BlockManager.allocate) and no pending token: ``max(lengths)`` passes of the draft over the
        sequences (padded to a graph size on CUDA: a replay each), each row from its last token on."""
        start = time.perf_counter()
        batch, passes = len(seqs), max(lengths)
        size = padded_size(self.sizes, batch) or batch
        first = np.zeros(size, dtype=np.int32)  # (padding rows: no drafts, so no KV written)
        first[:batch] = [seq.num_computed_tokens for seq in seqs]
        lens = np.zeros(size, dtype=np.int32)
        lens[:batch] = lengths
        ids = np.zeros(size, dtype=np.int32)
        ids[:batch] = [seq.token_ids[s] for seq, s in zip(seqs, first[:batch].tolist())]
        width = max(len(seq.block_table) for seq in seqs)
        table = np.zeros((size, width), dtype=np.int32)
        for row, seq in enumerate(seqs):
            table[row, : len(seq.block_table)] = seq.block_table
        for buffer, values in ((self.first, first), (self.lens, lens), (self.ids, ids)):
            buffer[:size].copy_(torch.from_numpy(values), non_blocking=True)
        self.tables[:size, :width].copy_(torch.from_numpy(table), non_blocking=True)
        self.step.zero_()
        for _ in range(passes):
            if self.graphs is not None:
                self.graphs.replay(size)
            else:
                self._pass(size)
        tokens = self.drafts[:batch, :passes].tolist()
        seconds = (time.perf_counter() - start) / passes
        self.pass_seconds = (
            seconds
            if not self.pass_seconds
            else PASS_COST_DECAY * self.pass_seconds + (1 - PASS_COST_DECAY) * seconds
        )
        return [row[:n] for row, n in zip(tokens, lengths)]

    def _pass(self, size: int) -> torch.Tensor:
        """One draft pass of ``size`` rows over the static buffers (what each graph records): row r at
        position ``first + min(step, lens - 1)`` (a row whose drafts are done writes no KV), its input the
        previous pass's draft; the pass's drafts into column ``step`` of ``drafts``, then ``step + 1``."""
        first, lens, tables = self.first[:size], self.lens[:size], self.tables[:size]
        positions = first + torch.minimum(self.step, (lens - 1).clamp(min=0))
        blocks = tables.gather(1, (positions // self.block_size).long()[:, None])[:, 0]
        slots = blocks * self.block_size + positions % self.block_size
        metadata = AttentionMetadata(
            slot_mapping=torch.where(self.step < lens, slots, -1),
            block_tables=tables,
            context_lens=positions + 1,
            num_decodes=size,
            prefill_cu_seqlens_q=self.no_prefill,
            max_context_len=self.max_model_len,
        )
        with forward_context(metadata):
            hidden = self.model(self.ids[:size], positions)
        drafts = self.model.compute_logits(hidden)[:, : self.width].argmax(dim=-1)
        self.ids[:size] = drafts
        self.drafts[:size].scatter_(1, self.step.long().expand(size, 1), drafts[:, None])
        self.step += 1
        return self.drafts


def _load(config: EngineConfig) -> nn.Module:
    """The draft model, loaded as the target was (device, dtype, CPU weights, dummy weights) with the target's
    context length."""
    name = config.speculative_model
    named = config.load_format == "dummy" and name in DUMMY_ARCHITECTURES
    draft_config = dataclasses.replace(
        config,
        model=None if named else name,
        model_config=name if named else None,
        speculative=None,
        speculative_model=None,
        cpu_weights="float32" if config.cpu_weights == "float32" else "auto",
        hf_config=None,
        model_path=None,
        model_id="",
        eos_token_ids=(),
    )
    try:
        model, _ = load_model(draft_config, with_tokenizer=False)
    except ValueError as exc:
        raise ValueError(f"speculative_model: {name}: {exc}") from exc
    logger.info("draft model %s: %.1fM parameters", name, model.num_parameters / 1e6)
    return model
