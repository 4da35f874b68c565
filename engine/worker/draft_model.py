"""The draft model of speculative decoding (``speculative_model``): a second, smaller model with the target's
tokenizer that proposes the tokens the target then verifies (engine/speculative/).

Its KV cache is addressed by the target's block ids: it has the target's block count and block size, so one
block table serves both models and the block manager allocates, shares, caches and frees a block once (a block
costs the target's bytes plus the draft's: the pool is sized for both, ModelRunner.bytes_per_block).

The draft runs only when asked for drafts (``propose``), never beside the target's own steps, so a step without
drafts costs what it costs without a draft model. Its KV is brought up to date lazily: the speculator keeps, per
sequence, how many leading positions of the draft's KV are known right (``known``: 0 for a new sequence, a fork,
or one preempted since; blocks from the prefix cache or a lower tier are the target's KV, so a new sequence's
draft KV starts from nothing). A proposal first runs a prefill of the draft over the positions from ``known`` up
to its last two tokens (``_catch_up``, eager, in chunks of the step's token budget; nothing when the sequence
drafted last step), then ``k`` decode passes: the first with two rows per sequence (its second-to-last and last
token: the token kept after the last verification, whose draft KV no pass wrote yet), the others one row, each
pass's input the previous pass's argmax (chained on the device, read once; CUDA graphs of both pass kinds on
CUDA). The passes write the draft's KV of the positions from the second-to-last token on: the last token's, and
the drafts', which are right where the verification keeps them (``known`` then moves past the kept drafts).

A draft is the draft model's greedy token, a one-hot draft distribution: the verification of
engine/speculative/__init__.py is rejection sampling for it, so output keeps the target's distribution.
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

logger = logging.getLogger(__name__)

PASS_COST_DECAY = 0.8  # the weight of earlier proposals in ``pass_seconds``


class DraftModel:
    def __init__(self, config: EngineConfig, target: nn.Module) -> None:
        """Load ``config.speculative_model`` beside the loaded ``target`` (its config's derived fields filled)."""
        self.device = device = config.torch_device
        self.block_size = config.block_size
        self.token_budget = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.model = _load(config)
        target_vocab, vocab = target.args.vocab_size, self.model.args.vocab_size
        # (a padded vocabulary differs by a few hundred at most)
        if abs(vocab - target_vocab) > 1024:
            raise ValueError(
                f"speculative_model: its vocabulary has {vocab} tokens, the model's {target_vocab}: "
                "a draft model needs the model's tokenizer"
            )
        self.width = min(vocab, target_vocab)  # (drafts are ids the target has)
        # the draft's largest input id: a request's id past it (a padded vocabulary's gap) is read as this one
        self.max_id = vocab - 1
        self.kv = make_kv_backend(
            "paged",
            self.model.shard_args,
            config.kv_cache_torch_dtype,
            device,
            config.block_size,
            config.max_model_len,
            1,
        )
        if device.type == "cpu":
            self.model.store_weights_column_major()
        self.pass_seconds = 0.0  # a propose pass's measured seconds (0: none run yet)
        # the passes' static inputs and outputs: per row its last token's position, drafts wanted, the ids of its
        # last two tokens and its block table; the pass index; the drafts
        self.sizes = graph_sizes(config.speculative_max_batch)
        rows = self.sizes[-1]
        self.last, self.lens, self.ids, self.before = (
            torch.zeros(rows, dtype=torch.int32, device=device) for _ in range(4)
        )
        self.step = torch.zeros(1, dtype=torch.int32, device=device)
        self.tables = torch.zeros(rows, config.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.drafts = torch.zeros(
            rows, config.num_speculative_tokens, dtype=torch.int64, device=device
        )
        self.no_prefill = torch.zeros(1, dtype=torch.int32, device=device)
        self.use_graphs = device.type == "cuda" and not config.enforce_eager
        # CUDA graphs of the first pass (two rows a sequence) and of the others
        self.graphs: tuple[DecodeGraphs, DecodeGraphs] | None = None

    @property
    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block

    def allocate(self, num_blocks: int) -> None:
        """The draft's KV for the target's ``num_blocks`` blocks, each attention layer bound to its view, and on
        CUDA the graphs of the propose passes recorded over it."""
        self.kv.allocate(num_blocks, 0)
        for i, attn in enumerate(self.model.attention_layers):
            attn.bind(self.kv, i)
        # (the one-row passes take the model's persistent decode, where it has one)
        if hasattr(self.model, "bind_persistent_decode"):
            self.model.bind_persistent_decode(paged=True)
        if self.use_graphs:
            self.graphs = (
                DecodeGraphs(
                    lambda size: self._pass(size, True), self.sizes, self.device, self._idle
                ),
                DecodeGraphs(
                    lambda size: self._pass(size, False), self.sizes, self.device, self._idle
                ),
            )

    def free(self) -> None:
        self.graphs = None
        if hasattr(self.model, "bind_persistent_decode"):
            self.model.bind_persistent_decode(paged=False)
        self.kv.free()

    def _idle(self, size: int) -> None:
        """Static inputs of a harmless pass (no drafts: no KV written) for capture."""
        for buffer in (self.last, self.lens, self.ids, self.before, self.step, self.tables):
            buffer.zero_()

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], lengths: list[int], known: list[int]
    ) -> list[list[int]]:
        """``lengths[i]`` greedy draft tokens for ``seqs[i]``, which has blocks for its last token and as many
        more (BlockManager.allocate) and no pending token, and whose draft KV is right for its first
        ``known[i]`` positions: its catch-up, then ``max(lengths)`` passes (padded to a graph size on CUDA)."""
        self._catch_up(seqs, known)
        start = time.perf_counter()  # (a pass's price: a catch-up is paid once per gap)
        batch, passes = len(seqs), max(lengths)
        size = (padded_size(self.sizes, batch) or batch) if self.graphs is not None else batch
        last = np.zeros(size, dtype=np.int32)  # (padding rows: no drafts, so no KV written)
        last[:batch] = [seq.num_computed_tokens for seq in seqs]
        lens = np.zeros(size, dtype=np.int32)
        lens[:batch] = lengths
        ids, before = np.zeros(size, dtype=np.int32), np.zeros(size, dtype=np.int32)
        ids[:batch] = [seq.token_ids[p] for seq, p in zip(seqs, last[:batch].tolist())]
        before[:batch] = [seq.token_ids[p - 1] for seq, p in zip(seqs, last[:batch].tolist())]
        np.minimum(ids, self.max_id, out=ids)
        np.minimum(before, self.max_id, out=before)
        table = block_tables(seqs, size)
        width = table.shape[1]
        for buffer, values in zip(
            (self.last, self.lens, self.ids, self.before), (last, lens, ids, before)
        ):
            buffer[:size].copy_(torch.from_numpy(values), non_blocking=True)
        self.tables[:size, :width].copy_(torch.from_numpy(table), non_blocking=True)
        self.step.zero_()
        for i in range(passes):
            if self.graphs is not None:
                self.graphs[min(i, 1)].replay(size)
            else:
                self._pass(size, i == 0)
        tokens = self.drafts[:batch, :passes].tolist()
        seconds = (time.perf_counter() - start) / passes
        self.pass_seconds = (
            seconds
            if not self.pass_seconds
            else PASS_COST_DECAY * self.pass_seconds + (1 - PASS_COST_DECAY) * seconds
        )
        return [row[:n] for row, n in zip(tokens, lengths)]

    def _pass(self, size: int, first: bool) -> torch.Tensor:
        """One draft pass of ``size`` sequences over the static buffers (what each graph records). Row r is at
        position ``last + min(step, lens - 1)`` (a row whose drafts are done writes no KV), its input the
        previous pass's draft; the first pass has a row at ``last - 1`` before each (its second-to-last token).
        The pass's drafts go into column ``step`` of ``drafts``, then ``step + 1``."""
        last, lens, tables = self.last[:size], self.lens[:size], self.tables[:size]
        positions = last + torch.minimum(self.step, (lens - 1).clamp(min=0))
        writes = self.step < lens
        ids = self.ids[:size]
        if first:  # (rows of a sequence next to each other, as a verification's are)
            positions = torch.stack(((positions - 1).clamp(min=0), positions), dim=1).flatten()
            writes = torch.stack((writes, writes), dim=1).flatten()
            ids = torch.stack((self.before[:size], ids), dim=1).flatten()
            tables = tables.repeat_interleave(2, dim=0)
        blocks = tables.gather(1, (positions // self.block_size).long()[:, None])[:, 0]
        slots = blocks * self.block_size + positions % self.block_size
        metadata = AttentionMetadata(
            slot_mapping=torch.where(writes, slots, -1),
            block_tables=tables,
            context_lens=positions + 1,
            num_decodes=positions.shape[0],
            prefill_cu_seqlens_q=self.no_prefill,
            max_context_len=self.max_model_len,
            rows_share_sequences=first,
        )
        with forward_context(metadata):
            hidden = self.model(ids, positions)
        if first:
            hidden = hidden[1::2]
        drafts = self.model.compute_logits(hidden)[:, : self.width].argmax(dim=-1)
        self.ids[:size] = drafts
        self.drafts[:size].scatter_(1, self.step.long().expand(size, 1), drafts[:, None])
        self.step += 1
        return self.drafts

    def _catch_up(self, seqs: list[Sequence], known: list[int]) -> None:
        """The draft's KV of each sequence's positions from ``known`` to its second-to-last token (exclusive):
        prefill passes of the draft, at most the step's token budget each, a long gap over several passes."""
        todo = [
            (seq, start, seq.num_computed_tokens - 1)
            for seq, start in zip(seqs, known)
            if start < seq.num_computed_tokens - 1
        ]
        while todo:
            room, chunks, rest = self.token_budget, [], []
            for seq, start, end in todo:
                take = min(end - start, room)
                if take > 0:
                    chunks.append((seq, start, start + take))
                    room -= take
                if start + take < end:
                    rest.append((seq, start + take, end))
            self._prefill(chunks)
            todo = rest

    def _prefill(self, chunks: list[tuple[Sequence, int, int]]) -> None:
        """One prefill pass of the draft over ``(seq, start, end)`` chunks (positions start..end - 1)."""
        size, device = self.block_size, self.device
        ids = [min(t, self.max_id) for seq, start, end in chunks for t in seq.token_ids[start:end]]
        positions = np.concatenate([np.arange(start, end) for _, start, end in chunks])
        table = block_tables([seq for seq, _, _ in chunks], len(chunks))
        rows = np.repeat(np.arange(len(chunks)), [end - start for _, start, end in chunks])
        slots = table[rows, positions // size].astype(np.int64) * size + positions % size
        ends = np.asarray([end for _, _, end in chunks], dtype=np.int32)
        lens = np.asarray([end - start for _, start, end in chunks], dtype=np.int32)
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(table).to(device),
            context_lens=torch.from_numpy(ends).to(device),
            num_decodes=0,
            prefill_cu_seqlens_q=torch.from_numpy(
                np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
            ).to(device),
            max_context_len=int(ends.max()),
        )
        with forward_context(metadata):
            self.model(
                torch.tensor(ids, dtype=torch.int32, device=device),
                torch.from_numpy(positions.astype(np.int32)).to(device),
            )


def block_tables(seqs: list[Sequence], rows: int) -> np.ndarray:
    """``seqs``' block tables as the first of ``rows`` rows (int32, zero-padded to the longest)."""
    table = np.zeros((rows, max(len(seq.block_table) for seq in seqs)), dtype=np.int32)
    for row, seq in enumerate(seqs):
        table[row, : len(seq.block_table)] = seq.block_table
    return table


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
