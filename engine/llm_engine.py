"""LLMEngine: requests in, one ``step()`` at a time, deltas out. LLM: the offline API on top of it."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence as SequenceOf

import torch

from engine.beam_search import BeamSearch
from engine.block_manager import BlockHasher, BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.layers.sampler import TokenLogprobs
from engine.loader import load_model
from engine.metrics import EngineCounters, EngineStats
from engine.model_runner import LaunchedStep, ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.structured_output import GrammarCompiler, accept as accept_grammar

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: the new part (``*_delta``) and everything so far.

    ``token_ids`` (every output token so far) is copied on demand from the sequence's own token list, whose
    first ``num_output_tokens`` outputs never change once known: copying a long output for every request at
    every step was a third of the engine's host time at batch 256."""

    request_id: str
    text: str
    text_delta: str
    token_ids_delta: list[int]
    logprobs: list[TokenLogprobs] | None  # every output token's, when asked for
    logprobs_delta: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None  # stop | length | abort
    stop_reason: int | str | None  # the stop token id or stop string, when one ended the request
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_time: float | None = None  # seconds from arrival to first scheduling; None while still queued
    block_hashes: list[str] | None = None  # on the final output: hex hashes of the full blocks of prompt + output
    error: str | None = None  # finish_reason "error": what went wrong with this request (the others run on)
    index: int = 0  # which of the request's samples (n > 1 or best_of): OpenAI's choices[i].index
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, where they were computed
    num_output_tokens: int = 0
    _tokens: list[int] = field(default_factory=list, repr=False)  # the sequence's token ids (prompt first)
    _first_output: int = 0  # where its outputs start in ``_tokens``

    @property
    def token_ids(self) -> list[int]:
        return self._tokens[self._first_output : self._first_output + self.num_output_tokens]

    @property
    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)


@dataclass(slots=True, eq=False)
class _Choice:
    """One sample of a request and what has been handed out of it."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    text: str = ""  # handed out so far
    num_emitted: int = 0  # output tokens handed out so far
    logprobs: list[TokenLogprobs] | None = field(default=None)
    cumulative_logprob: float = 0.0
    error: str | None = None


@dataclass(slots=True, eq=False)
class _BeamGroup:
    """A beam-search request's beams: ``beams[:num_live]`` run, best first; the logits of each are collected
    until every live beam has them (a preempted beam computes its own again), then the search takes a step."""

    search: BeamSearch
    beams: list[Sequence]
    num_live: int = 1  # the prompt's sequence, until the first step
    collected: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> next-token log-probs


@dataclass(slots=True, eq=False)
class _Request:
    group: SequenceGroup
    choices: list[_Choice]
    num_open: int  # choices not finished yet
    beam: _BeamGroup | None = None


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a seeded request: sample 0 keeps it (n = 1 is unchanged), the others
    get their own, each a pure function of (seed, index), so every sample is reproducible on its own."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


def best_choices(finals: list[RequestOutput], n: int) -> list[RequestOutput]:
    """``best_of``: the ``n`` final outputs of highest cumulative logprob (ties: lower index first),
    renumbered 0..n-1 in that order."""
    ranked = sorted(finals, key=lambda out: (-(out.cumulative_logprob or 0.0), out.index))[:n]
    return [dataclasses.replace(out, index=i) for i, out in enumerate(ranked)]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **options: Any) -> None:
        self.config = config = config or EngineConfig(**options)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.model, self.tokenizer = load_model(config)
        self.runner = ModelRunner(config, self.model)
        self.grammars = GrammarCompiler(self.tokenizer, self.model.args.vocab_size, config.eos_token_ids)
        num_blocks = self._size_kv_cache()
        self.runner.capture_graphs()
        hasher = BlockHasher(config.prefix_hash, config.model_id, config.prefix_cache_seed)
        num_host_blocks = num_host_cache_blocks = 0
        if config.preemption_mode != "recompute":
            num_host_blocks = int(config.swap_space_gib * 2**30) // self.runner.bytes_per_block
        if config.enable_prefix_caching:
            num_host_cache_blocks = int(config.host_cache_gib * 2**30) // self.runner.bytes_per_block
        if num_host_blocks + num_host_cache_blocks:
            self.runner.allocate_host_cache(num_host_blocks + num_host_cache_blocks)
        if num_host_cache_blocks:
            logger.info("host tier of the prefix cache: %d blocks (%.2f GiB)", num_host_cache_blocks,
                        num_host_cache_blocks * self.runner.bytes_per_block / 2**30)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, hasher,
                                          num_host_blocks, num_host_cache_blocks, self.runner.kv.lookahead_tokens,
                                          config.max_blocks_per_seq)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   prefer_swap=self._prefer_swap)
        self.counters = EngineCounters()
        self._requests: dict[str, _Request] = {}
        self._choices: dict[int, _Choice] = {}  # seq_id -> its choice, for every unfinished sample
        self._beams: dict[int, _BeamGroup] = {}  # seq_id -> its beam-search request, for every beam
        self._beams_swapped_at_step: list[_BeamGroup] = []  # beam steps waiting for their beams' swap-in
        self._seq_ids = itertools.count()
        self._in_flight: LaunchedStep | None = None  # launched, sampled ids not read yet (async scheduling)
        self.last_batch: ScheduledBatch | None = None  # the latest step's schedule (benchmarks read its shape)

    def _prefer_swap(self, seq: Sequence) -> bool:
        """``preemption_mode``: swap or recompute this victim. ``auto``: a sample of a request with n > 1 (or
        best_of) or a beam is swapped, with all its request's running sequences (the paper's rule: they share
        their history, and the host keeps one copy of each shared block); otherwise the cheaper of the copy
        out and back over the host link and the recompute of its tokens, by rough device rates. Where the host
        pool has no room, a victim is recomputed."""
        mode = self.config.preemption_mode
        if mode == "recompute":
            return False
        if mode == "swap" or seq.params.num_sequences > 1 or seq.params.use_beam_search:
            return True
        link, flops = (25e9, 4e14) if self.config.torch_device.type == "cuda" else (5e9, 2e11)
        copy_seconds = 2 * len(seq.block_table) * self.runner.bytes_per_block / link
        recompute_seconds = 2 * self.runner.num_parameters * seq.num_computed_tokens / flops
        return copy_seconds < recompute_seconds

    def _size_kv_cache(self) -> int:
        config, runner = self.config, self.runner
        num_blocks = runner.num_blocks_for_budget()
        if num_blocks < 2:
            raise RuntimeError(f"KV cache: room for only {num_blocks} blocks of {runner.bytes_per_block} bytes; "
                               "raise kv_cache_memory_gib / gpu_memory_utilization or num_kv_blocks")
        if config.max_model_len > num_blocks * config.block_size:
            logger.warning("max_model_len %d capped to the KV pool's %d tokens", config.max_model_len,
                           num_blocks * config.block_size)
            config.max_model_len = num_blocks * config.block_size
        runner.allocate_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB, %d tokens); max_model_len %d", num_blocks,
                    config.block_size, num_blocks * runner.bytes_per_block / 2**30,
                    num_blocks * config.block_size, config.max_model_len)
        return num_blocks

    # requests -----------------------------------------------------------------------------------------

    def validate_request(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> None:
        """ValueError naming the field when the request can never run (callable from any thread)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model.args.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens leave no room to generate within "
                             f"max_model_len={self.config.max_model_len}")
        if params.top_k > vocab:
            raise ValueError(f"top_k: must be at most the vocabulary size ({vocab}), or -1 / 0 for off")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if params.structured_output is not None:
            self.grammars.validate(params.structured_output)
        if params.num_sequences > self.config.max_num_seqs:
            field_name = "beam_width" if params.use_beam_search else "best_of" if params.best_of else "n"
            raise ValueError(f"{field_name}: {params.num_sequences} sequences exceed max_num_seqs="
                             f"{self.config.max_num_seqs}")

    def add_request(self, request_id: str, prompt_token_ids: SequenceOf[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        params = params or SamplingParams()
        self.validate_request(prompt_token_ids, params)
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        if params.use_beam_search:
            self._add_beam_search(request_id, prompt, params, cache_salt)
            return
        # best_of ranks samples by cumulative logprob: each sample's token logprob is computed (not handed out
        # unless asked for)
        seq_params = params if params.best_of is None or params.logprobs is not None else \
            dataclasses.replace(params, logprobs=0)
        choices = []
        for index in range(params.num_sequences):
            own = seq_params if index == 0 or params.seed is None else \
                dataclasses.replace(seq_params, seed=sample_seed(params.seed, index))
            seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, token_ids=list(prompt), params=own,
                           cache_salt=cache_salt, index=index)
            if params.structured_output is not None:
                seq.grammar = self.grammars.matcher(params.structured_output)
            detok = IncrementalDetokenizer(self.tokenizer, prompt, params) if self.tokenizer else None
            choices.append(_Choice(seq, detok, logprobs=[] if params.logprobs is not None else None))
        # nothing is registered before this point: a failure above leaves the engine as it was
        seqs = [choice.seq for choice in choices]
        seqs[0].unforked = seqs[1:]  # computed once, then forked (sharing the prompt's blocks)
        self._requests[request_id] = _Request(SequenceGroup(request_id, seqs, params), choices, len(choices))
        self._choices.update((choice.seq.seq_id, choice) for choice in choices)
        self.counters.prompt_tokens += len(prompt)
        self.scheduler.add(seqs[0])

    def _add_beam_search(self, request_id: str, prompt: list[int], params: SamplingParams,
                         cache_salt: str | None) -> None:
        beams = [Sequence(seq_id=next(self._seq_ids), request_id=request_id, token_ids=list(prompt), params=params,
                          cache_salt=cache_salt, index=i) for i in range(params.beam_width)]
        beams[0].unforked = beams[1:]  # their places are held until the prompt's step
        room = self.config.max_model_len - len(prompt)
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = () if params.ignore_eos else tuple(self.config.eos_token_ids)
        group = _BeamGroup(BeamSearch(params.beam_width, max_new, eos, params.length_penalty, params.early_stopping),
                           beams)
        self._requests[request_id] = _Request(SequenceGroup(request_id, beams, params), [], 0, beam=group)
        self._beams.update((seq.seq_id, group) for seq in beams)
        self.counters.prompt_tokens += len(prompt)
        self.scheduler.add(beams[0])

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """End a request now; returns the final output (finish_reason ``abort``) of each sample not finished
        yet (none if the request is unknown or done)."""
        request = self._requests.get(request_id)
        if request is None:
            return []
        if request.beam is not None:
            return self._finish_beams(request.beam, SequenceStatus.FINISHED_ABORTED)
        outputs = []
        for choice in request.choices:
            if not choice.seq.is_finished:
                self._finish(choice.seq, SequenceStatus.FINISHED_ABORTED)
                outputs.append(self._emit(choice))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._in_flight is not None

    # the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, launch one forward pass and its sampling, then read sampled ids, detokenize and check
        stops; one output per request that received a token.

        With ``async_scheduling`` the ids read are the previous step's: step N+1 is scheduled and launched
        while the device still runs step N, whose tokens are then read and processed while N+1 runs. Each
        sequence sampled by step N holds a PENDING_TOKEN in its token ids, and step N+1 takes that token's
        id from N's sampled ids on the device. A sequence that stops at N (EOS, stop string) still gets
        one wasted row in N+1; a sequence whose pending token is its last by length is not scheduled again.
        """
        outputs = self._deferred_beam_steps() if self._beams_swapped_at_step else []
        return outputs + self._step()

    def _deferred_beam_steps(self) -> list[RequestOutput]:
        """Beam steps whose log-probs were complete while the request's beams were swapped out: taken once the
        beams are back on the device (before the schedule, which then runs the new beams)."""
        outputs, waiting = [], []
        for beam in self._beams_swapped_at_step:
            live = beam.beams[:beam.num_live]
            if any(seq.is_finished for seq in live):
                continue  # aborted meanwhile
            if all(seq.status is SequenceStatus.RUNNING for seq in live):
                outputs += self._beam_step(beam)
            else:
                waiting.append(beam)
        self._beams_swapped_at_step = waiting
        return outputs

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        self.last_batch = batch
        launch_start = time.perf_counter()
        self.counters.schedule_seconds += launch_start - start
        in_flight, self._in_flight = self._in_flight, None
        if not batch.seqs:
            if in_flight is not None:
                outputs = self._process(in_flight)
                if not self._requests:
                    self.runner.settle()
                return outputs
            stuck = len(self.scheduler.waiting) + len(self.scheduler.swapped)
            if stuck and not self.scheduler.running and not batch.preempted:  # for good
                raise RuntimeError(f"scheduler stalled: {stuck} waiting or swapped out, none runnable")
            return []
        outputs: list[RequestOutput] = []
        if in_flight is not None and self._needs_known_history(batch):
            outputs += self._process(in_flight)
            in_flight = None
        launched = self.runner.execute(batch, in_flight)
        self.counters.prepare_seconds += launched.prepare_seconds
        self.counters.launch_seconds += time.perf_counter() - launch_start - launched.prepare_seconds
        for seq in batch.preempted:  # a recomputed beam computes its log-probs again; a swapped one keeps them
            if (beam := self._beams.get(seq.seq_id)) is not None and seq.status is not SequenceStatus.SWAPPED:
                beam.collected.pop(seq.seq_id, None)
        # a beam's next token comes from its request's beam step, not from its own sampled row
        launched.pending_indices = [-1 if seq.params.use_beam_search else seq.append_pending()
                                    for seq in launched.seqs]
        for seq in launched.seqs:
            if seq.params.use_beam_search:
                seq.awaiting_beam_step = True
            else:
                seq.awaiting_last_token = self._reaches_length_limit(seq, seq.num_tokens)
        if in_flight is not None:
            outputs += self._process(in_flight)
        self.scheduler.advance([(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)
                                if not seq.is_finished], batch.forks)
        self.counters.steps += 1
        if self.config.async_scheduling:
            self._in_flight = launched
        else:
            outputs += self._process(launched)
            if not self._requests:
                self.runner.settle()
        return outputs

    def _needs_known_history(self, batch: ScheduledBatch) -> bool:
        """Penalties and grammars read the values of earlier output tokens: those must be known first."""
        return any(seq.num_pending_tokens and seq.params.needs_known_history for seq in batch.sampling_seqs)

    def _process(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's sampled ids and hand them to their requests."""
        start = time.perf_counter()
        token_ids, logprobs = launched.wait()
        read = time.perf_counter()
        self.counters.wait_seconds += read - start
        outputs = []
        choices = self._choices
        for row, (seq, index, token_id) in enumerate(zip(launched.seqs, launched.pending_indices, token_ids)):
            if index < 0:  # a beam: its row's log-probs go to its request's next beam step
                beam = self._beams.get(seq.seq_id)
                # (a beam swapped out after this pass keeps its log-probs: its KV was written before the copy)
                if beam is not None and seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
                    beam.collected[seq.seq_id] = launched.beam_logprobs[row]
                    if len(beam.collected) == beam.num_live:
                        if all(b.status is SequenceStatus.RUNNING for b in beam.beams[:beam.num_live]):
                            outputs += self._beam_step(beam)
                        else:  # swapped out (all together): the step waits for their swap-in
                            self._beams_swapped_at_step.append(beam)
                continue
            choice = choices.get(seq.seq_id)
            if choice is None or seq.is_finished:
                continue  # aborted, or stopped by the step before: this token is past its end
            seq.resolve(index, token_id)
            try:
                if row in launched.failures:
                    raise RuntimeError(launched.failures[row])
                outputs.append(self._accept(choice, token_id, logprobs[row]))
            except Exception as exc:  # noqa: BLE001 - this request's fault: it ends with an error, others run on
                outputs.append(self._fail(choice, exc))
        self.counters.generation_tokens += len(outputs)
        self.counters.output_seconds += time.perf_counter() - read
        return outputs

    def _beam_step(self, beam: _BeamGroup) -> list[RequestOutput]:
        """Every live beam has its next-token log-probs: select the next beams; each continues one of the
        current beams (sharing its blocks, copy-on-write) with one more token."""
        live = beam.beams[:beam.num_live]
        log_probs = torch.stack([beam.collected[seq.seq_id] for seq in live])
        beam.collected.clear()
        next_beams = beam.search.step(log_probs, [seq.token_ids[seq.num_prompt_tokens:] for seq in live])
        self.counters.generation_tokens += len(live)
        if beam.search.done:
            return self._finish_beams(beam, None)
        if beam.num_live == 1:
            self.scheduler.start_beams(live[0])
            beam.num_live = len(beam.beams)
        sources = [live[b.parent] for b in next_beams]
        token_ids = [src.token_ids + [b.token_id] for src, b in zip(sources, next_beams)]
        self.block_manager.reassign(beam.beams, sources)
        for seq, ids in zip(beam.beams, token_ids):
            seq.token_ids = ids
            seq.awaiting_beam_step = False
            self.runner.forget(seq)  # its block table changed as a whole
        return []

    def _finish_beams(self, beam: _BeamGroup, status: SequenceStatus | None) -> list[RequestOutput]:
        """End a beam search (``status`` None: it is done; else aborted): the ``n`` best hypotheses, or for
        an abort the best found so far, else the live beams."""
        first = beam.beams[0]
        request = self._requests.pop(first.request_id)
        for seq in beam.beams:
            if not seq.is_finished:
                self._finish(seq, status or SequenceStatus.FINISHED_STOPPED)
            self._beams.pop(seq.seq_id, None)
        n = request.group.params.n
        found = [(h.token_ids, h.sum_logprobs) for h in beam.search.best(n)]
        found += [(seq.token_ids[seq.num_prompt_tokens:], None) for seq in beam.beams[:beam.num_live]]
        found += [([], None)] * n  # (never short of n: the stream waits for n final outputs)
        eos = set(beam.search.eos_token_ids)
        queued = None if first.first_scheduled_time is None else first.first_scheduled_time - first.arrival_time
        outputs = []
        for index, (ids, logprob) in enumerate(found[:n]):
            reason = "abort" if status is not None else "stop" if ids and ids[-1] in eos else "length"
            self.counters.finished[reason] += 1
            skip = request.group.params.skip_special_tokens
            text = self.tokenizer.decode(ids, skip_special_tokens=skip) if self.tokenizer else ""
            outputs.append(RequestOutput(
                request_id=first.request_id, text=text, text_delta=text, token_ids_delta=list(ids), logprobs=None,
                logprobs_delta=None, finished=True, finish_reason=reason, stop_reason=None,
                num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=max(first.num_cached_tokens, 0),
                queue_time=queued, index=index, cumulative_logprob=logprob, num_output_tokens=len(ids), _tokens=list(ids),
            ))
        return outputs

    def _accept(self, choice: _Choice, token_id: int, token_logprobs: TokenLogprobs | None) -> RequestOutput:
        seq = choice.seq
        if token_logprobs is not None:
            choice.cumulative_logprob += token_logprobs.logprob
            if choice.logprobs is not None:
                choice.logprobs.append(token_logprobs)
        accept_grammar(seq, token_id)
        status = self._stop_status(seq, token_id, choice.detokenizer)
        if status is not None:
            self._finish(seq, status)
        return self._emit(choice)

    def _fail(self, choice: _Choice, exc: Exception) -> RequestOutput:
        """End one sample because of an error of its own; its final output carries the error."""
        seq = choice.seq
        logger.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc, exc_info=exc)
        choice.error = f"{type(exc).__name__}: {exc}"
        choice.detokenizer = None  # it may be what failed: no more text
        if seq.is_finished:
            seq.status = SequenceStatus.FINISHED_FAILED
        else:
            self._finish(seq, SequenceStatus.FINISHED_FAILED)
        return self._emit(choice)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.drop_pending()
        self.scheduler.finish(seq, status)
        self.runner.forget(seq)

    def _reaches_length_limit(self, seq: Sequence, num_tokens: int) -> bool:
        num_output = num_tokens - seq.num_prompt_tokens
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and num_output >= max_tokens) or num_tokens >= self.config.max_model_len

    def _stop_status(self, seq: Sequence, token_id: int, detok: IncrementalDetokenizer | None
                     ) -> SequenceStatus | None:
        params = seq.params
        if token_id in self.config.eos_token_ids and not params.ignore_eos:
            return SequenceStatus.FINISHED_STOPPED  # (the sampler masks EOS until min_tokens)
        if token_id in params.stop_token_ids:
            seq.stop_reason = token_id
            if detok is not None and params.include_stop_str_in_output:
                detok.update([token_id])
            return SequenceStatus.FINISHED_STOPPED
        if detok is not None and (matched := detok.update([token_id])) is not None:
            seq.stop_reason = matched
            return SequenceStatus.FINISHED_STOPPED
        if self._reaches_length_limit(seq, seq.num_known_tokens):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _emit(self, choice: _Choice) -> RequestOutput:
        seq = choice.seq
        finished = seq.is_finished
        first_output, num_output = seq.num_prompt_tokens, seq.num_known_tokens - seq.num_prompt_tokens
        text_delta = choice.detokenizer.take_delta(finished) if choice.detokenizer else ""
        choice.text += text_delta
        delta_ids = seq.token_ids[first_output + choice.num_emitted : first_output + num_output]
        logprobs_delta = choice.logprobs[choice.num_emitted :] if choice.logprobs is not None else None
        choice.num_emitted = num_output
        if finished and self._choices.pop(seq.seq_id, None) is not None:
            self.counters.finished[seq.status.finish_reason] += 1
            request = self._requests[seq.request_id]
            request.num_open -= 1
            if not request.num_open:
                del self._requests[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id, text=choice.text, text_delta=text_delta, token_ids_delta=delta_ids,
            logprobs=choice.logprobs, logprobs_delta=logprobs_delta,
            finished=finished, finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=max(seq.num_cached_tokens, 0),
            queue_time=None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time,
            block_hashes=self._block_hashes(seq) if finished else None, error=choice.error, index=seq.index,
            cumulative_logprob=choice.cumulative_logprob if seq.params.logprobs is not None else None,
            num_output_tokens=num_output, _tokens=seq.token_ids, _first_output=first_output,
        )

    def _block_hashes(self, seq: Sequence) -> list[str]:
        self.block_manager.update_block_hashes(seq)
        return [h.hex() for h in seq.block_hashes]

    # pinned prefixes --------------------------------------------------------------------------------

    def pin_prefix(self, pin_id: str, token_ids: SequenceOf[int], cache_salt: str | None,
                   max_pinned_blocks: int) -> int:
        """Pin the cached full blocks of ``token_ids`` (computed by an earlier request) against eviction;
        returns how many were pinned (0 when caching is off, they were evicted, or over the cap)."""
        probe = Sequence(seq_id=-1, request_id=pin_id, token_ids=list(token_ids), params=SamplingParams(),
                         cache_salt=cache_salt)
        self.block_manager.update_block_hashes(probe)
        return self.block_manager.pin(pin_id, probe.block_hashes, max_pinned_blocks)

    def unpin_prefix(self, pin_id: str) -> None:
        self.block_manager.unpin(pin_id)

    def stats(self) -> EngineStats:
        blocks = self.block_manager.stats()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=blocks.usage, num_blocks=blocks.num_blocks, num_free_blocks=blocks.num_free_blocks,
            num_cached_blocks=blocks.num_cached_blocks, num_pinned_blocks=blocks.num_pinned_blocks,
            prefix_queries=blocks.prefix_queries,
            prefix_hits=blocks.prefix_hits, prefix_host_hits=blocks.prefix_host_hits,
            num_host_cached_blocks=blocks.num_host_cached_blocks, host_cache_stores=blocks.host_cache_stores,
            evictions=blocks.evictions,
            preemptions=self.scheduler.num_preemptions, kv_allocated_slots=blocks.allocated_slots,
            kv_used_slots=blocks.used_slots, prompt_tokens=self.counters.prompt_tokens,
            generation_tokens=self.counters.generation_tokens, steps=self.counters.steps,
            finished=dict(self.counters.finished),
        )


class LLM:
    """Offline API: ``LLM().generate(["Hello"], SamplingParams(max_tokens=32))``."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Prompts as strings (tokenized here) or token-id lists; the final outputs in the prompts' order, and
        for a prompt with ``n`` > 1 its ``n`` samples one after another in ``index`` order (with ``best_of``:
        the ``n`` of highest cumulative logprob, best first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        ids = [self._encode(p) if isinstance(p, str) else list(p) for p in prompts]
        request_ids = [f"offline-{next(_OFFLINE_IDS)}" for _ in ids]
        for request_id, prompt_ids, p in zip(request_ids, ids, params):
            self.engine.add_request(request_id, prompt_ids, p or SamplingParams(), cache_salt=cache_salt)
        finals: dict[str, list[RequestOutput]] = {r: [] for r in request_ids}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finals[output.request_id].append(output)
        results = []
        for request_id, p in zip(request_ids, params):
            p = p or SamplingParams()
            samples = sorted(finals[request_id], key=lambda out: out.index)
            results += best_choices(samples, p.n) if p.best_of is not None else samples
        return results

    def beam_search(self, prompts: str | list[int] | list[str | list[int]], beam_width: int = 4,
                    max_tokens: int = 16, length_penalty: float = 1.0, early_stopping: bool | str = False,
                    n: int = 1, ignore_eos: bool = False) -> list[RequestOutput]:
        """Beam search (transformers' ``generate(num_beams=beam_width, do_sample=False)`` rules); per prompt
        the ``n`` best hypotheses, best first."""
        params = SamplingParams(use_beam_search=True, beam_width=beam_width, max_tokens=max_tokens, n=n,
                                length_penalty=length_penalty, early_stopping=early_stopping, ignore_eos=ignore_eos)
        return self.generate(prompts, params)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt_ids(c) for c in conversations], sampling_params)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self._require_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode(self, text: str) -> list[int]:
        return self._require_tokenizer().encode(text)

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("prompts: this model has no tokenizer (dummy weights); pass token ids")
        return self.tokenizer


_OFFLINE_IDS = itertools.count()
