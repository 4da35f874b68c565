"""CUDA graphs for decode-only steps, and the runner of padded decode passes that owns them.

A decode step of a small model launches hundreds of small kernels; launching them from Python costs more
host time than the GPU needs to run them. Each graph records one decode pass (the input feed and table
copy, forward, logits) for a fixed padded batch size over static input buffers; a step uploads its inputs
into those buffers and replays the graph of the smallest size that holds its batch. Sizes: 1, 2, 4, 8, then
every 8 up to the largest. Graphs are captured largest first into one memory pool, so the smaller ones
reuse its memory.

``DecodeGraphRunner`` owns all of it: the ladder of sizes, the static buffers a decode pass reads besides the
step inputs' packed view (the block-table rows) and the logits it writes, the padding, capture and replay.
Decode-only batches up to the ladder's top are padded to a ladder size also when they run eagerly (the CPU,
``enforce_eager``), so that eager and graph runs compute the same shapes and give the same tokens.

With speculative decoding a second ladder records the same pass for steps whose rows share sequences (a drafted
sequence's ``1 + k`` rows: AttentionMetadata.rows_share_sequences), up to ``speculative_max_batch`` sequences of
``1 + num_speculative_tokens`` rows: in those graphs the model takes its layer path, never a kernel whose rows do
not wait for each other's KV (the persistent decode).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

import torch
from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.kv_backend.base import KVBackend
from engine.forward_context import AttentionMetadata
from engine.worker.step_inputs import StepInputs, StepTensors
from kernels import ops as kernel_ops

# the model over one step's tokens, their pending ids fed: (input ids, positions, attention metadata) ->
# hidden states
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
ComputeLogits = Callable[..., torch.Tensor]  # (hidden, out=) -> logits

logger = logging.getLogger(__name__)


def graph_sizes(max_size: int) -> list[int]:
    """The ladder of captured batch sizes up to ``max_size`` (always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_size] + list(range(8, max_size, 8))
    return sorted(set(sizes + [max_size]))


def padded_size(sizes: list[int], batch_size: int) -> int | None:
    """Smallest captured size that holds ``batch_size`` rows; None when the batch is larger than all."""
    for size in sizes:
        if size >= batch_size:
            return size
    return None


def window_group(
    packed: torch.Tensor,
    table_at: torch.Tensor,
    shape: torch.Size,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    scratch_slot: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded decode pass's window tables ``shape`` and window slots, from the packed step (device tensors
    only: a graph records it). Each of the ``table_at[1]`` real packed rows is the block table then the window
    table, ``table_at[2] / 2`` columns each, so the window half is gathered from the packed buffer; a padding row
    (at or past ``table_at[1]``: it reads one position, its output dropped) gets the scratch block, as its block
    table row does, since the packed buffer holds no table of it (what lies there is other vectors or stale
    entries: block ids out of the window pool, which the attention kernel would read). A decode row's slot comes
    from its position; rows that store nothing (slot -1) keep -1."""
    rows, width = shape
    half = table_at[2] // 2
    columns = torch.arange(width, device=packed.device)
    row_ids = torch.arange(rows, device=packed.device)[:, None]
    at = table_at[0] + row_ids * table_at[2] + half
    index = (at + columns[None, :]).clamp(min=0, max=packed.numel() - 1).long()
    real = (columns[None, :] < half) & (row_ids < table_at[1])
    window = torch.where(real, packed[index], scratch_slot)
    slots = window.gather(1, (positions // block_size).long()[:, None])[:, 0]
    slots = slots * block_size + positions % block_size
    return window, torch.where(slot_mapping >= 0, slots, -1)


class DecodeGraphs:
    def __init__(
        self,
        decode_pass: Callable[[int], torch.Tensor],
        sizes: list[int],
        device: torch.device,
        prepare_inputs: Callable[[int], None],
    ) -> None:
        """``decode_pass(size)`` runs one padded decode pass over the static inputs and returns its static
        output; ``prepare_inputs(size)`` fills the static inputs with a harmless batch for capture."""
        self.sizes = sorted(sizes)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        pool = torch.cuda.graph_pool_handle()
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        for size in tqdm(sorted(sizes, reverse=True), desc="capturing CUDA graphs", leave=False):
            prepare_inputs(size)
            # warm-up outside the graph: Triton compiles, lazy buffers get allocated
            decode_pass(size)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = decode_pass(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info(
            "CUDA graphs: %d decode batch sizes (%d..%d) captured in %.1f s, %.0f MiB",
            len(sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
            self.memory_bytes / 2**20,
        )

    def replay(self, size: int) -> torch.Tensor:
        self._graphs[size].replay()
        self.num_replays += 1
        return self._outputs[size]


class DecodeGraphRunner:
    """Decode-only steps at padded (ladder) sizes, replayed from CUDA graphs or run eagerly the same way."""

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        forward: Forward,
        compute_logits: ComputeLogits,
        kv: KVBackend,
        last_sampled: torch.Tensor,
    ) -> None:
        """``forward`` runs the model over a step's inputs; ``compute_logits(hidden, out=)`` its output layer;
        ``kv``: the KV backend, whose tables the decode pass reads; ``last_sampled``: the ids the step before
        sampled, which feed a step's pending ids."""
        self.config, self.device = config, config.torch_device
        self.vocab_size, self.forward, self.compute_logits = vocab_size, forward, compute_logits
        self.kv, self.last_sampled = kv, last_sampled
        max_padded = min(config.max_graph_batch_size, config.max_num_seqs)
        self.sizes = graph_sizes(max_padded) if max_padded else []
        self.use_graphs = (
            self.device.type == "cuda" and not config.enforce_eager and bool(self.sizes)
        )
        # steps with drafted rows (speculative decoding): their own ladder and graphs
        max_verify = min(
            config.speculative_max_batch * (config.num_speculative_tokens + 1),
            config.max_graph_batch_size,
        )
        self.verify_sizes = graph_sizes(max_verify) if config.speculative and max_padded else []
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None
        self.padded_steps: Counter[int] = Counter()  # decode-only steps run at each padded size
        self.inputs: StepInputs | None = None
        # [largest size, table width]: the static table rows
        self.tables = torch.empty(0, dtype=torch.int32)
        self.logits = torch.empty(0)  # [largest size, vocab]: what a padded pass writes

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    @property
    def max_rows(self) -> int:
        """The most rows a padded pass has (the decode ladder's top or the verify ladder's)."""
        return max(self.max_size, self.verify_sizes[-1] if self.verify_sizes else 0)

    @property
    def buffer_bytes(self) -> int:
        return self.tables.nbytes + self.logits.nbytes

    def padded_size(self, batch_size: int, shared: bool = False) -> int | None:
        """The ladder size a decode-only batch of ``batch_size`` rows runs at (None: unpadded); ``shared``:
        rows of a sequence share it (drafted rows), on their own ladder."""
        return padded_size(self.verify_sizes if shared else self.sizes, batch_size)

    def allocate(self, inputs: StepInputs, table_width: int, scratch_slot: int) -> None:
        """The static buffers, over the step inputs ``inputs`` (allocated with the KV cache they address);
        the graphs recorded over the previous ones are dropped."""
        self.graphs, self.inputs = None, inputs
        if not self.sizes:
            return
        rows = self.max_rows
        _, width = self.kv.table_shape(rows, rows, table_width)
        self.tables = torch.full((rows, width), scratch_slot, dtype=torch.int32, device=self.device)
        self.logits = torch.empty(
            rows, self.vocab_size, dtype=self.config.torch_dtype, device=self.device
        )

    def capture(self, sizes: list[int] | None = None) -> None:
        """Record the graphs of ``sizes`` (all of the ladder) over the current buffers (CUDA, unless eager)."""
        if self.use_graphs:
            self.graphs = DecodeGraphs(
                self._decode_pass, sizes or self.sizes, self.device, self._idle_inputs
            )
            whole = sizes is None or sizes == self.sizes  # (else the warm-up's one graph)
            verify = [size for size in self.verify_sizes if whole or size in sizes]
            if verify:
                self.verify_graphs = DecodeGraphs(
                    lambda size: self._decode_pass(size, shared=True),
                    verify,
                    self.device,
                    self._idle_inputs,
                )

    def release(self) -> None:
        """Drop the graphs (NCCL collectives captured in them hold the communicator until they are gone)."""
        if self.graphs is not None:
            self.graphs = self.verify_graphs = None
            torch.cuda.synchronize(self.device)

    def run(
        self, step: StepTensors, size: int, num_seqs: int, shared: bool = False
    ) -> torch.Tensor:
        """The logits of a decode-only step of ``num_seqs`` rows, packed at ladder size ``size`` (``shared``:
        of its verify ladder)."""
        self.padded_steps[size] += 1
        graphs = self.verify_graphs if shared else self.graphs
        logits = graphs.replay(size) if graphs is not None else self._decode_pass(size, shared)
        return logits[:num_seqs]

    def _decode_pass(self, size: int, shared: bool = False) -> torch.Tensor:
        """One decode pass over the static inputs of size ``size`` (what each graph records); ``shared``: its
        rows may share sequences."""
        view = self.inputs.decode_view(size)
        tables = self.tables[:size]
        # pending ids fed, the step's table rows into the static table (where ``table_at`` says they lie)
        kernel_ops.prepare_inputs(
            view.ids, view.feed, self.last_sampled, self.inputs.device_buffer, view.table_at, tables
        )
        metadata = AttentionMetadata(
            slot_mapping=view.slots,
            block_tables=tables,
            context_lens=view.context_lens,
            num_decodes=size,
            prefill_cu_seqlens_q=view.cu_seqlens,
            slot_ids=self.kv.slot_ids(tables),
            max_context_len=self.config.max_model_len,
            rows_share_sequences=shared,
            decode_order=view.order,
        )
        if self.kv.window:
            self._window_group(metadata, view.positions, view.table_at)
        hidden = self.forward(view.ids, view.positions, metadata)
        return self.compute_logits(hidden, out=self.logits[:size])

    def _window_group(
        self, metadata: AttentionMetadata, positions: torch.Tensor, table_at: torch.Tensor
    ) -> None:
        """A window group's tables and slots, recorded in the graph with the pass (``window_group``)."""
        metadata.window_block_tables, metadata.window_slot_mapping = window_group(
            self.inputs.device_buffer,
            table_at,
            metadata.block_tables.shape,
            positions,
            metadata.slot_mapping,
            self.kv.block_size,
            self.kv.scratch_slot,
        )

    def _idle_inputs(self, size: int) -> None:
        """Static inputs of a harmless batch (every row a padding row) for capture."""
        self.inputs.decode_view(size).fill_padding()
