"""Runs one scheduled batch: packs its inputs (engine/worker/step_inputs.py), runs the model under the forward
context (eagerly, or by replaying a CUDA graph for a decode-only batch), and samples the sequences whose
chunk reached their end (engine/worker/step_sampler.py). Nothing is read back here: ``execute`` returns a
``LaunchedStep`` whose ``wait`` gives the sampled ids, so the engine can prepare the next step while the device runs this one.
Also owns the KV cache tensors and sizes them.

Under tensor parallelism every rank has a runner over its shard. Rank 0's (``workers`` given) schedules and
samples: each command it carries out on its device goes to the other ranks first (engine/worker/worker_group.py),
whose runners repeat it on theirs (``follow_step`` for a step), and its sampled ids are broadcast to them.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from kernels import ops as kernel_ops
from engine.distributed import parallel_state
from engine.config import EngineConfig
from engine.worker.cpu_threads import thread_tuner
from engine.worker.cuda_graphs import DecodeGraphRunner
from engine.worker.draft_model import DraftModel
from engine.forward_context import AttentionMetadata, forward_context
from engine.kv_backend import backend_block_size, make_kv_backend, split_budget, window_group
from engine.sampling_params import SamplingParams
from engine.core.scheduled_batch import ScheduledBatch
from engine.sequence import Sequence
from engine.worker.step_inputs import StepInputs, StepTensors
from engine.worker.step_sampler import LaunchedStep, StepSampler
from engine.worker.worker_group import (
    AllocateHostCache,
    AllocateKv,
    CaptureGraphs,
    MemoryInfo,
    ReleaseKv,
    ReserveLogits,
    RunStep,
    WorkerGroup,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: nn.Module, workers: WorkerGroup | None = None
    ) -> None:
        """``workers``: the other tensor-parallel ranks, which this (rank 0's) runner drives."""
        self.config, self.model, self.workers = config, model, workers
        self.device = config.torch_device
        # a contiguous backend gives each live sequence a request slot; slots freed by a finished sequence
        # wait for the step in flight, hence up to twice the running limit
        self.num_slots = 2 * config.max_num_seqs + 2
        self.kv = make_kv_backend(
            config.kv_backend,
            model.shard_args,
            config.kv_cache_torch_dtype,
            self.device,
            config.block_size,
            config.max_model_len,
            self.num_slots,
            window_group(model, config),
        )
        self.block_size = config.block_size = backend_block_size(self.kv, config)
        draft = config.speculative == "draft" and not self.kv.window  # (not beside window groups)
        self.draft = DraftModel(config, model) if draft else None  # its KV in the target's blocks
        self.sampling = StepSampler(config, workers is not None)
        self.threads = thread_tuner(config, model)  # (CPU threads, measured as steps run)
        self.k_caches = self.v_caches = torch.empty(0)
        self.inputs: StepInputs | None = None
        # swap space, when preemption may swap
        self.host_k_caches = self.host_v_caches = torch.empty(0)
        self.num_parameters = model.num_parameters  # (recompute cost estimates)
        self.decode_graphs = DecodeGraphRunner(
            config,
            model.args.vocab_size,
            self._forward,
            model.compute_logits,
            self.kv,
            self.sampling.last_sampled,
        )
        if self.device.type == "cpu":
            model.store_weights_column_major()
        if workers is not None:
            rows = max(config.max_num_seqs, self.decode_graphs.max_size)
            workers.send(ReserveLogits(rows, model.args.vocab_size))
            self.reserve_logits(rows, model.args.vocab_size)

    def reserve_logits(self, max_rows: int, width: int) -> None:
        """Tensor parallelism: rank 0's logits where every rank's output layer can write them (every rank)."""
        parallel_state.reserve_logits(max_rows, width, self.config.torch_dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.kv.bytes_per_block + (self.draft.bytes_per_block if self.draft else 0)

    # KV cache sizing ---------------------------------------------------------------------------------

    def num_blocks_for_budget(self) -> tuple[int, int]:
        """KV blocks that fit, of the full layers and of a window group (0: none): the configured CPU budget, or on
        CUDA the memory left under ``gpu_memory_utilization`` after the weights, a warm-up pass of the largest
        batch and the CUDA graphs."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks, config.num_kv_blocks if self.kv.window else 0
        if self.device.type != "cuda":
            return split_budget(
                self.kv, config, self.bytes_per_block, int(config.kv_cache_memory_gib * 2**30)
            )
        ranks = [torch.cuda.mem_get_info(self.device)]
        if self.workers is not None:
            ranks += self.workers.gather(MemoryInfo())
        peak = self._warm_up_peak_memory()  # (rank 0's: the ranks hold equal shards)
        budget = min(
            total * config.gpu_memory_utilization - (total - free) for free, total in ranks
        )
        return split_budget(self.kv, config, self.bytes_per_block, max(0, int(budget - peak)))

    def size_kv_cache(self) -> tuple[int, int]:
        """Allocate the KV pool of the memory budget (capping ``max_model_len`` to what it holds); its blocks
        (and the window group's)."""
        config = self.config
        num_blocks, window_blocks = self.num_blocks_for_budget()
        if num_blocks < 2:
            raise RuntimeError(
                f"KV cache: room for only {num_blocks} blocks of {self.bytes_per_block} bytes; "
                "raise kv_cache_memory_gib / gpu_memory_utilization or num_kv_blocks"
            )
        if config.max_model_len > num_blocks * config.block_size:
            logger.warning(
                "max_model_len %d capped to the KV pool's %d tokens",
                config.max_model_len,
                num_blocks * config.block_size,
            )
            config.max_model_len = num_blocks * config.block_size
        self.allocate_kv_cache(num_blocks, window_blocks)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB, %d tokens, %s); max_model_len %d%s",
            num_blocks,
            config.block_size,
            (num_blocks * self.bytes_per_block + window_blocks * self.kv.window_bytes_per_block)
            / 2**30,
            num_blocks * config.block_size,
            str(config.kv_cache_torch_dtype).removeprefix("torch."),
            config.max_model_len,
            f"; sliding-window layers: {window_blocks} blocks of their own"
            if window_blocks
            else "",
        )
        return num_blocks, window_blocks

    def _warm_up_peak_memory(self) -> int:
        """Activation memory of a forward pass over ``max_num_batched_tokens`` tokens (a scratch KV), plus
        what the CUDA graph of the largest decode batch holds (captured once on the scratch KV)."""
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        scratch = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(scratch, scratch if self.kv.window else 0)
        seq = Sequence(
            seq_id=-1,
            request_id="warm-up",
            token_ids=[0] * num_tokens,
            params=SamplingParams(temperature=0.0),
        )
        seq.block_table = list(range(scratch))
        seq.window_table = list(range(scratch)) if self.kv.window else []
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.execute(ScheduledBatch(seqs=[seq], num_new_tokens=[num_tokens]), None).wait()
        self.inputs.forget(seq)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        graph_bytes = 0
        if self.decode_graphs.use_graphs:
            self.capture_graphs([self.decode_graphs.max_size])
            graph_bytes = self.decode_graphs.graphs.memory_bytes
        # the step buffers are allocated again, at their final size, beside the real KV cache
        buffers = self.decode_graphs.buffer_bytes + self.inputs.device_buffer.nbytes
        self.release_kv_cache()
        return peak + graph_bytes + buffers

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (at shutdown, before the process group: their NCCL collectives hold it)."""
        self.decode_graphs.release()

    def release_kv_cache(self) -> None:
        """Drop the KV cache and the graphs recorded over it (the warm-up's scratch ones)."""
        if self.workers is not None:
            self.workers.send(ReleaseKv())
        self.decode_graphs.release()
        if hasattr(self.model, "bind_persistent_decode"):
            self.model.bind_persistent_decode(paged=False)
        self.kv.free()
        if self.draft is not None:
            self.draft.free()
        self.k_caches = self.v_caches = torch.empty(0)
        torch.cuda.empty_cache()

    def allocate_kv_cache(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        """The KV backend's memory for ``num_blocks`` blocks (block-addressed ``k_caches``/``v_caches``
        ``[layers, blocks, block_size, kv_heads, head_dim]`` for copy-on-write and swap), and the window
        group's; each attention layer gets its layer's view. Also the step input buffers, sized by the (now
        final) ``max_model_len``."""
        config, kv = self.config, self.kv
        if self.workers is not None:
            self.workers.send(AllocateKv(num_blocks, config.max_model_len))
        kv.allocate(num_blocks, num_window_blocks)
        self.k_caches, self.v_caches = kv.k_caches, kv.v_caches
        for i, attn in enumerate(self.model.attention_layers):
            attn.bind(kv, i)
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        if hasattr(self.model, "bind_persistent_decode"):
            self.model.bind_persistent_decode(paged=not kv.contiguous)
        max_tokens = max(config.max_num_batched_tokens, self.decode_graphs.max_rows)
        self.inputs = StepInputs(
            self.device,
            self.block_size,
            max_tokens,
            kv.num_slots if kv.contiguous else config.max_num_seqs + 1,
            config.max_blocks_per_seq,
            kv,
        )
        self.decode_graphs.allocate(self.inputs, config.max_blocks_per_seq, kv.scratch_slot)

    def allocate_host_pools(self) -> tuple[int, int]:
        """Host blocks for swapped-out sequences and for the host tier of the prefix cache, allocated as one pool
        (``swap_space_gib`` where preemption may swap, ``host_cache_gib`` with prefix caching); their counts."""
        config = self.config
        num_swap = num_cache = 0
        # (a window group's blocks are not swapped or kept on the host: recompute)
        if self.kv.window:
            return 0, 0
        if config.preemption_mode != "recompute":
            num_swap = int(config.swap_space_gib * 2**30) // self.bytes_per_block
        if config.enable_prefix_caching:
            num_cache = int(config.host_cache_gib * 2**30) // self.bytes_per_block
        if num_swap + num_cache:
            self.allocate_host_cache(num_swap + num_cache)
        if num_cache:
            logger.info(
                "host tier of the prefix cache: %d blocks (%.2f GiB)",
                num_cache,
                num_cache * self.bytes_per_block / 2**30,
            )
        return num_swap, num_cache

    def allocate_host_cache(self, num_blocks: int) -> None:
        """The host pool for swapped-out blocks, the device cache's layout (pinned on CUDA, so copies are DMA
        transfers); uninitialised: a block is read only after a swap-out wrote it."""
        if self.workers is not None:
            self.workers.send(AllocateHostCache(num_blocks))
        shape = (self.k_caches.shape[0], num_blocks, *self.k_caches.shape[2:])
        pinned = self.device.type == "cuda"
        self.host_k_caches = torch.empty(shape, dtype=self.k_caches.dtype, pin_memory=pinned)
        self.host_v_caches = torch.empty(shape, dtype=self.k_caches.dtype, pin_memory=pinned)

    def _swap(
        self,
        pairs: list[tuple[int, int]],
        src: tuple[torch.Tensor, torch.Tensor],
        dst: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        mapping = torch.tensor(pairs, dtype=torch.int64)
        kernel_ops.swap_blocks(src[0], dst[0], mapping)
        kernel_ops.swap_blocks(src[1], dst[1], mapping)

    def capture_graphs(self, sizes: list[int] | None = None) -> None:
        """After the final KV allocation: record the decode graphs (CUDA, unless ``enforce_eager``) of
        ``sizes`` (all of ``graph_sizes``)."""
        if not self.decode_graphs.use_graphs:
            return
        sizes = sizes or self.decode_graphs.sizes
        if self.workers is not None:
            self.workers.send(CaptureGraphs(sizes))
        self.decode_graphs.capture(sizes)

    # one step ---------------------------------------------------------------------------------------

    def forget(self, seq: Sequence) -> None:
        """``seq`` left the running batch for good (finished): release its input rows."""
        self.inputs.forget(seq)

    def settle(self) -> None:
        """The engine went idle: slots of finished sequences are released now (their pages stay mapped for the
        next requests: vattention's deferred reclamation)."""
        self.inputs.drain()

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, in_flight: LaunchedStep | None) -> LaunchedStep:
        """Launch the forward pass over ``batch`` and the sampling of its finishing entries. Tokens still
        pending in ``in_flight`` are fed from its sampled ids on the device."""
        if self.threads is None:
            return self._launch(batch, in_flight)
        return self.threads.run(lambda: self._launch(batch, in_flight), batch.num_rows)

    def _launch(self, batch: ScheduledBatch, in_flight: LaunchedStep | None) -> LaunchedStep:
        start = time.perf_counter()
        pad = None
        num_rows, shared = batch.num_rows, bool(batch.drafts)  # (drafted rows: graphs of their own)
        if batch.num_decode_rows == num_rows:
            pad = self.decode_graphs.padded_size(num_rows, shared)
        step = self.inputs.build(batch, in_flight.feed_rows() if in_flight else {}, pad)
        num_sampled = len(batch.sampling_seqs)
        if self.workers is not None:
            self.workers.send(
                RunStep(
                    self.inputs.layout,
                    pad,
                    num_sampled,
                    batch.swap_out,
                    batch.block_copies,
                    batch.swap_in,
                ),
                memoryview(self.inputs.packed.numpy()),
            )
        self._move_blocks(batch.swap_out, batch.block_copies, batch.swap_in, batch.window_copies)
        if self.kv.contiguous:
            inputs = self.inputs
            self.kv.map_rows(
                inputs.rows,
                inputs.table[inputs.rows],
                inputs.widths,
                inputs.ends,
                self._wait_for_device,
            )
        prepared = time.perf_counter()
        if pad is not None:
            logits = self.decode_graphs.run(step, pad, num_rows, shared)
            # (some rows not sampled, or sampled twice)
            if num_sampled != num_rows or batch.forks:
                logits = logits[step.sample_rows]
        else:
            hidden = self._eager_forward(step)
            logits = self.model.compute_logits(hidden[step.sample_rows]) if num_sampled else None
        launched = self.sampling.launch(logits, batch.sampling_seqs, prepared - start)
        self.inputs.step_launched()
        return launched

    def follow_step(self, command: RunStep, payload: memoryview) -> None:
        """Another rank's side of rank 0's ``execute``: the same block moves and forward pass over this rank's
        shard (the collectives meet rank 0's), then the sampled ids rank 0 broadcasts."""
        self._move_blocks(command.swap_out, command.block_copies, command.swap_in)
        step = self.inputs.unpack(payload, command.layout)
        if command.pad is not None:
            self.decode_graphs.run(
                step, command.pad, command.layout.num_seqs, command.layout.rows_share_sequences
            )
        else:
            hidden = self._eager_forward(step)
            if command.num_sampled:
                self.model.compute_logits(hidden[step.sample_rows])
        if command.num_sampled:
            parallel_state.broadcast_from_driver(self.sampling.last_sampled[: command.num_sampled])

    def _move_blocks(
        self,
        swap_out: list[tuple[int, int]],
        copies: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        window_copies: list[tuple[int, int]] = (),
    ) -> None:
        # in this order on one stream: swap-outs read blocks that swap-ins or copies may then overwrite; a copy
        # may read a block swapped in this very step (a swapped parallel request's shared last block)
        host, device = (self.host_k_caches, self.host_v_caches), (self.k_caches, self.v_caches)
        if swap_out:
            self._swap(swap_out, device, host)
        if swap_in:
            self._swap(swap_in, host, device)
        if copies:
            mapping = torch.tensor(copies, dtype=torch.int64, device=self.device)
            kernel_ops.copy_blocks(self.k_caches, self.v_caches, mapping)
        if window_copies:
            mapping = torch.tensor(window_copies, dtype=torch.int64, device=self.device)
            kernel_ops.copy_blocks(self.kv.window_k_caches, self.kv.window_v_caches, mapping)

    def _wait_for_device(self) -> None:
        """(A contiguous backend about to remap a page that the step in flight may read.)"""
        torch.cuda.current_stream(self.device).synchronize()

    def _eager_forward(self, step: StepTensors) -> torch.Tensor:
        """The model over a step run outside the graphs: its pending ids (``feed >= 0``) first taken from the
        last sampled ids (a graph step's graph does this itself, with its table copy)."""
        kernel_ops.prepare_inputs(
            step.input_ids, step.feed, self.sampling.last_sampled, None, None, None
        )
        return self._forward(step.input_ids, step.positions, step.metadata)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The model over one step's tokens (their pending ids fed)."""
        with forward_context(metadata):
            return self.model(input_ids, positions)
