"""A step's verified drafts handed to their requests (speculative decoding, engine/speculative/).

After a step with drafts, each drafted sequence's rows' samples decide the tokens it gains (Speculator.accept:
its drafts out of ``token_ids``, the kept ones and one more back). Its KV now holds its last token and the kept
drafts: the scheduler advances it by that many (registering the blocks they filled), then the tokens are appended
one by one with the stop checks of plain decoding, so a stop token or the length limit among them ends the sample
there and the tokens after it are not sent. One delta carries the rest, with each token's logprobs (its row's)
where asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.output.outputs import SampleDelta
from engine.output.structured_output import accept as accept_grammar
from engine.runtime.requests import Sample, stop_status
from engine.sample.token_logprobs import TokenLogprobs
from engine.sequence import Sequence, SequenceStatus
from engine.speculative.speculator import Speculator
from engine.core.metrics import EngineCounters
from engine.core.scheduled_batch import ScheduledBatch
from engine.worker.model_runner import ModelRunner
from engine.worker.step_sampler import LaunchedStep

logger = logging.getLogger(__name__)


def new_speculative_steps(
    config: EngineConfig,
    scheduler: Scheduler,
    counters: EngineCounters,
    runner: ModelRunner,
    finish: Callable[[Sequence, SequenceStatus], None],
    emit: Callable[[Sample, list[TokenLogprobs] | None], SampleDelta],
    fail: Callable[[Sample, Exception], SampleDelta],
) -> SpeculativeSteps | None:
    """The core's speculative steps under ``config.speculative`` (None: off, or a model with sliding-window
    layers, whose window blocks are released as the window passes: drafts there are not supported yet)."""
    if not config.speculative:
        return None
    if runner.kv.window:
        logger.warning("speculative decoding is off: the model has sliding-window layers")
        return None
    speculator = Speculator(
        config,
        scheduler.block_manager,
        scheduler.step_cost,
        counters,
        runner.model.args.vocab_size,
        runner.draft,
    )
    return SpeculativeSteps(config, speculator, scheduler, finish, emit, fail)


class SpeculativeSteps:
    def __init__(
        self,
        config: EngineConfig,
        speculator: Speculator,
        scheduler: Scheduler,
        finish: Callable[[Sequence, SequenceStatus], None],
        emit: Callable[[Sample, list[TokenLogprobs] | None], SampleDelta],
        fail: Callable[[Sample, Exception], SampleDelta],
    ) -> None:
        self.eos_token_ids, self.max_model_len = config.eos_token_ids, config.max_model_len
        self.speculator, self.scheduler = speculator, scheduler
        self.finish, self.emit, self.fail = finish, emit, fail

    def extend(self, batch: ScheduledBatch) -> ScheduledBatch:
        """``batch`` with drafts where they are worth their rows (Speculator.extend)."""
        return self.speculator.extend(batch)

    def wants_known(self, batch: ScheduledBatch) -> bool:
        """Whether the step in flight must be read before ``batch`` is given drafts (Speculator.wants_known)."""
        return self.speculator.wants_known(batch)

    def apply(
        self,
        launched: LaunchedStep,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
        samples: dict[int, Sample],
    ) -> tuple[list[SampleDelta], int]:
        """The deltas of ``launched``'s drafted sequences (their rows follow the plain ones), and the tokens
        they gained."""
        deltas, gained = [], 0
        row = len(launched.pending_indices)
        for seq, num_drafts in launched.drafts.items():
            rows = range(row, row + num_drafts + 1)
            row += num_drafts + 1
            sample = samples.get(seq.seq_id)
            if sample is None or seq.is_finished:  # (aborted meanwhile: its drafts went with it)
                continue
            failed = [launched.failures[r] for r in rows if r in launched.failures]
            if failed:
                del seq.token_ids[-num_drafts:]
                deltas.append(self.fail(sample, RuntimeError(failed[0])))
                continue
            tokens = self.speculator.accept(seq, num_drafts, token_ids[rows.start : rows.stop])
            deltas.append(self._append(sample, tokens, logprobs[rows.start : rows.stop]))
            gained += len(deltas[-1].token_ids)
        return deltas, gained

    def _append(
        self, sample: Sample, tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> SampleDelta:
        seq = sample.seq
        base = len(seq.token_ids)
        # KV was written for its last token and the kept drafts: those blocks are registered with their tokens
        seq.token_ids.extend(tokens)
        self.scheduler.advance([(seq, len(tokens))])
        del seq.token_ids[base:]
        kept: list[TokenLogprobs] = []
        for token_id, token_logprobs in zip(tokens, logprobs):
            seq.token_ids.append(token_id)
            if token_logprobs is not None:
                kept.append(token_logprobs)
            if seq.grammar is not None:
                try:
                    accept_grammar(seq, token_id)
                except (
                    ValueError
                ) as exc:  # (its request ends with the error, the tokens before it sent)
                    del seq.token_ids[-1]
                    kept = kept[: len(seq.token_ids) - base]
                    return self.fail(sample, exc)
            status = stop_status(seq, token_id, self.eos_token_ids, self.max_model_len)
            if status is not None:
                self.finish(seq, status)
                break
        return self.emit(sample, kept or None)
