"""EngineCore: requests in, one ``step()`` at a time, token-id deltas out.

The core owns what runs at the device's pace: the scheduler, the block manager, the model runner (CUDA graphs,
async scheduling), grammars and beam search. It knows no text: detokenizing, stop strings, logprob formatting and
building RequestOutputs belong to the output processor (output_processor.py), which runs beside it in-process
(llm_engine.py) or in the server's process (async_engine.py, with the core in a process of its own). A stop
string found there ends the sample here through ``abort_request(request_id, index, "stop")``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as SequenceOf

import torch

from engine.runtime.beam_requests import BeamRequests
from engine.runtime.core_parts import flush_kv_tiers, new_block_manager, new_scheduler, warm_prefix
from engine.runtime.speculative_steps import new_speculative_steps
from engine.output.beam_search import new_beam_group
from engine.config import EngineConfig
from engine.core.core_info import CoreInfo, check_priority, check_request
from engine.sample.token_logprobs import TokenLogprobs
from engine.worker.loader import load_model
from engine.worker.tokenizer_files import grammar_source_loading
from engine.core.metrics import EngineCounters, EngineStats
from engine.worker.model_runner import ModelRunner
from engine.worker.step_sampler import LaunchedStep
from engine.worker.warm_up import warm_up
from engine.output.outputs import SampleDelta
from engine.runtime.requests import Request, Sample, hold_places, new_sequences, stop_status
from engine.core.prefix_pins import PrefixPins
from engine.sampling_params import SamplingParams
from engine.core.scheduled_batch import ScheduledBatch
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.free_heap import release_free_heap
from engine.output.grammar_compiler import GrammarCompiler
from engine.output.structured_output import accept as accept_grammar
from engine.distributed.parallel_state import set_rank_threads
from engine.worker.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

_FINISH_STATUS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "abort": SequenceStatus.FINISHED_ABORTED,
    "error": SequenceStatus.FINISHED_FAILED,
}


class EngineCore:
    def __init__(
        self,
        config: EngineConfig | None = None,
        tokenizer_in_background: bool = False,
        **options: object,
    ) -> None:
        """``tokenizer_in_background``: structured output's tokenizer (its file, for llguidance) loads after the model, on a
        thread; the core needs no other."""
        self.config = config = (config or EngineConfig(**options)).resolve()
        # (restored by shutdown: ranks on the CPU share the cores)
        self._threads_before = set_rank_threads(
            config.num_threads, config.tensor_parallel_size, config.torch_device
        )
        torch.manual_seed(config.seed)
        # tensor parallelism: this process is rank 0; the other ranks load their shards meanwhile
        self.workers = WorkerGroup(config) if config.tensor_parallel_size > 1 else None
        num_blocks, window_blocks = self._load(tokenizer_in_background)
        self.block_manager = new_block_manager(config, self.runner, num_blocks, window_blocks)
        self.scheduler = new_scheduler(config, self.runner, self.block_manager)
        self.counters = EngineCounters()
        # (None: off)
        self.speculation = new_speculative_steps(
            config, self.scheduler, self.counters, self.runner, self._finish, self._emit, self._fail
        )
        self.info = CoreInfo.of(
            config, self.model.args.vocab_size, num_blocks, bool(self.speculation)
        )
        self._requests: dict[str, Request] = {}
        self.prefix_pins = PrefixPins(self.block_manager)
        self._samples: dict[int, Sample] = {}  # seq_id -> its sample, for every unfinished one
        self.beams = BeamRequests(
            self.scheduler,
            self.block_manager,
            self.counters,
            self.runner.forget,
            self._finish,
            lambda request_id: self._requests.pop(request_id).group.params.n,
        )
        self._seq_ids = itertools.count()
        self._in_flight: LaunchedStep | None = None  # launched, ids not read yet (async)
        self.last_batch: ScheduledBatch | None = None  # the latest schedule (benchmarks read it)

    def _load(self, tokenizer_later: bool) -> tuple[int, int]:
        """The model, its runner and the KV cache sized to the memory budget (its blocks, and the sliding-window
        layers' own), the CUDA graphs recorded over it; the other ranks stopped if any of it fails."""
        try:
            self.model, self.tokenizer = load_model(self.config, not tokenizer_later)
            source = self.tokenizer
            if tokenizer_later and self.config.model_path is not None:  # (a Future: grammars wait)
                source = grammar_source_loading(self.config.model_path)
            args = (self.model.args.vocab_size, self.config.eos_token_ids)
            self.grammars = GrammarCompiler(source, *args)
            if self.workers is not None:
                self.workers.wait_ready()
            self.runner = ModelRunner(self.config, self.model, self.workers)
            blocks = self.runner.size_kv_cache()
            self.runner.capture_graphs()
            self.warm_up_seconds = warm_up(self.runner, *blocks)  # (0.0: not run)
        except BaseException:
            self.shutdown()
            raise
        return blocks

    def shutdown(self) -> None:
        """Finish writing the blocks handed to the lower KV tiers, and stop the other tensor-parallel ranks."""
        if getattr(self, "scheduler", None) is not None and self.scheduler.tiers is not None:
            self.flush_kv_tiers(timeout_s=30.0)
            self.scheduler.tiers.close()
        if self.workers is not None:
            if hasattr(self, "runner"):
                self.runner.release_graphs()
            self.workers.stop()
            torch.set_num_threads(self._threads_before)

    # requests -----------------------------------------------------------------------------------------

    def use_grammar_matchers(self, path: str) -> None:
        """Grammar matchers kept in the matcher server at ``path`` (the front's grammar zygote forks it)."""
        self.grammars.use_remote(path)

    def validate_request(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> None:
        check_request(self.info, prompt_token_ids, params, self.grammars)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        tenant: str = "",
        priority: int = 0,
        retain: bool = False,
    ) -> None:
        """``tenant``: who sent it (steps are shared fairly among tenants with work); ``priority``: its rank among
        that tenant's requests, lower first; ``retain``: a session's turn (Sequence.retain)."""
        params = params or SamplingParams()
        self.validate_request(prompt_token_ids, params)
        check_priority(priority)
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        # one matcher built (a large grammar's takes tens of milliseconds), copied for the other samples
        grammar = (
            self.grammars.matcher(params.structured_output)
            if params.structured_output is not None
            else None
        )
        seqs = new_sequences(
            self._seq_ids, request_id, prompt, params, grammar, cache_salt, tenant, priority
        )
        for seq in seqs:
            seq.retain = retain
        group = SequenceGroup(request_id, seqs, params)
        if params.use_beam_search:
            eos = () if params.ignore_eos else tuple(self.config.eos_token_ids)
            beam = new_beam_group(seqs, params, self.config.max_model_len - len(prompt), eos)
            request = Request(group, [], 0, beam=beam)
        else:
            request = Request(group, [Sample(seq) for seq in seqs], len(seqs))
        # nothing is registered before this point: a failure above leaves the engine as it was
        self._requests[request_id] = request
        if request.beam is not None:
            self.beams.add(request.beam)
        self._samples.update((sample.seq.seq_id, sample) for sample in request.samples)
        self.counters.prompt_tokens += len(prompt)
        self.scheduler.add(seqs[0])

    def abort_request(
        self, request_id: str, index: int | None = None, reason: str = "abort"
    ) -> list[SampleDelta]:
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
        """Requests to step, a step in flight, or blocks moving to or from the lower KV tiers."""
        tiers = self.scheduler.tiers
        return (
            bool(self._requests)
            or self._in_flight is not None
            or (tiers is not None and tiers.busy)
        )

    @property
    def has_step_in_flight(self) -> bool:
        """A launched step's sampled ids are not read yet (async scheduling)."""
        return self._in_flight is not None

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
        batch = self.last_batch = self.scheduler.schedule()
        in_flight, self._in_flight = self._in_flight, None
        if not batch.seqs:
            return self._idle_step(in_flight, batch)
        deltas: list[SampleDelta] = []
        if in_flight is not None and self._needs_known_tokens(batch):
            deltas += self._process(in_flight)
            in_flight, batch = None, batch.without_finished()
            if not batch.seqs:  # (every entry ended: its block moves run with the next step)
                self.scheduler.defer_moves(batch)
                self._preempted(batch.preempted)
                return deltas
        if self.speculation is not None:
            batch = self.last_batch = self.speculation.extend(batch)
        launch_start = time.perf_counter()
        self.counters.schedule_seconds += launch_start - start
        launched = self.runner.execute(batch, in_flight)
        self.counters.prepare_seconds += launched.prepare_seconds
        launch_seconds = time.perf_counter() - launch_start - launched.prepare_seconds
        self.counters.launch_seconds += launch_seconds
        self.beams.preempted(batch.preempted)
        launched.drafts = batch.drafts  # (their rows follow the plain ones: verified in _process)
        launched.pending_indices = hold_places(batch.plain_samples, self.config.max_model_len)
        if in_flight is not None:
            deltas += self._process(in_flight)
        self.scheduler.advance(batch.plain_entries(), batch.forks)
        self.counters.steps += 1
        # (with async scheduling this step's time is mostly the wait for the one before: the same shape, steadily)
        self.scheduler.step_cost.observe(
            sum(batch.num_new_tokens),
            time.perf_counter() - start,
            batch.num_decode_rows < batch.num_rows,
        )
        if self.config.async_scheduling and not batch.drafts:
            self._in_flight = launched
        else:
            deltas += self._process(launched)
            if not self._requests:
                self.runner.settle()
        return deltas

    def _idle_step(
        self, in_flight: LaunchedStep | None, batch: ScheduledBatch
    ) -> list[SampleDelta]:
        """Nothing to run: the batch's block moves run with the next pass; read the step still in flight, else
        release beams that hold blocks their search waits for, or tell a scheduler that can never run anything."""
        self.scheduler.defer_moves(batch)
        self._preempted(batch.preempted)
        if in_flight is not None:
            deltas = self._process(in_flight)
            if not self._requests:
                self.runner.settle()
            return deltas
        if (tiers := self.scheduler.tiers) is not None and tiers.busy:
            tiers.poll(timeout_s=0.05)  # (waiting requests wait for blocks coming back)
            return []
        if (deltas := self.beams.unstall()) is not None:
            return deltas
        stuck = len(self.scheduler.waiting) + len(self.scheduler.swapped)
        if stuck and not self.scheduler.running and not batch.preempted:  # for good
            raise RuntimeError(f"scheduler stalled: {stuck} waiting or swapped out, none runnable")
        return []

    def _preempted(self, seqs: list[Sequence]) -> None:
        """Preempted sequences outside a pass: their input rows go, a recomputed beam's log-probs too."""
        for seq in seqs:
            self.runner.forget(seq)
        self.beams.preempted(seqs)

    def _needs_known_tokens(self, batch: ScheduledBatch) -> bool:
        """Penalties and grammars read the values of earlier output tokens, drafts follow the last one: those must
        be known first (the step in flight read before this one launches)."""
        return any(
            seq.num_pending_tokens and seq.params.needs_known_history for seq in batch.sampling_seqs
        ) or (self.speculation is not None and self.speculation.wants_known(batch))

    def _process(self, launched: LaunchedStep) -> list[SampleDelta]:
        """Read a launched step's sampled ids and hand them to their requests."""
        start = time.perf_counter()
        token_ids, logprobs = launched.wait()
        read = time.perf_counter()
        self.counters.wait_seconds += read - start
        deltas = []
        samples = self._samples
        for row, (seq, index, token_id) in enumerate(
            zip(launched.seqs, launched.pending_indices, token_ids)
        ):
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
        if launched.drafts:
            verified, gained = self.speculation.apply(launched, token_ids, logprobs, samples)
            deltas += verified
            self.counters.generation_tokens += gained
        self.counters.output_seconds += time.perf_counter() - read
        return deltas

    def _accept(
        self, sample: Sample, token_id: int, token_logprobs: TokenLogprobs | None
    ) -> SampleDelta:
        seq = sample.seq
        if seq.grammar is not None:
            accept_grammar(seq, token_id)
        status = stop_status(seq, token_id, self.config.eos_token_ids, self.config.max_model_len)
        if status is not None:
            self._finish(seq, status)
        return self._emit(sample, [token_logprobs] if token_logprobs is not None else None)

    def _fail(self, sample: Sample, exc: Exception) -> SampleDelta:
        """End one sample because of an error of its own; its final delta carries the error."""
        seq = sample.seq
        logger.error(
            "request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc, exc_info=exc
        )
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

    def _emit(self, sample: Sample, logprobs: list[TokenLogprobs] | None = None) -> SampleDelta:
        delta = sample.take_delta(logprobs)
        seq = sample.seq
        if delta.finish_reason is not None and self._samples.pop(seq.seq_id, None) is not None:
            self.counters.finished[delta.finish_reason] += 1
            request = self._requests[seq.request_id]
            request.num_open -= 1
            if not request.num_open:
                del self._requests[seq.request_id]
                if request.group.params.structured_output is not None:
                    # (its matchers: tens of MB for a large grammar, times its samples' copies)
                    release_free_heap()
        return delta

    # pinned prefixes (prefix_pins.py) -----------------------------------------------------------------

    def pin_prefix(
        self,
        pin_id: str,
        token_ids: SequenceOf[int],
        cache_salt: str | None,
        share: float = 1.0,
        group: str | None = None,
        group_share: float = 1.0,
    ) -> int:
        return self.prefix_pins.pin(pin_id, token_ids, cache_salt, share, group, group_share)

    def unpin_prefix(self, pin_id: str) -> None:
        self.prefix_pins.unpin(pin_id)

    def pins(self) -> dict[str, tuple[int, int]]:
        return self.prefix_pins.pins()

    # the KV tiers below the host (engine/core/tier_blocks.py) -------------------------------------------

    def warm_prefix(self, token_ids: SequenceOf[int], cache_salt: str | None = None) -> int:
        """Start bringing the blocks of ``token_ids`` back from the lower tiers; the number on their way."""
        return warm_prefix(self.scheduler, token_ids, cache_salt)

    def flush_kv_tiers(self, timeout_s: float = 60.0) -> bool:
        """Wait until every block handed to the lower tiers is written and settled; False at the timeout."""
        return flush_kv_tiers(self.scheduler.tiers, timeout_s)

    def stats(self) -> EngineStats:
        return EngineStats.collect(self.block_manager.stats(), self.scheduler, self.counters)
