"""EngineCore: requests in, one ``step()`` at a time, token-id deltas out.

The core owns what runs at the device's pace: the scheduler, the block manager, the model runner (CUDA graphs,
async scheduling), grammars and beam search. It knows no text: detokenizing, stop strings, logprob formatting and
building RequestOutputs belong to the output processor (output_processor.py), which runs beside it in-process
(llm_engine.py) or in the server's process (async_engine.py, with the core in a process of its own). A stop
string found there ends the sample here through ``abort_request(request_id, index, "stop")``.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from engine.core.beam_requests import BeamRequests
from engine.output.beam_search import BeamGroup, new_beam_group
from engine.core.block_hash import BlockHasher
from engine.core.block_manager import BlockManager
from engine.config import EngineConfig
from engine.core.core_info import CoreInfo, check_priority, check_request
from engine.layers.sampler import TokenLogprobs
from engine.worker.loader import load_model
from engine.core.metrics import EngineCounters, EngineStats
from engine.worker.model_runner import LaunchedStep, ModelRunner
from engine.output.outputs import SampleDelta
from engine.core.preemption import SwapPolicy
from engine.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.output.structured_output import GrammarCompiler
from engine.output.structured_output import accept as accept_grammar
from engine.output.structured_output import release_free_heap
from engine.worker.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

_FINISH_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "abort": SequenceStatus.FINISHED_ABORTED,
                  "error": SequenceStatus.FINISHED_FAILED}


@dataclass(slots=True, eq=False)
class _Sample:
    """One sample of a request and how many of its output tokens were sent."""

    seq: Sequence
    num_sent: int = 0
    error: str | None = None


@dataclass(slots=True, eq=False)
class _Request:
    group: SequenceGroup
    samples: list[_Sample]
    num_open: int  # samples not finished yet
    beam: BeamGroup | None = None


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **options: object) -> None:
        self.config = config = config or EngineConfig(**options)
        self._threads_before = torch.get_num_threads()  # (restored by shutdown: ranks on the CPU share the cores)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        elif config.tensor_parallel_size > 1 and config.torch_device.type == "cpu":  # (the ranks share the cores)
            torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
        torch.manual_seed(config.seed)
        # tensor parallelism: this process is rank 0; the other ranks load their shards meanwhile
        self.workers = WorkerGroup(config) if config.tensor_parallel_size > 1 else None
        try:
            self.model, self.tokenizer = load_model(config)
            if self.workers is not None:
                self.workers.wait_ready()
            self.runner = ModelRunner(config, self.model, self.workers)
            num_blocks = self.runner.size_kv_cache()
            self.runner.capture_graphs()
        except BaseException:
            self.shutdown()
            raise
        self.grammars = GrammarCompiler(self.tokenizer, self.model.args.vocab_size, config.eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          self._hasher(), *self.runner.allocate_host_pools(),
                                          self.runner.kv.lookahead_tokens, config.max_blocks_per_seq)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   prefer_swap=SwapPolicy(config.preemption_mode, config.torch_device.type,
                                                          self.runner.bytes_per_block, self.runner.num_parameters),
                                   max_seqs_per_tenant=config.max_seqs_per_tenant,
                                   shared_step_time_factor=config.shared_step_time_factor,
                                   step_time_target_s=config.step_time_target_s)
        self.counters = EngineCounters()
        self.info = CoreInfo.of(config, self.model.args.vocab_size, num_blocks)
        self._requests: dict[str, _Request] = {}
        self._pin_tokens: dict[str, int] = {}  # pin id -> tokens of its prefix (pin_prefix)
        self._pin_groups: dict[str, str | None] = {}  # pin id -> its group (whose pins share a cap)
        self._samples: dict[int, _Sample] = {}  # seq_id -> its sample, for every unfinished one
        self.beams = BeamRequests(self.scheduler, self.block_manager, self.counters, self.runner.forget,
                                  self._finish, lambda request_id: self._requests.pop(request_id).group.params.n)
        self._seq_ids = itertools.count()
        self._in_flight: LaunchedStep | None = None  # launched, sampled ids not read yet (async scheduling)
        self.last_batch: ScheduledBatch | None = None  # the latest step's schedule (benchmarks read its shape)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (a single-rank core holds nothing to stop)."""
        if self.workers is not None:
            if hasattr(self, "runner"):
                self.runner.release_graphs()
            self.workers.stop()
            torch.set_num_threads(self._threads_before)

    def _hasher(self) -> BlockHasher:
        return BlockHasher(self.config.prefix_hash, self.config.model_id, self.config.prefix_cache_seed)

    # requests -----------------------------------------------------------------------------------------

    def validate_request(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> None:
        check_request(self.info, prompt_token_ids, params, self.grammars)

    def add_request(self, request_id: str, prompt_token_ids: SequenceOf[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, tenant: str = "", priority: int = 0) -> None:
        """``tenant``: who sent it (steps are shared fairly among tenants with work); ``priority``: its rank among
        that tenant's requests, lower first."""
        params = params or SamplingParams()
        self.validate_request(prompt_token_ids, params)
        check_priority(priority)
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        if params.use_beam_search:
            self._add_beam_search(request_id, prompt, params, cache_salt, tenant, priority)
            return
        # best_of ranks samples by cumulative logprob: each sample's token logprob is computed (handed out only
        # where asked for, by the output processor)
        seq_params = params if params.best_of is None or params.logprobs is not None else \
            dataclasses.replace(params, logprobs=0)
        samples = []
        # one matcher built (a large grammar's takes tens of milliseconds), copied for the other samples
        grammar = self.grammars.matcher(params.structured_output) if params.structured_output is not None else None
        for index in range(params.num_sequences):
            own = seq_params if index == 0 or params.seed is None else \
                dataclasses.replace(seq_params, seed=params.sample_seed(index))
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, token_ids=list(prompt), params=own,
                           cache_salt=cache_salt, tenant=tenant, priority=priority, index=index)
            if grammar is not None:
                seq.grammar = grammar if index == 0 else grammar.deep_copy()
            samples.append(_Sample(seq))
        # nothing is registered before this point: a failure above leaves the engine as it was
        seqs = [sample.seq for sample in samples]
        seqs[0].unforked = seqs[1:]  # computed once, then forked (sharing the prompt's blocks)
        self._requests[request_id] = _Request(SequenceGroup(request_id, seqs, params), samples, len(samples))
        self._samples.update((sample.seq.seq_id, sample) for sample in samples)
        self.counters.prompt_tokens += len(prompt)
        self.scheduler.add(seqs[0])

    def _add_beam_search(self, request_id: str, prompt: list[int], params: SamplingParams,
                         cache_salt: str | None, tenant: str, priority: int) -> None:
        beams = [Sequence(seq_id=next(self._seq_ids), request_id=request_id, token_ids=list(prompt), params=params,
                          cache_salt=cache_salt, tenant=tenant, priority=priority, index=i)
                 for i in range(params.beam_width)]
        beams[0].unforked = beams[1:]  # their places are held until the prompt's step
        eos = () if params.ignore_eos else tuple(self.config.eos_token_ids)
        group = new_beam_group(beams, params, self.config.max_model_len - len(prompt), eos)
        self._requests[request_id] = _Request(SequenceGroup(request_id, beams, params), [], 0, beam=group)
        self.beams.add(group)
        self.counters.prompt_tokens += len(prompt)
        self.scheduler.add(beams[0])

    def abort_request(self, request_id: str, index: int | None = None, reason: str = "abort") -> list[SampleDelta]:
        """End a request now (or only its sample ``index``); returns the final delta (finish_reason ``reason``)
        of each sample not finished yet (none if the request is unknown or done). ``reason`` "stop": the output
        processor found a stop string, and has already ended the sample."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        if request.beam is not None:
            return self.beams.finish(request.beam, SequenceStatus.FINISHED_ABORTED)
        deltas = []
        for sample in request.samples:
            if not sample.seq.is_finished and (index is None or sample.seq.index == index):
                self._finish(sample.seq, _FINISH_STATUS[reason])
                deltas.append(self._emit(sample))
        return deltas

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._in_flight is not None

    @property
    def num_open_samples(self) -> int:
        """Samples of requests not finished yet (0 once every request has ended: none is leaked)."""
        return len(self._samples)

    def has_request(self, request_id: str) -> bool:
        """The request is still running (some sample of it unfinished)."""
        return request_id in self._requests

    # the step -----------------------------------------------------------------------------------------

    def step(self) -> list[SampleDelta]:
        """Schedule, launch one forward pass and its sampling, then read sampled ids, check EOS, stop tokens
        and length; one delta per sample that received a token.

        With ``async_scheduling`` the ids read are the previous step's: step N+1 is scheduled and launched
        while the device still runs step N, whose tokens are then read and processed while N+1 runs. Each
        sequence sampled by step N holds a PENDING_TOKEN in its token ids, and step N+1 takes that token's
        id from N's sampled ids on the device. A sequence that stops at N (EOS, stop string) still gets
        one wasted row in N+1; a sequence whose pending token is its last by length is not scheduled again.
        """
        return self.beams.deferred_steps() + self._step()

    def _step(self) -> list[SampleDelta]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        self.last_batch = batch
        launch_start = time.perf_counter()
        self.counters.schedule_seconds += launch_start - start
        in_flight, self._in_flight = self._in_flight, None
        if not batch.seqs:
            return self._idle_step(in_flight, batch)
        deltas: list[SampleDelta] = []
        if in_flight is not None and self._needs_known_history(batch):
            deltas += self._process(in_flight)
            in_flight = None
        launched = self.runner.execute(batch, in_flight)
        self.counters.prepare_seconds += launched.prepare_seconds
        self.counters.launch_seconds += time.perf_counter() - launch_start - launched.prepare_seconds
        self.beams.preempted(batch.preempted)
        # a beam's next token comes from its request's beam step, not from its own sampled row
        launched.pending_indices = [-1 if seq.params.use_beam_search else seq.append_pending()
                                    for seq in launched.seqs]
        for seq in launched.seqs:
            if seq.params.use_beam_search:
                seq.awaiting_beam_step = True
            else:
                seq.awaiting_last_token = self._reaches_length_limit(seq, seq.num_tokens)
        if in_flight is not None:
            deltas += self._process(in_flight)
        self.scheduler.advance([(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)
                                if not seq.is_finished], batch.forks)
        self.counters.steps += 1
        # (with async scheduling this step's time is mostly the wait for the one before: the same shape, steadily)
        self.scheduler.step_cost.observe(sum(batch.num_new_tokens), time.perf_counter() - start,
                                         batch.num_decodes < len(batch.seqs))
        if self.config.async_scheduling:
            self._in_flight = launched
        else:
            deltas += self._process(launched)
            if not self._requests:
                self.runner.settle()
        return deltas

    def _idle_step(self, in_flight: LaunchedStep | None, batch: ScheduledBatch) -> list[SampleDelta]:
        """Nothing to run: read the step still in flight, or tell a scheduler that can never run anything."""
        if in_flight is not None:
            deltas = self._process(in_flight)
            if not self._requests:
                self.runner.settle()
            return deltas
        stuck = len(self.scheduler.waiting) + len(self.scheduler.swapped)
        if stuck and not self.scheduler.running and not batch.preempted:  # for good
            raise RuntimeError(f"scheduler stalled: {stuck} waiting or swapped out, none runnable")
        return []

    def _needs_known_history(self, batch: ScheduledBatch) -> bool:
        """Penalties and grammars read the values of earlier output tokens: those must be known first."""
        return any(seq.num_pending_tokens and seq.params.needs_known_history for seq in batch.sampling_seqs)

    def _process(self, launched: LaunchedStep) -> list[SampleDelta]:
        """Read a launched step's sampled ids and hand them to their requests."""
        start = time.perf_counter()
        token_ids, logprobs = launched.wait()
        read = time.perf_counter()
        self.counters.wait_seconds += read - start
        deltas = []
        samples = self._samples
        for row, (seq, index, token_id) in enumerate(zip(launched.seqs, launched.pending_indices, token_ids)):
            if index < 0:  # a beam: its row's log-probs go to its request's next beam step
                deltas += self.beams.collect(seq, launched.beam_logprobs[row])
                continue
            sample = samples.get(seq.seq_id)
            if sample is None or seq.is_finished:
                continue  # aborted, or stopped by the step before: this token is past its end
            seq.resolve(index, token_id)
            try:
                if row in launched.failures:
                    raise RuntimeError(launched.failures[row])
                deltas.append(self._accept(sample, token_id, logprobs[row]))
            except Exception as exc:  # noqa: BLE001 - this request's fault: it ends with an error, others run on
                deltas.append(self._fail(sample, exc))
        self.counters.generation_tokens += len(deltas)
        self.counters.output_seconds += time.perf_counter() - read
        return deltas

    def _accept(self, sample: _Sample, token_id: int, token_logprobs: TokenLogprobs | None) -> SampleDelta:
        seq = sample.seq
        accept_grammar(seq, token_id)
        status = self._stop_status(seq, token_id)
        if status is not None:
            self._finish(seq, status)
        return self._emit(sample, [token_logprobs] if token_logprobs is not None else None)

    def _fail(self, sample: _Sample, exc: Exception) -> SampleDelta:
        """End one sample because of an error of its own; its final delta carries the error."""
        seq = sample.seq
        logger.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc, exc_info=exc)
        sample.error = f"{type(exc).__name__}: {exc}"
        if seq.is_finished:
            seq.status = SequenceStatus.FINISHED_FAILED
        else:
            self._finish(seq, SequenceStatus.FINISHED_FAILED)
        return self._emit(sample)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.drop_pending()
        self.scheduler.finish(seq, status)
        self.runner.forget(seq)

    def _reaches_length_limit(self, seq: Sequence, num_tokens: int) -> bool:
        num_output = num_tokens - seq.num_prompt_tokens
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and num_output >= max_tokens) or num_tokens >= self.config.max_model_len

    def _stop_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """EOS, a stop token or the length limit (stop strings are the output processor's: it sees text)."""
        params = seq.params
        if token_id in self.config.eos_token_ids and not params.ignore_eos:
            return SequenceStatus.FINISHED_STOPPED  # (the sampler masks EOS until min_tokens)
        if token_id in params.stop_token_ids:
            seq.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if self._reaches_length_limit(seq, seq.num_known_tokens):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _emit(self, sample: _Sample, logprobs: list[TokenLogprobs] | None = None) -> SampleDelta:
        seq = sample.seq
        first_output, num_output = seq.num_prompt_tokens, seq.num_known_tokens - seq.num_prompt_tokens
        new_ids = seq.token_ids[first_output + sample.num_sent : first_output + num_output]
        sample.num_sent = num_output
        finish_reason = seq.status.finish_reason
        if finish_reason is not None and self._samples.pop(seq.seq_id, None) is not None:
            self.counters.finished[finish_reason] += 1
            request = self._requests[seq.request_id]
            request.num_open -= 1
            if not request.num_open:
                del self._requests[seq.request_id]
                if request.group.params.structured_output is not None:
                    release_free_heap()  # (its matchers: tens of MB for a large grammar, times its samples' copies)
        queued = None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time
        return SampleDelta(seq.request_id, seq.index, new_ids, logprobs, finish_reason,
                           seq.stop_reason if isinstance(seq.stop_reason, int) else None,
                           max(seq.num_cached_tokens, 0), queued, None, sample.error)

    # pinned prefixes --------------------------------------------------------------------------------

    def pin_prefix(self, pin_id: str, token_ids: SequenceOf[int], cache_salt: str | None, share: float = 1.0,
                   group: str | None = None, group_share: float = 1.0) -> int:
        """Pin the cached full blocks of ``token_ids`` (computed by an earlier request) against eviction, all or
        none; returns how many were pinned (0 when caching is off, they were evicted, or over the cap). All pins
        together hold at most ``share`` of the KV pool, and the pins of one ``group`` (an API key's presets) at
        most ``group_share`` of it."""
        probe = Sequence(seq_id=-1, request_id=pin_id, token_ids=list(token_ids), params=SamplingParams(),
                         cache_salt=cache_salt)
        self.block_manager.update_block_hashes(probe)
        self._pin_tokens[pin_id] = len(probe.token_ids)
        self._pin_groups[pin_id] = group
        blocks = self.block_manager
        group_pins = {other: len(held) for other, held in blocks.pins.items()
                      if other != pin_id and group is not None and self._pin_groups.get(other) == group}
        cap = pin_cap(blocks.num_blocks, blocks.num_pinned_blocks, share, group_pins if group else None, group_share)
        return blocks.pin(pin_id, probe.block_hashes, cap)

    def unpin_prefix(self, pin_id: str) -> None:
        self._pin_tokens.pop(pin_id, None)
        self._pin_groups.pop(pin_id, None)
        self.block_manager.unpin(pin_id)

    def pins(self) -> dict[str, tuple[int, int]]:
        """Every pin asked for and not unpinned: pin id -> (its tokens, blocks pinned now). Blocks can be 0: over
        the cap, or released since to make room (the scheduler drops pins before it preempts)."""
        held = self.block_manager.pins
        return {pin_id: (tokens, len(held.get(pin_id, ()))) for pin_id, tokens in self._pin_tokens.items()}

    def stats(self) -> EngineStats:
        return EngineStats.collect(self.block_manager.stats(), self.scheduler, self.counters)


def pin_cap(num_blocks: int, num_pinned: int, share: float, group_pins: dict[str, int] | None,
            group_share: float) -> int:
    """The cap ``BlockManager.pin`` holds all pins to (``num_pinned + new <= cap``) for a new pin: ``share`` of
    the pool, and for a pin of a group (an API key's presets) also what the group's other pins (``group_pins``:
    pin id -> blocks) left of its ``group_share``."""
    cap = int(share * num_blocks)
    if group_pins is None:
        return cap
    room = int(group_share * num_blocks) - sum(group_pins.values())
    return min(cap, num_pinned + max(room, 0))
